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


def _logits_and_grad(cfg, batch, *, autocast_bf16: bool):
    torch.manual_seed(0)
    model = GemModel(cfg.model).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_bf16):
        logits = model(batch)
    loss, _ = loss_of(logits, batch)
    loss.backward()
    return logits["ctr"].detach().float(), model.dense.blocks[0].attn.qkv.weight.grad


def _error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return (x.double() - reference.double()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "autocast_bf16",
    [True, False],
    ids=["bf16-autocast", "fp32"],  # gem-small's numerics; `gem-train --device cuda` on tiny
)
@pytest.mark.parametrize("schedule", ["per_sequence", "token_tiles"])
def test_kernels_match_the_padded_model_on_cuda(small, autocast_bf16, schedule):
    """The trainer's forward and backward with the Triton kernels against the padded PyTorch
    model, in both numerics the trainer feeds them on a GPU: BF16 under autocast (gem-small,
    ``lowprec.autocast_bf16=true``) and float32 (the default, e.g. ``tiny`` on CUDA).

    The reference is the padded model in float32. Under BF16 the tolerance rule of the design
    applies: the kernels' error is at most 2× (logits) and 5× (gradient) the error of the padded
    model run in BF16 too. In float32 the kernels' dots may run in TF32: errors within 1% (logits)
    and 5% (gradient) of the largest reference value. Both query schedules of the history
    attention (``model.jagged_schedule``).
    """
    jagged = small(**GPU, lowprec__autocast_bf16=autocast_bf16, model__jagged_schedule=schedule)
    padded = small(**GPU, model__attention="padded", model__pooling_attention="padded")
    batch = SyntheticStream(jagged.data, jagged.model).batch(0).to("cuda")
    logits_r, grad_r = _logits_and_grad(padded, batch, autocast_bf16=False)
    logits_j, grad_j = _logits_and_grad(jagged, batch, autocast_bf16=autocast_bf16)
    if autocast_bf16:
        logits_p, grad_p = _logits_and_grad(padded, batch, autocast_bf16=True)
        logits_bound = 2 * _error(logits_p, logits_r) + 1e-6
        grad_bound = 5 * _error(grad_p, grad_r) + 1e-6
    else:
        logits_bound = 1e-2 * logits_r.abs().max().item()
        grad_bound = 5e-2 * grad_r.abs().max().item()
    assert _error(logits_j, logits_r) <= logits_bound
    assert _error(grad_j, grad_r) <= grad_bound


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["none", "mxfp8"])
def test_training_steps_stop_compiling_kernels(small, recipe):
    """After a few steps, a step of fresh jagged batches compiles no Triton kernel: each new
    variant costs hundreds of ms of host time, and batch-dependent specialisations once made
    gem-small's steps 5–10× slower than their kernels (docs/history/performance.md)."""
    from gem_jagged.testing import kernel_variants
    from gem_train.components import build_run
    from gem_train.profiling import StepTimer
    from gem_train.train import train_step

    cfg = small(**GPU, steps=16, lowprec__recipe=recipe, lowprec__autocast_bf16=True)
    run = build_run(cfg)
    timer = StepTimer(run.device, enabled=False)
    for step in range(8):
        train_step(run, next(run.batches), step, timer)
    before = kernel_variants()
    for step in range(8, 16):
        train_step(run, next(run.batches), step, timer)
    torch.cuda.synchronize()
    after = kernel_variants()
    late = {name: key for name, (count, key) in after.items() if count > before.get(name, (0,))[0]}
    assert not late, f"steps 8–15 compiled new kernel variants: {late}"


@pytest.mark.gpu
@pytest.mark.parametrize("embedding_optimizer", ["adamw", "rowwise_adagrad"])
def test_training_steps_read_nothing_back_from_embeddings_or_offsets(small, embedding_optimizer):
    """The embedding lookups (ids per key known on the host), their fused row-wise Adagrad and
    the attention ops (history offsets checked on the host as they move) do not synchronise
    with the GPU in a step."""
    from gem_train.components import build_run
    from gem_train.profiling import StepTimer, count_syncs
    from gem_train.train import train_step

    run = build_run(
        small(
            **GPU, steps=6, lowprec__recipe="none", lowprec__autocast_bf16=True,
            model__embeddings="native", optim__embedding_optimizer=embedding_optimizer,
        )
    )  # fmt: skip
    timer = StepTimer(run.device, enabled=False)
    for step in range(3):
        train_step(run, next(run.batches), step, timer)
    _, sites = count_syncs(lambda: [train_step(run, next(run.batches), s, timer) for s in (3, 4)])
    offending = {s: n for s, n in sites.items() if "embeddings" in s or "_checks" in s}
    assert not offending, f"host syncs in a step: {dict(sites)}"


@pytest.mark.gpu
def test_a_training_step_never_waits_for_the_gpu(small):
    """Two whole steps queue while the GPU is still busy with earlier work. This catches what
    ``count_syncs`` cannot see: a copy from pageable host memory (the history or candidate
    offsets, say) or a pinned allocation first waits for every queued kernel, and the host then
    never runs ahead.

    What is under test is a step of sizes the run has met before, so the two steps' batches
    are first trained on once (copies staged anew): the first step of a new size may grow the
    caching allocator or pick new GEMM kernels, a one-off of a run's first steps
    (``benchmarks/diagnostics/host_waits.py --seen-sizes`` compares both)."""
    from gem_train.components import build_run
    from gem_train.data.loader import StepBatch
    from gem_train.profiling import StepTimer
    from gem_train.train import train_step

    run = build_run(small(**GPU, steps=8, lowprec__recipe="none", lowprec__autocast_bf16=True))
    timer = StepTimer(run.device, enabled=False)
    for step in range(3):
        train_step(run, next(run.batches), step, timer)
    prepared = [next(run.batches) for _ in range(2)]
    for step, batch in enumerate(prepared):
        train_step(run, StepBatch.of(batch.batch, staging=run.batches.staging), step, timer)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU clock cycles
    busy = torch.cuda.Event()
    busy.record()
    for step, batch in zip((3, 4), prepared, strict=True):
        train_step(run, batch, step, timer)
    still_busy = not busy.query()
    torch.cuda.synchronize()
    assert still_busy, "a training step waited for the GPU to finish earlier work"
