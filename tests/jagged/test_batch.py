"""``JaggedBatch``: one descriptor per batch, never stale, shared by forward and backward.

A batch owns a copy of its offsets, so no write into the caller's tensor (in place, through a
view, through ``.data``, through numpy memory, or a freed tensor whose id is reused) can reach
the work lists it keeps or the backward pass of a forward that used it.
"""

import gc

import numpy as np
import pytest
import torch
from gem_jagged import JaggedBatch, block_attention, gdpa, jagged_flash_attention
from gem_jagged.batch import as_batch
from gem_jagged.testing import offsets_from_lengths

LENGTHS = [5, 0, 9, 3]


def _qkv(total, *, heads=2, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=gen, requires_grad=True) for _ in range(3)]


BACKENDS = ["reference", "triton"]  # triton: the kernels, through Triton's interpreter here


def _attention_and_grads(offsets, q, k, v, backend="reference"):
    out = jagged_flash_attention(q, k, v, offsets, causal=True, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return out.detach(), grads


def test_a_checked_batch_knows_its_lengths_and_hints():
    batch = JaggedBatch(offsets_from_lengths(LENGTHS), max_len=1)
    assert (batch.num_seqs, batch.total, batch.max_len) == (4, 17, 9)  # the check wins
    assert batch.length_range.shortest == 0 and batch.is_self_attention
    unchecked = JaggedBatch(offsets_from_lengths(LENGTHS), max_len=11, validate=False)
    assert unchecked.length_range is None and unchecked.max_len == 11 and unchecked.total is None
    assert not unchecked.kv_lengths_known_within(0, 100)
    assert batch.kv_lengths_known_within(0, 9) and not batch.kv_lengths_known_within(1, 9)


def test_a_cross_batch_checks_both_sides():
    batch = JaggedBatch(offsets_from_lengths([2, 3]), offsets_from_lengths([64, 64]))
    assert not batch.is_self_attention and batch.total_kv == 128
    with pytest.raises(ValueError, match="kv_offsets has 1 sequences but offsets has 2"):
        JaggedBatch(offsets_from_lengths([2, 3]), offsets_from_lengths([4]))
    with pytest.raises(ValueError, match=r"kv_offsets\[0\] must be 0"):
        JaggedBatch(offsets_from_lengths([2, 3]), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_len=-1), "max_len must be None or a non-negative int"),
        (dict(max_kv_len=True), "max_kv_len must be None or a non-negative int"),
    ],
)
def test_bad_hints_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JaggedBatch(offsets_from_lengths(LENGTHS), **kwargs)


def test_from_host_checks_on_the_host_and_moves():
    host = offsets_from_lengths(LENGTHS, dtype=torch.int32)
    batch = JaggedBatch.from_host(host, device="cpu")
    assert batch.offsets.dtype == torch.int32 and torch.equal(batch.offsets, host)
    assert batch.offsets.data_ptr() != host.data_ptr() and batch.max_len == 9
    with pytest.raises(ValueError, match="non-decreasing"):
        JaggedBatch.from_host(torch.tensor([0, 3, 2]), device="cpu")
    with pytest.raises(ValueError, match="must be on the CPU"):
        JaggedBatch.from_host(torch.tensor([0, 1], device="meta"), device="cpu")


def test_from_host_adopts_a_device_copy_after_checking_it_matches():
    host = offsets_from_lengths(LENGTHS)
    moved = host.clone()
    batch = JaggedBatch.from_host(host, device="cpu", device_copy=moved)
    assert batch.offsets is moved and batch.max_len == 9
    with pytest.raises(ValueError, match="device_copy must have the offsets' dtype and shape"):
        JaggedBatch.from_host(host, device="cpu", device_copy=moved.int())
    with pytest.raises(ValueError, match="device_copy must have the offsets' dtype and shape"):
        JaggedBatch.from_host(host, device="cpu", device_copy=moved[:-1])
    with pytest.raises(ValueError, match="device_copy must be on meta"):
        JaggedBatch.from_host(host, device="meta", device_copy=moved)
    with pytest.raises(ValueError, match="self-attention"):
        JaggedBatch.from_host(host, host, device="cpu", device_copy=moved)
    with pytest.raises(ValueError, match="non-decreasing"):  # the host offsets are still checked
        JaggedBatch.from_host(torch.tensor([0, 3, 2]), device="cpu", device_copy=moved[:3])


