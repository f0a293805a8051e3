"""Row-wise sharded embedding tables in plain PyTorch: 2D and fully sharded 2D.

The ranks form a grid ``replicas x model_parallel`` (``R x M``). Every rank brings its own batch.

**Row-wise model parallelism.** Table ``t`` with ``N`` rows is cut into ``M`` blocks of
``ceil(N / M)`` rows; model-parallel rank ``m`` owns block ``m``. A forward pass sends each id to
the owner of its block (an all-to-all of ids over the model-parallel group), the owner looks the
rows up, and a second all-to-all returns the rows to the rank that asked, which pools them. The
backward pass sends the row gradients back along the same route (the transposed all-to-all), so
an owner's block gradient sums the contributions of every rank of its model-parallel group.

**2D.** Each replica group (the ``R`` ranks with the same ``m``) holds ``R`` full copies of block
``m``; after backward, the block gradients are all-reduced over the replica group, as data
parallelism does. Memory per rank: ``N * D / M`` per table.

**Fully sharded 2D.** The ``R`` copies are themselves sharded: rank ``(r, m)`` keeps rows
``r * S : (r + 1) * S`` of block ``m`` (``S = ceil(ceil(N / M) / R)``), ``1/R`` of 2D's memory. The
block is all-gathered over the replica group on demand, looked up, and dropped: the embedding
lookup does not keep its weight for backward, so a gathered block lives only until its lookup is
done. The backward reduce-scatters the block gradient to the shard owners, which is the 2D
all-reduce without its redundant half. To hide the gather, the block of table ``t + 1`` is gathered
asynchronously while table ``t`` exchanges ids and looks up rows (``prefetch``), so at most two
gathered blocks are alive at once: the prefetch buffer. On GPUs the gathers go through
``gem_parallel.collectives`` with ``overlap=True``, which takes the copy engines when they apply.

Trade-offs kept simple on purpose: owners return one row per id and the asking rank pools, so a
pooled feature moves ``ids x D`` values back where torchrec's row-wise sharding moves partial sums
(``batch x D`` per owner); ids are not deduplicated before the exchange; and each exchange needs
the peers' counts on the host (one small all-to-all and a device-to-host copy per table). The
backward pass materialises one dense ``[block rows, D]`` gradient per table before its
reduce-scatter, as FSDP does for dense weights.

Gradients follow ``reduce``: ``"sum"`` gives the gradient of the sum of every rank's loss,
``"avg"`` divides it by the world size (the gradient of the mean, as FSDP computes for dense
weights).
"""

import math
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import collectives
from .kjt import split_features
from .tables import EmbeddingTables, TableConfig, check_ids, lookup_output

REDUCES = ("sum", "avg")


@dataclass(frozen=True)
class ShardingConfig:
    """How the native back end shards: fully sharded replicas or 2D, prefetch, reduction, engine."""

    fully_sharded: bool = True
    prefetch: bool = True
    reduce: str = "avg"
    engine: str = "auto"
    validate_ids: bool = True

    def __post_init__(self):
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")
        collectives.policy.check_engine(self.engine)


@dataclass(frozen=True)
class TableLayout:
    """Where a rank's rows sit: block ``m`` is rows ``m * block_rows`` onwards; with sharded
    replicas, replica ``r`` stores rows ``r * shard_rows`` onwards of that block."""

    block_rows: int
    shard_rows: int
    sharded_replicas: bool

    def shard_start(self, m: int, r: int) -> int:
        """The first row of block ``m`` that replica ``r`` stores."""
        return m * self.block_rows + (r * self.shard_rows if self.sharded_replicas else 0)


