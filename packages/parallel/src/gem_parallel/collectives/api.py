"""Public all-gather, reduce-scatter and all-to-all with a choice of engine.

All three work along dim 0 and return new tensors (the input is never modified):

- ``all_gather(x, group=g)``: ``[n, ...]`` on each rank -> ``[world * n, ...]`` in rank order.
- ``reduce_scatter(x, group=g, op="sum"|"avg")``: ``[world * n, ...]`` -> ``[n, ...]``, rank r
  receiving the reduction of every rank's chunk r.
- ``all_to_all(x, group=g, input_split_sizes=..., output_split_sizes=...)``: rank s sends rows
  ``input_split_sizes[d]`` to rank d; equal splits when the sizes are omitted. When only the input
  splits are given, the output splits are exchanged first (one small all-to-all and one
  device-to-host copy).

``engine="sm"`` runs the process group's own collective (NCCL on GPUs, gloo on the CPU);
``engine="copy_engine"`` runs the symmetric-memory path of ``copy_engine.py`` (CUDA, one host);
``engine="auto"`` picks per call with ``policy.choose_engine`` from the message size and the
``overlap`` hint. The copy engines keep a workspace per group between calls: pass the
``CopyEngines`` that holds them as ``engines=`` (without it ``"auto"`` stays on the process group
and ``"copy_engine"`` is refused). With ``async_op=True`` the functions return ``(output, work)``;
read the output only after ``work.wait()``.

Arguments common to the three: ``group`` (default the world group), ``engine`` (``"auto"``,
``"copy_engine"``, ``"sm"``), ``overlap`` (the caller overlaps the collective with compute: the
policy's hint), ``async_op``, ``policy`` (``EnginePolicy``, the thresholds of ``"auto"``) and
``engines``. Errors: ``TypeError`` for a non-tensor, ``ValueError`` for a scalar, a bad engine or
op, rows that do not split, or split sizes that do not add up; ``RuntimeError`` when
torch.distributed is not initialized.
"""

import torch
import torch.distributed as dist

from . import copy_engine
from .copy_engine import CopyEngines
from .policy import DEFAULT_POLICY, EnginePolicy, choose_engine

REDUCE_OPS = ("sum", "avg")

# torch >= 2.13 renames the tensor collectives (the old names warn); torch 2.11 has only the old.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(
            f"{name} must have at least one dimension (rows along dim 0), got a scalar"
        )


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    return group if group is not None else dist.group.WORLD


def _done(output: torch.Tensor, work, async_op: bool):
    if async_op:
        return output, work
    if work is not None:
        work.wait()
    return output


def all_gather(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    engine: str = "auto",
    overlap: bool = False,
    async_op: bool = False,
    policy: EnginePolicy = DEFAULT_POLICY,
    engines: CopyEngines | None = None,
):
    """Concatenate every rank's ``x`` along dim 0, in rank order.

    ``x [n, ...]`` (any dtype, the same shape on every rank) -> ``[world * n, ...]``, a new
    tensor; with ``async_op``, ``(output, work)``. Arguments and errors: the module docstring.
    """
    _check_tensor("x", x)
    group = _group(group)
    x = x.contiguous()
    output = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    nbytes = x.numel() * x.element_size()
    chosen = choose_engine(
        engine,
        nbytes=nbytes,
        device=x.device,
        group=group,
        overlap=overlap,
        policy=policy,
        engines=engines,
    )
    if chosen == "copy_engine":
        work = copy_engine.all_gather_into(output, x, group, engines=engines, async_op=async_op)
    else:
        work = all_gather_single(output, x, group=group, async_op=async_op)
    return _done(output, work, async_op)