def test_strided_offsets_are_copied_contiguous():
    strided = offsets_from_lengths([1, 1, 2, 2, 3, 3, 4, 4]).mul(1)[::2]  # [0, 2, 6, 12, 20]
    batch = JaggedBatch(strided)
    assert batch.offsets.is_contiguous() and torch.equal(batch.offsets, strided)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_reads_strided_offsets_as_their_values(backend):
    """A strided view (``x[::2]``) as offsets: the kernels index a contiguous copy, never the
    view's storage as if it were contiguous."""
    q, k, v = _qkv(17, seed=2)
    contiguous = offsets_from_lengths(LENGTHS)
    strided = torch.stack([contiguous, torch.full_like(contiguous, -7)], 1).reshape(-1)[::2]
    assert not strided.is_contiguous() and torch.equal(strided, contiguous)
    for op in (
        lambda o: jagged_flash_attention(q, k, v, o, causal=True, backend=backend),
        lambda o: gdpa(q, k, v, o, causal=True, backend=backend),
        lambda o: block_attention(q, k, v, o, block_size=4, backend=backend),
    ):
        want = op(contiguous)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        got = op(strided)
        got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_memo_builds_once_per_key_and_goes_with_the_batch():
    batch = JaggedBatch(offsets_from_lengths(LENGTHS))
    builds = []
    first = batch.memo(("k", 1), lambda: builds.append(1) or torch.zeros(1))
    assert batch.memo(("k", 1), lambda: builds.append(1) or torch.zeros(1)) is first
    batch.memo(("k", 2), lambda: builds.append(2) or torch.zeros(1))
    assert builds == [1, 2]
    with torch.inference_mode():  # an inference tensor could not be saved for a backward
        assert batch.memo(("k", 3), lambda: torch.zeros(1)) is not batch.memo(
            ("k", 3), lambda: torch.zeros(1)
        )


def test_as_batch_passes_a_batch_through_and_refuses_two_kv_sides():
    batch = JaggedBatch(offsets_from_lengths(LENGTHS))
    assert as_batch(batch) is batch
    with pytest.raises(ValueError, match="holds both sides"):
        as_batch(batch, offsets_from_lengths(LENGTHS))
    with pytest.raises(TypeError, match="pass a JaggedBatch as q_offsets"):
        as_batch(offsets_from_lengths(LENGTHS), batch)


def _mutators():
    """Each way a caller can rewrite offsets behind the batch's back, as (name, fn(offsets))."""
    new = offsets_from_lengths([9, 3, 5, 0])

    def in_place(t):
        t.copy_(new)

    def through_view(t):
        t[1:].view(-1).copy_(new[1:])

    def through_data(t):  # bypasses the version counter
        t.data.copy_(new)

    def through_numpy(t):  # shares memory, bypasses torch entirely
        np.copyto(t.numpy(), new.numpy())

    return [in_place, through_view, through_data, through_numpy]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate", _mutators(), ids=lambda f: f.__name__)
