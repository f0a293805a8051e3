"""On a GPU: the Triton kernels, MXFP8, AutoAC and shuffling together, and the kernels against
the padded PyTorch model."""

import math

import pytest
import torch
from gem_train.data.synthetic import SyntheticStream
from gem_train.model import GemModel, loss_of
from gem_train.train import train

# Dimensions the MXFP8 GEMMs accept (multiples of 128), small enough for seconds.
GPU = {
    "device": "cuda", "model__d_model": 256, "model__n_heads": 2, "model__ffn_hidden": 512,
    "model__mlp_hidden": 256, "model__emb_dim": 32, "data__batch_size": 32, "data__median_len": 64,
    "data__max_len": 2048, "data__eval_batches": 4,
}  # fmt: skip


@pytest.mark.gpu
def test_everything_on_trains_on_cuda(small):
    summary = train(
        small(
            **GPU,
            steps=8,
            lowprec__recipe="mxfp8",
            lowprec__autocast_bf16=True,
            memory__autoac=True,
        )
    )
    assert any(n.startswith("AutoAC") for n in summary["optimisations"])
    assert all(math.isfinite(x) for x in summary["losses"])
    assert summary["e2e_mfu"] > 0


@pytest.mark.gpu
def test_kernels_match_the_padded_model_on_cuda(small):
    jagged = small(**GPU)
    padded = small(**GPU, model__attention="padded", model__pooling_attention="padded")
    batch = SyntheticStream(jagged.data, jagged.model).batch(0).to("cuda")
    outputs = []
    for cfg in (jagged, padded):
        torch.manual_seed(0)
        model = GemModel(cfg.model).cuda()
        logits = model(batch)
        loss, _ = loss_of(logits, batch)
        loss.backward()
        grad = model.dense.blocks[0].attn.qkv.weight.grad
        outputs.append((logits["ctr"].detach(), grad))
    (logits_j, grad_j), (logits_p, grad_p) = outputs
    # fp32 inputs: the Triton kernels' dots may run in TF32, SDPA's in full fp32.
    torch.testing.assert_close(logits_j, logits_p, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_j, grad_p, rtol=5e-2, atol=1e-3)