class _LiveBytes:
    """Bytes held by gathered blocks right now, and the peak. A block counts until its tensor is
    freed, by whoever drops it last (a CPU backend's worker thread may, hence the lock)."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def track(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._release, n)

    def _release(self, n: int) -> None:
        with self._lock:
            self.now -= n


class _PendingGather:
    """An all-gather in flight; ``wait()`` returns the gathered block."""

    def __init__(self, output: torch.Tensor, work, live: _LiveBytes):
        self.output, self.work = output, work
        live.track(output)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        output, self.output = self.output, None
        return output


class _GatheredBlock(torch.autograd.Function):
    """Forward: the gathered block; backward: reduce-scatter its gradient to the shard owners."""

    @staticmethod
    def forward(ctx, shard, pending, group, scale, engine, engines):
        ctx.group, ctx.scale, ctx.engine, ctx.engines = group, scale, engine, engines
        return pending.wait()

    @staticmethod
    def backward(ctx, grad_block):
        grad = collectives.reduce_scatter(
            grad_block.contiguous(), group=ctx.group, engine=ctx.engine, engines=ctx.engines
        )
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        return grad, None, None, None, None, None


class _ExchangeRows(torch.autograd.Function):
    """All-to-all of looked-up rows back to the asking ranks; backward returns the gradients."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group, engine, engines):
        ctx.send_splits, ctx.recv_splits = send_splits, recv_splits
        ctx.group, ctx.engine, ctx.engines = group, engine, engines
        return collectives.all_to_all(
            rows,
            group=group,
            input_split_sizes=send_splits,
            output_split_sizes=recv_splits,
            engine=engine,
            engines=engines,
        )

    @staticmethod
    def backward(ctx, grad):
        back = collectives.all_to_all(
            grad.contiguous(),
            group=ctx.group,
            input_split_sizes=ctx.recv_splits,
            output_split_sizes=ctx.send_splits,
            engine=ctx.engine,
            engines=ctx.engines,
        )
        return back, None, None, None, None, None


