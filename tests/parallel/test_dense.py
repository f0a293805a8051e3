"""Dense application on one rank: hooks run where the FP8 all-gather plugs in, mixed precision is
applied, errors are named. (Several ranks, and an FP8 all-gather through the hook:
test_dense_multiprocess.py; FSDP2 skips the all-gather extension on a one-rank mesh.)"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gem_parallel.dense import DenseParallelConfig, apply_dense_parallel
from gem_parallel.layout import MeshLayout
from gem_parallel.meshes import build_meshes
from gem_parallel.moe import MoE
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).parent))
from parallel_tiny_model import make_model  # noqa: E402


@pytest.fixture
def one_rank():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_meshes(MeshLayout(1, 1, 1), device_type="cpu")
    dist.destroy_process_group()


def test_hooks_and_mixed_precision(one_rank):
    hooked, fsdp_modules = [], []
    config = DenseParallelConfig(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        all_gather_hook=hooked.append,
        fsdp_module_hook=fsdp_modules.append,
    )
    model = make_model()
    blocks = list(model.layers)
    seen_dtypes = []
    model.layers[0].linear.register_forward_hook(lambda m, i, o: seen_dtypes.append(o.dtype))
    apply_dense_parallel(model, one_rank, config=config)
    assert hooked == blocks  # every block, before sharding
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert fsdp_modules == experts + blocks + [model]
    assert all(isinstance(m, FSDPModule) for m in fsdp_modules)
    loss = model(torch.randn(4, 16)).float().square().mean()
    loss.backward()
    assert seen_dtypes == [torch.bfloat16]  # compute ran in bf16
    for p in model.parameters():  # sharded fp32 master weights with fp32 gradients
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_ep_that_does_not_divide_the_experts_is_refused():
    class FakeMeshes:
        layout = MeshLayout(3, 1, 3, ep=3)

    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=4"):
        apply_dense_parallel(make_model(), FakeMeshes())


@pytest.mark.gpu
def test_bf16_hsdp_on_one_gpu_tracks_fp32_training():
    """FSDP2 with bf16 compute on NCCL (the GPU image's torch): three steps of the tiny model stay
    within bf16 tolerance of plain fp32 training."""
    from parallel_tiny_model import batches, make_optimizer, train_single_process

    expected, _ = train_single_process(1)
    meshes = build_meshes(MeshLayout(1, 1, 1), device_type="cuda")
    try:
        model = apply_dense_parallel(make_model().cuda(), meshes, config=DenseParallelConfig())
        opt = make_optimizer(model)
        losses = []
        for x, y in batches(1):
            loss = torch.nn.functional.mse_loss(model(x.cuda()).float(), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.testing.assert_close(losses, expected, rtol=3e-2, atol=3e-2)
    finally:
        dist.destroy_process_group()
