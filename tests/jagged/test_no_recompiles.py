"""On a GPU: once the jagged kernels have met a few batches, new batches compile nothing.

Triton compiles a kernel again for every new combination of its integer arguments' divisibility
and its pointers' alignment. Token counts, sequence counts and work-list sizes change with every
jagged batch; a kernel specialised on them compiled a fresh variant (hundreds of ms) on many
steps of a training run. Each case below runs forward + backward on warm-up batches, then on
fresh batches of other token and sequence counts (heavy-tailed lengths, every residue mod 16),
and counts the compiled variants before and after. On the CPU, a check of the kernels'
signatures: every token-total argument is among the names left unspecialised.
"""

import math

import pytest
import torch
from gem_jagged import block_attention, gdpa, jagged_flash_attention
from gem_jagged.testing import compiled_kernel_variants, offsets_from_lengths

HEADS, HEAD_DIM = 2, 64


def _lengths(gen: torch.Generator, num_seqs: int) -> list[int]:
    """Log-normal lengths (median 60, tail to ~2k) with an empty and a length-one sequence."""
    normal = torch.randn(num_seqs, generator=gen, dtype=torch.float64)
    lengths = [min(4096, int(math.exp(4.1 + 1.2 * z))) for z in normal.tolist()]
    return [0, 1, *lengths[2:]]


def _run(case: str, lengths: list[int], gen: torch.Generator) -> None:
    device, dtype = "cuda", torch.bfloat16
    total, num_seqs = sum(lengths), len(lengths)
    offsets = offsets_from_lengths(lengths, device=device)

    def rand(rows):
        return torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()

    k, v = rand(total), rand(total)
    if case == "jfa self, causal, bias":
        bias = torch.zeros(HEADS, 33, device=device, requires_grad=True)
        q = rand(total)
        out = jagged_flash_attention(
            q, k, v, offsets, causal=True, rel_bias=bias, max_q_len=max(lengths)
        )
    elif case == "jfa cross, 8 queries each":
        q = rand(8 * num_seqs)
        q_offsets = torch.arange(num_seqs + 1, device=device) * 8
        out = jagged_flash_attention(q, k, v, q_offsets, offsets)
    elif case == "gdpa self, causal":
        q = rand(total)
        out = gdpa(q, k, v, offsets, offsets, activation="silu", causal=True)
    elif case == "gdpa cross, 8 queries each":
        q = rand(8 * num_seqs)
        q_offsets = torch.arange(num_seqs + 1, device=device) * 8
        out = gdpa(q, k, v, q_offsets, offsets, activation="silu")
    elif case == "gdpa pma, 4 seeds":
        q = rand(4)
        out = gdpa(q, k, v, offsets, offsets, activation="silu", broadcast_q=True)
    else:
        q = rand(total)
        out = block_attention(q, k, v, offsets, causal=True, rope_theta=10000.0)
    out.float().square().sum().backward()


CASES = [
    "jfa self, causal, bias",
    "jfa cross, 8 queries each",
    "gdpa self, causal",
    "gdpa cross, 8 queries each",
    "gdpa pma, 4 seeds",
    "block, causal, rope",
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_fresh_batches_compile_nothing(case):
    gen = torch.Generator().manual_seed(0)
    for num_seqs in (64, 64, 48, 80, 64, 64):  # warm-up
        _run(case, _lengths(gen, num_seqs), gen)
    before = compiled_kernel_variants()
    seen = set()
    for num_seqs in (64, 63, 65, 64, 50, 64, 77, 64):
        lengths = _lengths(gen, num_seqs)
        seen.add(sum(lengths) % 16)
        _run(case, lengths, gen)
    torch.cuda.synchronize()
    assert compiled_kernel_variants() - before == 0, (
        f"{case}: fresh batches compiled {compiled_kernel_variants() - before} new kernel variants"
    )
    assert len(seen) >= 4, f"the fresh batches met too few token-count residues mod 16: {seen}"


@pytest.mark.gpu
def test_the_split_dkdv_path_reuses_the_unsplit_kernel():
    """A batch whose longest sequence is long enough to split the dK/dV work (one 6k-token user
    among short ones) runs the same compiled dK/dV kernel as the batches before it."""
    from gem_jagged.ops.jagged_flash_attention.config import config_for_inputs
    from gem_jagged.ops.jagged_flash_attention.triton import _jfa_dkdv_kernel, dkdv_splits

    def dkdv_variants():
        return sum(len(cache[0]) for cache in _jfa_dkdv_kernel.device_caches.values())

    gen = torch.Generator().manual_seed(0)
    _run("jfa self, causal, bias", [96] * 64, gen)
    before = dkdv_variants()
    giant = [6144] + [32] * 63
    q = torch.empty(sum(giant), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cfg = config_for_inputs(q, q, torch.empty(65, device="cuda"), rel_bias=False)
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = dkdv_splits(
        cfg, total_q=sum(giant), total_kv=sum(giant), num_seqs=64, num_heads=HEADS,
        longest_q=6144, causal=True, sm_count=sm_count,
    )  # fmt: skip
    assert splits > 1, "the giant batch was meant to split the dK/dV work"
    _run("jfa self, causal, bias", giant, gen)
    torch.cuda.synchronize()
    assert dkdv_variants() == before, "the split dK/dV path compiled its own kernel variant"


def test_token_totals_are_never_specialised():
    """Every kernel argument holding a token total (``total_*``) is among the names that
    ``gem_jagged._jit`` leaves unspecialised (CPU): an argument named otherwise, say
    ``total_kv``, compiled a variant per residue of the batch's key count mod 16."""
    import importlib
    import inspect
    import pkgutil

    import gem_jagged
    from gem_jagged._jit import BATCH_DEPENDENT

    kernels = {}
    for info in pkgutil.walk_packages(gem_jagged.__path__, "gem_jagged."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.endswith("_kernel") and callable(getattr(value, "fn", None)):
                kernels[f"{info.name}.{name}"] = inspect.signature(value.fn).parameters
    assert any(name.endswith("._jfa_dkdv_kernel") for name in kernels), sorted(kernels)
    specialised = [
        f"{name}({param})"
        for name, params in kernels.items()
        for param in params
        if param.startswith("total") and param not in BATCH_DEPENDENT
    ]
    assert not specialised, specialised