def reduce_scatter(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    engine: str = "auto",
    overlap: bool = False,
    async_op: bool = False,
    policy: EnginePolicy = DEFAULT_POLICY,
    engines: CopyEngines | None = None,
):
    """Rank r gets the sum (or mean) over ranks of chunk r of ``x`` (dim 0 split in ``world``).

    ``x [world * n, ...]`` -> ``[n, ...]``; ``op`` is ``"sum"`` or ``"avg"`` (floating dtypes only,
    ``TypeError`` otherwise). Half-precision sums accumulate in fp32 on the copy-engine path.
    Arguments and errors: the module docstring.
    """
    _check_tensor("x", x)
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "avg" and not x.is_floating_point():
        raise TypeError(f"op='avg' needs a floating-point tensor, got {x.dtype}")
    group = _group(group)
    world = group.size()
    if x.shape[0] % world:
        raise ValueError(
            f"x has {x.shape[0]} rows along dim 0, which the group's {world} ranks cannot split "
            "evenly; pad it to a multiple of the group size"
        )
    x = x.contiguous()
    output = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    nbytes = output.numel() * output.element_size()
    chosen = choose_engine(
        engine,
        nbytes=nbytes,
        device=x.device,
        group=group,
        overlap=overlap,
        policy=policy,
        engines=engines,
    )
    if chosen == "copy_engine":
        work = copy_engine.reduce_scatter_into(
            output, x, group, op=op, engines=engines, async_op=async_op
        )
        return _done(output, work, async_op)
    # gloo has no AVG: sum, then divide when the sum is complete, so every backend agrees.
    work = reduce_scatter_single(output, x, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if op == "avg":
        work = _DivideOnWait(work, output, world)
    return _done(output, work, async_op)


class _DivideOnWait:
    def __init__(self, work, output: torch.Tensor, world: int):
        self._work, self._output, self._world = work, output, world

    def wait(self) -> bool:
        self._work.wait()
        self._output.div_(self._world)
        return True


def _check_splits(name: str, splits, *, world: int, rows: int | None) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise ValueError(f"{name} must have one entry per rank ({world}), got {len(splits)}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} must be non-negative, got {splits}")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"{name} sums to {sum(splits)} but x has {rows} rows along dim 0")
    return splits


def exchange_split_sizes(
    input_split_sizes: list[int], *, group: dist.ProcessGroup, device: torch.device
) -> list[int]:
    """The rows each peer will send here, from the rows this rank sends each peer (one small
    all-to-all of int64 counts on ``device`` and one device-to-host copy); a list of ``world``
    ints. Every rank of ``group`` must call it."""
    send = torch.tensor(input_split_sizes, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def all_to_all(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
    engine: str = "auto",
    overlap: bool = False,
    async_op: bool = False,
    policy: EnginePolicy = DEFAULT_POLICY,
    engines: CopyEngines | None = None,
):
    """Rows of ``x`` go to ranks by ``input_split_sizes``; the output holds, in rank order, the
    rows every rank sent here.

    ``x [rows, ...]``; ``input_split_sizes`` (one count per rank, summing to ``rows``) and
    ``output_split_sizes`` (one per rank) default to equal splits, and the output splits, when
    only the input ones are given, are exchanged first. Uneven splits with ``engine="auto"`` take
    the process group (ranks would not agree on a size-based choice). Returns
    ``[sum(output_split_sizes), ...]``. Arguments and errors: the module docstring.
    """
    _check_tensor("x", x)
    group = _group(group)
    world = group.size()
    x = x.contiguous()
    equal = input_split_sizes is None and output_split_sizes is None
    if input_split_sizes is None and output_split_sizes is not None:
        raise ValueError(
            "output_split_sizes was given without input_split_sizes; give both or neither"
        )
    if equal:
        if x.shape[0] % world:
            raise ValueError(
                f"x has {x.shape[0]} rows, not a multiple of the group's {world} ranks; pass "
                "input_split_sizes for uneven splits"
            )
        input_split_sizes = [x.shape[0] // world] * world
        output_split_sizes = list(input_split_sizes)
    input_split_sizes = _check_splits(
        "input_split_sizes", input_split_sizes, world=world, rows=x.shape[0]
    )
    if output_split_sizes is None:
        output_split_sizes = exchange_split_sizes(input_split_sizes, group=group, device=x.device)
    output_split_sizes = _check_splits(
        "output_split_sizes", output_split_sizes, world=world, rows=None
    )
    output = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
    # Unequal splits give each rank a different size, so "auto" could disagree across ranks.
    decide = engine if (equal or engine != "auto") else "sm"
    nbytes = x.numel() * x.element_size()
    chosen = choose_engine(
        decide,
        nbytes=nbytes,
        device=x.device,
        group=group,
        overlap=overlap,
        policy=policy,
        engines=engines,
    )
    if chosen == "copy_engine":
        if equal:
            send_rows = [list(input_split_sizes) for _ in range(world)]
        else:
            send_rows = _split_matrix(input_split_sizes, group=group, device=x.device)
        work = copy_engine.all_to_all_into(
            output, x, group, send_rows=send_rows, engines=engines, async_op=async_op
        )
    else:
        work = dist.all_to_all_single(
            output,
            x,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        )
    return _done(output, work, async_op)


def _split_matrix(input_split_sizes: list[int], *, group, device) -> list[list[int]]:
    mine = torch.tensor(input_split_sizes, dtype=torch.int64, device=device)
    every = mine.new_empty(group.size() * mine.numel())
    all_gather_single(every, mine, group=group)
    return every.view(group.size(), -1).tolist()
