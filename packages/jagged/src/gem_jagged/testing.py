"""Tools for property-testing jagged kernels against their references.

Two things every jagged op's tests need, published so users testing their own kernels can reuse
them (install with the ``testing`` extra, which brings hypothesis):

``jagged_lengths``
    A hypothesis strategy over lists of sequence lengths drawn from the shapes that break jagged
    kernels: empty sequences, length one, lengths one either side of a block edge, all equal, one
    giant sequence among small ones, and heavy (log-normal) tails.

``assert_within_reference_error``
    The project's tolerance rule. A kernel computing in a low-precision dtype cannot match fp64
    exactly; the yardstick is how far the *reference* implementation lands from fp64 when it runs
    in that same dtype. The kernel's error must be at most ``factor`` times the reference's
    (2× for forward outputs, 5× for gradients), plus a floor of a few ulps of the output's scale so
    that an exactly-representable case does not demand exactness.

``compiled_kernel_variants``
    How many compiled variants the Triton kernels of the loaded modules hold (on a GPU). A kernel
    that specialises on a batch-dependent integer compiles again on new batches; the count
    staying put over a run of fresh batches is the test that it does not.
"""

import sys

import torch

__all__ = [
    "jagged_lengths",
    "offsets_from_lengths",
    "assert_within_reference_error",
    "compiled_kernel_variants",
    "kernel_variants",
]

_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}


def offsets_from_lengths(lengths, *, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """``[B+1]`` offsets (starting at 0) of a list of lengths."""
    lengths_B = torch.as_tensor(list(lengths), dtype=torch.int64)
    offsets_Bp1 = torch.zeros(lengths_B.numel() + 1, dtype=torch.int64)
    offsets_Bp1[1:] = torch.cumsum(lengths_B, 0)
    return offsets_Bp1.to(device=device, dtype=dtype)


def jagged_lengths(
    *, max_batch: int = 6, max_len: int = 80, block: int = 16, giant: int | None = None
):
    """Hypothesis strategy: a list of 1..max_batch lengths in [0, max_len] shaped to break kernels.

    ``block`` is the kernel's tile edge (lengths ``block - 1``, ``block``, ``block + 1`` are drawn
    often); ``giant`` (default ``max_len``) is the length of the one long sequence among short ones.
    """
    from hypothesis import strategies as st

    giant = max_len if giant is None else giant
    batch = st.integers(min_value=1, max_value=max_batch)
    edges = sorted(
        {v for k in (1, 2) for v in (k * block - 1, k * block, k * block + 1) if 0 <= v <= max_len}
    )

    def heavy_tail(draw_seed_and_b):
        seed, b = draw_seed_and_b
        gen = torch.Generator().manual_seed(seed)
        raw = torch.exp(
            torch.randn(b, generator=gen) * 1.2 + torch.log(torch.tensor(max_len / 6 + 1.0))
        )
        return [int(v) for v in raw.clamp(0, max_len).tolist()]

    return st.one_of(
        st.lists(st.integers(0, max_len), min_size=1, max_size=max_batch),
        st.lists(st.sampled_from([0, 1]), min_size=1, max_size=max_batch),
        st.lists(st.sampled_from(edges or [1]), min_size=1, max_size=max_batch),
        st.tuples(st.integers(0, max_len), batch).map(lambda lb: [lb[0]] * lb[1]),
        st.tuples(
            st.lists(st.integers(0, 3), min_size=0, max_size=max_batch - 1),
            st.integers(0, max_batch - 1),
        ).map(lambda sp: sp[0][: sp[1]] + [giant] + sp[0][sp[1] :]),
        st.tuples(st.integers(0, 2**31 - 1), batch).map(heavy_tail),
    )


def _max_abs_err(x: torch.Tensor, ref64: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.detach().to(torch.float64) - ref64.detach().to(torch.float64)).abs().max().item()


def assert_within_reference_error(
    actual: torch.Tensor,
    reference_lowp: torch.Tensor,
    reference_fp64: torch.Tensor,
    *,
    factor: float,
    name: str = "output",
    floor_ulps: float = 4.0,
) -> None:
    """Assert ``err(actual) <= factor * err(reference_lowp) + floor`` with errors against fp64.

    ``err`` is the largest absolute difference; ``floor`` is ``floor_ulps`` units of the low
    dtype's epsilon times the largest magnitude of the fp64 result (at least 1).
    """
    if actual.shape != reference_fp64.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(reference_fp64.shape)}"
        )
    if torch.isnan(actual).any() and not torch.isnan(reference_fp64).any():
        raise AssertionError(f"{name}: holds NaN where the fp64 reference has none")
    err_actual = _max_abs_err(actual, reference_fp64)
    err_ref = _max_abs_err(reference_lowp, reference_fp64)
    scale = max(1.0, reference_fp64.detach().abs().max().item() if reference_fp64.numel() else 1.0)
    floor = floor_ulps * _EPS.get(actual.dtype, 2.0**-23) * scale
    bound = factor * err_ref + floor
    if not err_actual <= bound:
        raise AssertionError(
            f"{name}: max error {err_actual:.3e} against fp64 exceeds {factor}x the reference's "
            f"{err_ref:.3e} in {reference_lowp.dtype} (+ floor {floor:.1e}) = {bound:.3e}"
        )


def kernel_variants(module_prefix: str | tuple[str, ...] = "gem_") -> dict[str, tuple[int, str]]:
    """``{"module.kernel": (compiled variants, newest specialisation key)}`` for every Triton
    kernel defined in the loaded modules whose name starts with ``module_prefix``, over all
    devices (no variants under the interpreter, which compiles nothing)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(module_prefix):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                caches = [c[0] for c in value.device_caches.values()]
                newest = next((str(list(c)[-1]) for c in caches if c), "")
                found[f"{name}.{attr}"] = (sum(len(c) for c in caches), newest)
    return found


def compiled_kernel_variants(module_prefix: str | tuple[str, ...] = "gem_") -> int:
    """How many compiled variants the Triton kernels of ``kernel_variants`` hold in all."""
    return sum(count for count, _ in kernel_variants(module_prefix).values())