class ShardedEmbeddingTables(nn.Module):
    """The native back end of ``shard_embeddings``; see the module docstring for the algorithm.

    ``engines`` keeps the copy engines' workspaces for this module's groups (a new
    ``collectives.CopyEngines`` when not given, as ``self.copy_engines``).
    """

    def __init__(
        self,
        source: EmbeddingTables,
        *,
        model_parallel_group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup | None,
        config: ShardingConfig,
        device: torch.device | str | None = None,
        engines: collectives.CopyEngines | None = None,
    ):
        super().__init__()
        self.tables: list[TableConfig] = list(source.tables)
        self.pooling = source.pooling
        self.config = config
        self.copy_engines = engines if engines is not None else collectives.CopyEngines()
        self.mp_group, self.replica_group = model_parallel_group, replica_group
        self.M, self.m = model_parallel_group.size(), model_parallel_group.rank()
        self.R = replica_group.size() if replica_group is not None else 1
        self.r = replica_group.rank() if replica_group is not None else 0
        self.fully_sharded = config.fully_sharded and self.R > 1
        world = self.M * self.R
        self._grad_scale = 1.0 / world if config.reduce == "avg" else 1.0
        self.live_gathered = _LiveBytes()
        self.layouts: dict[str, TableLayout] = {}
        shards = {}
        for t in self.tables:
            block = math.ceil(t.num_embeddings / self.M)
            shard = math.ceil(block / self.R) if self.fully_sharded else block
            layout = self.layouts[t.name] = TableLayout(block, shard, self.fully_sharded)
            full = source.weights[t.name].detach()
            start, valid = self._range(t, layout)
            rows = full[start : start + valid]
            padded = torch.zeros(
                shard, t.embedding_dim, dtype=full.dtype, device=device or full.device
            )
            padded[: rows.shape[0]] = rows
            shards[t.name] = nn.Parameter(padded)
        self.shards = nn.ParameterDict(shards)
        if not self.fully_sharded and (self.R > 1 or self._grad_scale != 1.0):
            for p in self.shards.values():
                p.register_hook(self._sync_2d_grad)

    # -- gradients of 2D: all-reduce over the replica group before accumulation ------------------

    def _sync_2d_grad(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if self.R > 1:
            dist.all_reduce(grad, group=self.replica_group)
        return grad.mul_(self._grad_scale) if self._grad_scale != 1.0 else grad

    # -- memory accounting --------------------------------------------------------------------

    def persistent_bytes(self) -> int:
        """Bytes of the parameters this rank stores."""
        return sum(p.numel() * p.element_size() for p in self.shards.values())

    def prefetch_buffer_bytes(self) -> int:
        """The most gathered-block bytes alive at once: two blocks (current and prefetched)."""
        if not self.fully_sharded:
            return 0
        blocks = sorted(
            (
                self.layouts[t.name].shard_rows
                * self.R
                * t.embedding_dim
                * self.shards[t.name].element_size()
                for t in self.tables
            ),
            reverse=True,
        )
        return sum(blocks[:2]) if self.config.prefetch else blocks[0]

    # -- forward ------------------------------------------------------------------------------

    def _start_gather(self, table: TableConfig) -> _PendingGather:
        shard = self.shards[table.name].detach()
        output, work = collectives.all_gather(
            shard,
            group=self.replica_group,
            engine=self.config.engine,
            overlap=True,
            async_op=True,
            engines=self.copy_engines,
        )
        return _PendingGather(output, work, self.live_gathered)

    def _block_weight(self, i: int, pending: dict[int, _PendingGather]) -> torch.Tensor:
        table = self.tables[i]
        if not self.fully_sharded:
            return self.shards[table.name]
        gather = pending.pop(i) if i in pending else self._start_gather(table)
        return _GatheredBlock.apply(
            self.shards[table.name],
            gather,
            self.replica_group,
            self._grad_scale,
            self.config.engine,
            self.copy_engines,
        )

    def _lookup(
        self, i: int, ids: torch.Tensor, pending: dict[int, _PendingGather]
    ) -> torch.Tensor:
        table = self.tables[i]
        layout = self.layouts[table.name]
        device = self.shards[table.name].device
        ids = ids.to(device)
        if self.config.validate_ids:
            check_ids(table, ids)
        owner = torch.div(ids, layout.block_rows, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.M).tolist()
        recv_counts = collectives.exchange_split_sizes(
            send_counts, group=self.mp_group, device=device
        )
        asked = collectives.all_to_all(
            ids[order],
            group=self.mp_group,
            input_split_sizes=send_counts,
            output_split_sizes=recv_counts,
            engine=self.config.engine,
            engines=self.copy_engines,
        )
        if self.fully_sharded and self.config.prefetch and i + 1 < len(self.tables):
            pending[i + 1] = self._start_gather(self.tables[i + 1])
        weight = self._block_weight(i, pending)
        rows = F.embedding(asked - self.m * layout.block_rows, weight)
        answered = _ExchangeRows.apply(
            rows, recv_counts, send_counts, self.mp_group, self.config.engine, self.copy_engines
        )
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return answered[inverse]

    def forward(self, features):
        """As ``EmbeddingTables.forward``: the same inputs, the same output types; every rank of
        both groups must call it (it runs collectives)."""
        parsed = split_features(
            features, expected=[f for t in self.tables for f in t.feature_names]
        )
        pending: dict[int, _PendingGather] = {}
        if self.fully_sharded and self.config.prefetch:
            pending[0] = self._start_gather(self.tables[0])
        index = {t.name: i for i, t in enumerate(self.tables)}
        return lookup_output(
            self.tables,
            self.pooling,
            parsed,
            lambda t, ids: self._lookup(index[t.name], ids, pending),
        )

    # -- state --------------------------------------------------------------------------------

    def _range(self, table: TableConfig, layout: TableLayout) -> tuple[int, int]:
        block_end = min((self.m + 1) * layout.block_rows, table.num_embeddings)
        start = layout.shard_start(self.m, self.r)
        return start, max(0, min(start + layout.shard_rows, block_end) - start)

    def shard_range(self, name: str) -> tuple[int, int]:
        """``(first row, rows)`` of table ``name`` that this rank's shard holds (padding excluded)."""
        table = next(t for t in self.tables if t.name == name)
        return self._range(table, self.layouts[name])

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every table, unsharded, on every rank (gathers over both groups; for checks and export)."""
        out = {}
        for t in self.tables:
            block = self.shards[t.name]
            if self.fully_sharded:
                block = collectives.all_gather(block, group=self.replica_group, engine="sm")
            block = block[: self.layouts[t.name].block_rows]
            out[t.name] = collectives.all_gather(block, group=self.mp_group, engine="sm")[
                : t.num_embeddings
            ]
        return out
