"""Offsets validation: every malformed offsets tensor is refused, a valid one is checked once."""

import pytest
import torch
from gem_jagged import _checks
from gem_jagged._checks import check_offsets


@pytest.mark.parametrize(
    "offsets, total, message",
    [
        (torch.tensor([[0, 1]]), 1, "must be 1-D"),
        (torch.tensor([0.0, 1.0]), 1, "int32 or int64"),
        (torch.tensor([], dtype=torch.int64), 0, "at least one entry"),
        (torch.tensor([1, 2]), 2, r"\[0\] must be 0"),
        (torch.tensor([0, 3, 2]), 2, "non-decreasing"),
        (torch.tensor([0, 2, 3]), 4, "must equal the number of tokens 4"),
    ],
)
def test_bad_offsets_are_refused_with_the_argument_named(offsets, total, message):
    with pytest.raises((ValueError, TypeError), match=message):
        check_offsets("q_offsets", offsets, total=total, device=offsets.device)
    with pytest.raises((ValueError, TypeError), match="q_offsets"):
        check_offsets("q_offsets", offsets, total=total, device=offsets.device)


def test_device_mismatch_is_refused():
    with pytest.raises(ValueError, match="values are on meta"):
        check_offsets("offsets", torch.tensor([0, 1]), total=1, device=torch.device("meta"))


@pytest.mark.gpu
def test_cuda_offsets_are_synced_once_and_rechecked_after_in_place_change():
    offsets = torch.tensor([0, 2, 5], device="cuda")
    check_offsets("offsets", offsets, total=5, device=offsets.device)
    assert _checks._already_checked(offsets, 5)
    assert not _checks._already_checked(offsets, 6)
    offsets[1] = 7  # bumps the version counter: the next call reads the values again
    with pytest.raises(ValueError, match="non-decreasing"):
        check_offsets("offsets", offsets, total=5, device=offsets.device)


def test_remembered_offsets_trace_under_compile():
    """Offsets remembered from an eager call (CUDA ones are; here a CPU tensor stands in) must
    not make ``torch.compile`` read their version counter: a graph cannot guard on it."""
    offsets = torch.tensor([0, 2, 5])
    _checks._remember_checked(offsets, 5, (2, 3))

    def fn(x):
        check_offsets("offsets", offsets, total=5, device=x.device)
        return x + 1

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.zeros(5)), torch.ones(5))


@pytest.mark.gpu
def test_inference_mode_offsets_are_checked_every_call():
    with torch.inference_mode():
        offsets = torch.tensor([0, 2, 5], device="cuda")  # an inference tensor: no version
        for _ in range(2):
            check_offsets("offsets", offsets, total=5, device=offsets.device)
        assert not _checks._already_checked(offsets, 5)


@pytest.mark.parametrize(
    "offsets, message",
    [
        (torch.tensor([[0, 1]]), "1-D"),
        (torch.tensor([0.0, 1.0]), "int32 or int64"),
        (torch.tensor([1, 2]), r"\[0\] must be 0"),
        (torch.tensor([0, 3, 2]), "non-decreasing"),
        ([0, 1], "torch.Tensor"),
        (torch.tensor([0, 1], device="meta"), "must be on the CPU"),
    ],
)
def test_offsets_to_device_checks_on_the_host(offsets, message):
    from gem_jagged import offsets_to_device

    with pytest.raises((ValueError, TypeError), match=message):
        offsets_to_device(offsets, "cpu")


def test_offsets_to_device_moves_the_values_unchanged():
    from gem_jagged import offsets_to_device

    offsets = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    moved = offsets_to_device(offsets, "cpu")
    assert moved.dtype == torch.int32 and torch.equal(moved, offsets)


@pytest.mark.gpu
def test_offsets_moved_checked_need_no_sync_at_the_op():
    """A jagged op on offsets moved by offsets_to_device reads no value back to the host."""
    from gem_jagged import jagged_flash_attention, offsets_to_device

    offsets = offsets_to_device(torch.tensor([0, 5, 5, 40]), "cuda")
    assert _checks._already_checked(offsets, 40)
    q = torch.randn(40, 2, 32, device="cuda", dtype=torch.bfloat16)
    jagged_flash_attention(q, q, q, offsets, causal=True, max_q_len=35)  # compile, build lists
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        jagged_flash_attention(q, q, q, offsets, causal=True, max_q_len=35)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="must equal the number of tokens 41"):
        check_offsets("offsets", offsets, total=41, device=offsets.device)
