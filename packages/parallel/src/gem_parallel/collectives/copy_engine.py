"""Collectives moved by the GPUs' copy engines through PyTorch symmetric memory.

Each process group gets one workspace, kept in a ``CopyEngines`` object the caller holds: a buffer
allocated with
``torch.distributed._symmetric_memory.empty`` and exchanged once with ``rendezvous``, after which
every rank can address every peer's workspace as an ordinary CUDA tensor
(``handle.get_buffer(peer, shape, dtype, offset)``). A ``copy_`` between two contiguous tensors of
one dtype is a ``cudaMemcpyAsync``, which the DMA (copy) engines execute, so the data movement
takes no SMs; the only kernels are the barriers (a handful of threads each).

Every collective follows the same four steps on one dedicated stream per group:

1. barrier: every peer has finished reading (or writing) the workspace for the previous call;
2. stage: all-gather and all-to-all copy the local input into the local workspace (pull model);
   reduce-scatter pushes each destination's chunk into that peer's workspace (push model);
3. barrier: every peer's data is in place;
4. consume: all-gather and all-to-all pull each peer's piece into the output; reduce-scatter
   sums the ``world`` partial chunks that arrived in the local workspace (an SM reduction, the one
   unavoidable compute of a reduce-scatter).

One stream per group serialises the barriers: symmetric-memory barriers use one signal pad per
group and must not be issued from two streams at once. The caller's stream waits for the side
stream before using the output, or, with ``async_op``, when the returned handle is waited on.

NVLink multicast (NVLS) is never used: this module sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
before its first allocation, and none of its collectives need multicast objects.
"""

import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

_MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
_MIN_WORKSPACE_BYTES = 1 << 20


def _disable_multicast() -> None:
    previous = os.environ.get(_MULTICAST_ENV)
    if previous not in (None, "1"):
        warnings.warn(
            f"{_MULTICAST_ENV}={previous!r} was set; gem_parallel sets it to '1' because NVLink "
            "multicast stays off on the machines this project targets",
            stacklevel=3,
        )
    os.environ[_MULTICAST_ENV] = "1"


@dataclass
class _GroupState:
    group: dist.ProcessGroup  # held so that its id() stays unique while the state lives
    stream: torch.cuda.Stream
    buffer: torch.Tensor | None = None
    handle: object | None = None


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _enable_group(symm_mem, group_name: str) -> None:
    """Register the group with symmetric memory where this torch still needs it (torch < 2.12)."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return
    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        enable(group_name)


class CopyEngines:
    """What the copy-engine path keeps between calls, per process group.

    For each group it has seen: whether every rank runs on this host (learnt by one collective,
    ``all_gather_object`` of the host names, on the group's first ``engine="auto"`` or
    ``"copy_engine"`` call), and the group's symmetric-memory workspace with the side stream its
    copies run on (allocated, and grown to the next power of two, by a collective rendezvous).
    Every rank of a group must use its ``CopyEngines`` in the same calls, in the same order.

    Create one per process (or one per module that owns its groups) and pass it to the
    collectives as ``engines=``; it holds device memory until it is dropped. Entries are keyed by
    the group's name and identity, so a group destroyed and re-created under the same name gets
    a fresh entry.
    """

    def __init__(self):
        self._states: dict[tuple[str, int], _GroupState] = {}
        self._one_host: dict[tuple[str, int], tuple[dist.ProcessGroup, bool]] = {}

    def on_one_host(self, group: dist.ProcessGroup) -> bool:
        """True when every rank of ``group`` runs on this host (a collective on the first call)."""
        key = (group.group_name, id(group))
        if key not in self._one_host:
            hosts: list[str | None] = [None] * group.size()
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            self._one_host[key] = (group, len(set(hosts)) == 1)
        return self._one_host[key][1]

    def workspace(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> _GroupState:
        """The group's workspace of at least ``nbytes``, grown if needed (a collective: every rank
        asks for the same size)."""
        name = group.group_name
        state = self._states.get((name, id(group)))
        if state is None:
            state = _GroupState(group=group, stream=torch.cuda.Stream(device=device))
            self._states[(name, id(group))] = state
        have = 0 if state.buffer is None else state.buffer.numel()
        if have < nbytes:
            _disable_multicast()
            symm_mem = _symm_mem()
            _enable_group(symm_mem, name)
            size = max(_MIN_WORKSPACE_BYTES, 1 << (nbytes - 1).bit_length())
            state.stream.synchronize()  # the old workspace may still be read by queued copies
            state.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
            state.handle = symm_mem.rendezvous(state.buffer, name)
        return state


class CopyEngineWork:
    """Completion of a copy-engine collective queued on its side stream."""

    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def wait(self) -> bool:
        """Make the current stream wait for the collective (no host wait); returns True."""
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        """Whether the collective's copies have finished on the device."""
        return self._event.query()


