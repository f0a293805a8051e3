"""``gem_lowprec._launch.CachedLaunch``: a known specialization launches its binary directly, a new
one (alignment, an integer's 1 / 16-divisibility / width, a keyword) goes through ``kernel[grid]``,
and anything unmodelled always does. CPU tests use a stand-in kernel; the GPU test runs the fp8
row cast through both paths and checks the bits."""

from dataclasses import dataclass

import pytest
import torch
from gem_lowprec import _launch


@dataclass
class Param:
    name: str
    is_constexpr: bool


class Binary:
    """Stands in for a ``CompiledKernel``: records direct launches."""

    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class Kernel:
    """Stands in for a ``JITFunction``: records launches through ``kernel[grid]``."""

    def __init__(self, params, returns_binary=True):
        self.params = params
        self.log = []
        self.returns_binary = returns_binary

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Binary(self.log) if self.returns_binary else None

        return launch


SIGNATURE = [Param("x_ptr", False), Param("n", False), Param("BLOCK", True), Param("FAST", True)]


@pytest.fixture
def compiled_mode(monkeypatch):
    """As on a GPU: not interpreting, device 0 current."""
    monkeypatch.setattr(_launch, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _paths(kernel):
    return [entry[0] for entry in kernel.log]


def test_a_known_key_launches_the_binary_with_constexprs_in_signature_order(compiled_mode):
    kernel = Kernel(SIGNATURE)
    run = _launch.CachedLaunch(kernel)
    x = torch.zeros(64, dtype=torch.int16)
    run[(3,)](x, 32, BLOCK=16, FAST=True, num_warps=4)
    run[(5, 2)](x, 48, BLOCK=16, FAST=True, num_warps=4)  # same key: 48 % 16 == 0, not 1
    assert _paths(kernel) == ["jit", "direct"]
    assert kernel.log[1] == ("direct", (5, 2, 1), (x, 48, 16, True))
    assert run.binaries() == 1


@pytest.mark.parametrize(
    "change",
    [
        "misaligned tensor",
        "other dtype",
        "integer not divisible by 16",
        "integer equal to 1",
        "integer past int32",
        "other constexpr",
        "other option",
    ],
)
def test_any_change_triton_specializes_on_goes_through_the_jit_launch(compiled_mode, change):
    kernel = Kernel(SIGNATURE)
    run = _launch.CachedLaunch(kernel)
    x = torch.zeros(64, dtype=torch.int16)
    # 17 before 1: neither divides by 16, so only "equals 1" tells them apart
    args = [x, 17 if change == "integer equal to 1" else 32]
    kwargs = dict(BLOCK=16, FAST=True, num_warps=4)
    run[(1,)](*args, **kwargs)
    if change == "misaligned tensor":
        args[0] = x[1:]  # 2 bytes past a 16-byte boundary
        assert args[0].data_ptr() % 16 != 0
    elif change == "other dtype":
        args[0] = torch.zeros(64, dtype=torch.float32)
    elif change == "integer not divisible by 16":
        args[1] = 33
    elif change == "integer equal to 1":
        args[1] = 1
    elif change == "integer past int32":
        args[1] = 2**31 + 16
    elif change == "other constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 8
    run[(1,)](*args, **kwargs)
    assert _paths(kernel) == ["jit", "jit"]
    run[(1,)](*args, **kwargs)  # and the new key is remembered
    assert _paths(kernel) == ["jit", "jit", "direct"]
    assert run.binaries() == 2


def test_what_the_key_does_not_model_always_takes_the_jit_launch(compiled_mode):
    x = torch.zeros(16)
    cases = [
        (Kernel(SIGNATURE), (x, "a string"), dict(BLOCK=16, FAST=True)),  # unmodelled type
        (Kernel(SIGNATURE), (x, 16), dict(BLOCK=16)),  # FAST left at a default
        (Kernel(SIGNATURE), (x,), dict(n=16, BLOCK=16, FAST=True)),  # runtime arg by keyword
        (Kernel(SIGNATURE), (x, 16), dict(BLOCK=[16], FAST=True)),  # unhashable keyword
        (Kernel([Param("BLOCK", True), Param("x_ptr", False)]), (x,), dict(BLOCK=16)),
        (Kernel(SIGNATURE, returns_binary=False), (x, 16), dict(BLOCK=16, FAST=True)),
    ]
    for kernel, args, kwargs in cases:
        run = _launch.CachedLaunch(kernel)
        for _ in range(3):
            run[(1,)](*args, **kwargs)
        assert _paths(kernel) == ["jit"] * 3, kernel.params
        assert run.binaries() == 0


def test_the_interpreter_always_takes_the_jit_launch(monkeypatch):
    monkeypatch.setattr(_launch, "INTERPRETING", True)
    kernel = Kernel(SIGNATURE)
    run = _launch.CachedLaunch(kernel)
    for _ in range(2):
        run[(1,)](torch.zeros(16), 16, BLOCK=16, FAST=True)
    assert _paths(kernel) == ["jit", "jit"]


def test_one_launcher_per_kernel():
    kernel = Kernel(SIGNATURE)
    assert _launch.launcher(kernel) is _launch.launcher(kernel)


@pytest.mark.gpu
def test_gpu_cached_launches_give_the_bits_of_the_first_and_respecialize_on_alignment():
    """The fp8 row cast run three times: the first call compiles (or finds) the binary through
    ``kernel[grid]``, the second launches it directly, the third reads a tensor 2 bytes off a
    16-byte boundary and must take a binary specialized for that. Every result matches the
    reference bit for bit."""
    from gem_lowprec.ops.fp8_cast import cast_rows
    from gem_lowprec.ops.fp8_cast import triton as kernels

    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(4096 * 1024 + 1, generator=gen) * 3).to(torch.bfloat16)
    on_gpu = base.cuda()
    aligned, misaligned = on_gpu[:-1].view(4096, 1024), on_gpu[1:].view(4096, 1024)
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 == 2
    run = _launch.launcher(kernels.cast_rows_kernel)
    for x in (aligned, aligned, misaligned, misaligned):
        got = cast_rows(x, transposed=False)
        want = cast_rows(x.cpu(), transposed=False, backend="reference")
        assert torch.equal(got.data.cpu(), want.data) and torch.equal(got.scale.cpu(), want.scale)
    assert run.binaries() >= 2  # one binary per alignment of x