def test_a_mutated_offsets_tensor_never_serves_a_stale_result(mutate, backend):
    offsets = offsets_from_lengths(LENGTHS)
    q, k, v = _qkv(17)
    batch = JaggedBatch(offsets)
    before, _ = _attention_and_grads(batch, q, k, v, backend)  # builds the batch's work lists
    mutate(offsets)
    # The batch still describes the batch it was built for: its lists and results are unchanged.
    again, _ = _attention_and_grads(batch, q, k, v, backend)
    torch.testing.assert_close(again, before, rtol=0, atol=0)
    # A new batch (or the plain tensor) over the changed offsets computes the new layout.
    fresh, _ = _attention_and_grads(JaggedBatch(offsets), q, k, v, backend)
    plain, _ = _attention_and_grads(offsets, q, k, v, backend)
    expected, _ = _attention_and_grads(offsets_from_lengths([9, 3, 5, 0]), q, k, v, backend)
    torch.testing.assert_close(fresh, expected, rtol=0, atol=0)
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)
    assert not torch.equal(fresh, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate", _mutators(), ids=lambda f: f.__name__)
def test_backward_uses_exactly_the_offsets_its_forward_saw(mutate, backend):
    q, k, v = _qkv(17, seed=1)
    for op in (
        lambda o: jagged_flash_attention(q, k, v, o, causal=True, backend=backend),
        lambda o: gdpa(q, k, v, o, causal=True, backend=backend),
        lambda o: block_attention(q, k, v, o, block_size=4, backend=backend),
    ):
        reference = torch.autograd.grad(op(offsets_from_lengths(LENGTHS)).square().sum(), (q, k, v))
        offsets = offsets_from_lengths(LENGTHS)
        out = op(offsets)  # a plain tensor: the op builds and keeps its own batch
        mutate(offsets)  # between the forward and the backward
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        for got, want in zip(grads, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_freed_offsets_tensor_whose_id_is_reused_is_not_mistaken_for_it():
    q, k, v = _qkv(17, seed=2)
    results = {}
    for lengths in ([5, 0, 9, 3], [9, 3, 5, 0], [1, 1, 1, 14]):
        offsets = offsets_from_lengths(lengths)
        results[tuple(lengths)] = (id(offsets), _attention_and_grads(offsets, q, k, v)[0])
        del offsets
        gc.collect()
    for lengths, (_, out) in results.items():
        expected, _ = _attention_and_grads(offsets_from_lengths(list(lengths)), q, k, v)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_from_host_batch_needs_no_sync_at_the_op():
    """An op on a batch checked on the host reads nothing back from the device."""
    batch = JaggedBatch.from_host(torch.tensor([0, 5, 5, 40]), device="cuda")
    q = torch.randn(40, 2, 32, device="cuda", dtype=torch.bfloat16)
    jagged_flash_attention(q, q, q, batch, causal=True)  # compile, build the lists
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        jagged_flash_attention(q, q, q, batch, causal=True)
        gdpa(q, q, q, batch, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_moving_host_offsets_asynchronously_never_waits_for_the_device():
    """``from_host(non_blocking=True)`` and ``with_queries`` of CPU offsets return while the GPU
    is still busy: staged through pageable memory, the copy would first wait for every queued
    kernel (a synchronisation that ``set_sync_debug_mode`` does not report)."""
    host = offsets_from_lengths([5, 0, 9, 3])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
    busy = torch.cuda.Event()
    busy.record()
    batch = JaggedBatch.from_host(host, device="cuda", non_blocking=True)
    cross = batch.with_queries(torch.arange(5) * 2)
    still_busy = not busy.query()
    host.fill_(7)  # the batch owns its copy, also while the copy is in flight
    torch.cuda.synchronize()
    assert still_busy, "moving host offsets waited for the GPU"
    assert batch.offsets.tolist() == [0, 5, 5, 14, 17]
    assert cross.offsets.tolist() == [0, 2, 4, 6, 8] and cross.kv_offsets is batch.offsets


@pytest.mark.gpu
def test_a_batch_built_inside_a_captured_graph_follows_the_static_offsets():
    """The capture pattern: copy the next batch's offsets into the static tensor, replay."""
    static = offsets_from_lengths([5, 300, 17], device="cuda")
    q = torch.randn(322, 2, 64, device="cuda", dtype=torch.bfloat16)
    jagged_flash_attention(q, q, q, JaggedBatch(static), causal=True)  # warm up
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = jagged_flash_attention(q, q, q, JaggedBatch(static), causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    static.copy_(offsets_from_lengths([300, 5, 17], device="cuda"))  # the next batch
    graph.replay()
    expected = jagged_flash_attention(
        q, q, q, offsets_from_lengths([300, 5, 17], device="cuda"), causal=True
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