def _finish(state: _GroupState, tensors: list[torch.Tensor], async_op: bool):
    for t in tensors:
        t.record_stream(state.stream)
    if async_op:
        event = torch.cuda.Event()
        event.record(state.stream)
        return CopyEngineWork(event)
    torch.cuda.current_stream().wait_stream(state.stream)
    return None


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    engines: CopyEngines,
    async_op: bool = False,
) -> CopyEngineWork | None:
    """``output[r * n : (r + 1) * n] = input of rank r`` along dim 0, by copy engines.

    ``input`` may be a view of ``output``'s own chunk (FSDP2's in-place all-gather).
    """
    world, rank = group.size(), group.rank()
    state = engines.workspace(group, input.device, input.numel() * input.element_size())
    handle = state.handle
    chunks = output.chunk(world)
    state.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(state.stream):
        handle.barrier(channel=0)
        handle.get_buffer(rank, input.shape, input.dtype).copy_(input)
        handle.barrier(channel=0)
        for step in range(world):
            peer = (rank + step) % world
            if peer == rank:
                if chunks[rank].data_ptr() != input.data_ptr():
                    chunks[rank].copy_(input)
                continue
            chunks[peer].copy_(handle.get_buffer(peer, input.shape, input.dtype))
    return _finish(state, [output, input], async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: str,
    engines: CopyEngines,
    async_op: bool = False,
) -> CopyEngineWork | None:
    """``output = reduce over ranks of input[rank * n : (rank + 1) * n]`` (sum or avg)."""
    world, rank = group.size(), group.rank()
    state = engines.workspace(group, input.device, input.numel() * input.element_size())
    handle = state.handle
    chunks = input.chunk(world)
    chunk_numel = chunks[0].numel()
    state.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(state.stream):
        handle.barrier(channel=0)
        for step in range(world):
            peer = (rank + step) % world
            slot = handle.get_buffer(peer, chunks[peer].shape, input.dtype, rank * chunk_numel)
            slot.copy_(chunks[peer])
        handle.barrier(channel=0)
        partials = handle.get_buffer(rank, (world, *chunks[0].shape), input.dtype)
        acc_dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else None
        total = partials.sum(0, dtype=acc_dtype)
        if op == "avg":
            total = total / world
        output.copy_(total)
    return _finish(state, [output, input], async_op)


def all_to_all_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    send_rows: list[list[int]],
    engines: CopyEngines,
    async_op: bool = False,
) -> CopyEngineWork | None:
    """Rows ``send_rows[s][d]`` go from rank s to rank d, in rank order on both sides (pull model).

    ``send_rows`` is the whole world's split matrix (every rank passes the same one), so each rank
    knows where its piece sits in every peer's workspace without reading device memory.
    """
    world, rank = group.size(), group.rank()
    row_numel = input[0].numel() if input.shape[0] else int(torch.Size(input.shape[1:]).numel())
    row_bytes = row_numel * input.element_size()
    widest = max(sum(row) for row in send_rows)
    state = engines.workspace(group, input.device, max(widest * row_bytes, 1))
    handle = state.handle
    rest = tuple(input.shape[1:])
    state.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(state.stream):
        handle.barrier(channel=0)
        if input.shape[0]:
            handle.get_buffer(rank, input.shape, input.dtype).copy_(input)
        handle.barrier(channel=0)
        out_start = 0
        for src in range(world):
            rows = send_rows[src][rank]
            if rows:
                src_start = sum(send_rows[src][:rank])
                piece = handle.get_buffer(src, (rows, *rest), input.dtype, src_start * row_numel)
                output[out_start : out_start + rows].copy_(piece)
            out_start += rows
    return _finish(state, [output, input], async_op)
