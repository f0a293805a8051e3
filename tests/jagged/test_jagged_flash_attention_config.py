"""The jagged flash attention config table, pinned: every (arch, dtype, head dim, regime, bias)
cell gives the tiles, warps, stages and code paths the kernels were measured with.

``TODAY`` holds the literal values of each cell as the tables gave them before the config
became a keyword-only dataclass (old field order: forward, dK/dV and dQ tiles as ``(block_m,
block_n, warps, stages)``, split rows, max splits, dQ diagonal chunk, then the booleans
``fwd_tma``, ``dq_in_dkdv``, ``fwd_hopper``, ``dkdv_hopper``, ``dq_hopper``). On sm_90 the
Gluon flags are the config's; on another CUDA arch the same tiles run the Triton kernels (the
launchers never took the Gluon kernels off sm_90).
"""

import pytest
import torch
from gem_jagged.ops.jagged_flash_attention.config import (
    DqPlacement,
    JaggedAttentionConfig,
    KernelImpl,
    KeyLoads,
    Regime,
    config_for,
    regime_for,
)

# fmt: off
INTERPRETER = ((16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1), 32, 3, 8, True, True, False, False, False)
TODAY = {
    ("bfloat16", 32, "short_keys", False): ((128, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, True, False, False, False),
    ("bfloat16", 32, "short_keys", True): ((128, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 32, "long", False): ((128, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 32, "long", True): ((128, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 64, "short_keys", False): ((128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, True, False, False, False),
    ("bfloat16", 64, "short_keys", True): ((128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 64, "long", False): ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 64, "long", True): ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 128, "short_keys", False): ((64, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2), 1024, 4, 64, False, True, False, False, False),
    ("bfloat16", 128, "short_keys", True): ((128, 64, 8, 3), (64, 64, 8, 2), (64, 64, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("bfloat16", 128, "long", False): ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), 1024, 4, 64, True, False, True, True, True),
    ("bfloat16", 128, "long", True): ((128, 64, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 32, "short_keys", False): ((128, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, True, False, False, False),
    ("float16", 32, "short_keys", True): ((128, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 32, "long", False): ((128, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 32, "long", True): ((128, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 64, "short_keys", False): ((128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, True, False, False, False),
    ("float16", 64, "short_keys", True): ((128, 64, 8, 3), (64, 64, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 64, "long", False): ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 64, "long", True): ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 128, "short_keys", False): ((64, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2), 1024, 4, 64, False, True, False, False, False),
    ("float16", 128, "short_keys", True): ((128, 64, 8, 3), (64, 64, 8, 2), (64, 64, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float16", 128, "long", False): ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), 1024, 4, 64, True, False, True, True, True),
    ("float16", 128, "long", True): ((128, 64, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 32, "short_keys", False): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 32, "short_keys", True): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 32, "long", False): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 32, "long", True): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 64, "short_keys", False): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 64, "short_keys", True): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 64, "long", False): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 64, "long", True): ((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 128, "short_keys", False): ((64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 128, "short_keys", True): ((64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 128, "long", False): ((64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
    ("float32", 128, "long", True): ((64, 32, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), 1024, 4, 64, False, False, False, False, False),
}
# fmt: on


def _old_fields(config: JaggedAttentionConfig) -> tuple:
    gluon = KernelImpl.GLUON_HOPPER
    tiles = tuple(
        (t.block_m, t.block_n, t.warps, t.stages) for t in (config.forward, config.dkdv, config.dq)
    )
    return (
        *tiles, config.split_rows, config.max_splits, config.dq_diag_chunk,
        config.key_loads == KeyLoads.TMA, config.dq_placement == DqPlacement.IN_DKDV,
        config.forward_impl == gluon, config.dkdv_impl == gluon, config.dq_impl == gluon,
    )  # fmt: skip


@pytest.mark.parametrize("cell", sorted(TODAY))
def test_sm90_cells_are_todays(cell):
    dtype, head_dim, regime, bias = cell
    got = config_for(
        arch="sm90", dtype=getattr(torch, dtype), head_dim=head_dim, regime=Regime(regime),
        rel_bias=bias,
    )  # fmt: skip
    assert _old_fields(got) == TODAY[cell]


@pytest.mark.parametrize("arch", ["sm80", "sm100"])
@pytest.mark.parametrize("cell", sorted(TODAY))
def test_other_cuda_archs_take_the_same_tiles_on_triton_kernels(cell, arch):
    dtype, head_dim, regime, bias = cell
    got = config_for(
        arch=arch, dtype=getattr(torch, dtype), head_dim=head_dim, regime=Regime(regime),
        rel_bias=bias,
    )  # fmt: skip
    assert _old_fields(got) == (*TODAY[cell][:-3], False, False, False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("regime", list(Regime))
@pytest.mark.parametrize("bias", [False, True])
def test_the_interpreter_cell_is_one_config(dtype, head_dim, regime, bias):
    got = config_for(
        arch="interpreter", dtype=dtype, head_dim=head_dim, regime=regime, rel_bias=bias
    )
    assert _old_fields(got) == INTERPRETER


def test_regime_from_keys_per_sequence():
    """The short-keys tiles take batches averaging at most 64 keys per sequence."""
    assert regime_for(total_kv=4096, num_seqs=64) == Regime.SHORT_KEYS
    assert regime_for(total_kv=4097, num_seqs=64) == Regime.LONG
    assert regime_for(total_kv=52498, num_seqs=64) == Regime.LONG
    assert regime_for(total_kv=0, num_seqs=0) == Regime.SHORT_KEYS


def test_a_config_crosses_the_custom_op_as_ints():
    for cell in TODAY:
        dtype, head_dim, regime, bias = cell
        config = config_for(
            arch="sm90", dtype=getattr(torch, dtype), head_dim=head_dim, regime=Regime(regime),
            rel_bias=bias,
        )  # fmt: skip
        ints = config.as_ints()
        assert all(type(x) is int for x in ints)
        assert JaggedAttentionConfig.from_ints(ints) == config
    with pytest.raises(ValueError, match="ints"):
        JaggedAttentionConfig.from_ints([1, 2, 3])


def test_config_is_keyword_only_and_frozen():
    config = config_for(
        arch="sm90", dtype=torch.bfloat16, head_dim=128, regime=Regime.LONG, rel_bias=False
    )
    with pytest.raises(TypeError):
        JaggedAttentionConfig(config.forward, config.dkdv, config.dq)
    with pytest.raises(AttributeError):
        config.split_rows = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="head dim 16"):
        config_for(arch="sm90", dtype=torch.float16, head_dim=16, regime=Regime.LONG, rel_bias=0)
