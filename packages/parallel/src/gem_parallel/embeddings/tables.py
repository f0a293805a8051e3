"""Table configuration and the unsharded embedding module (the single-process reference).

``EmbeddingTables`` holds one plain ``[num_embeddings, embedding_dim]`` parameter per table; each
table serves one or more feature keys (shared tables, as in torchrec). ``pooling`` picks the
output: ``"sum"`` or ``"mean"`` give ``PooledEmbeddings`` (an EmbeddingBagCollection), ``"none"``
gives a dict of ``JaggedEmbeddings`` (an EmbeddingCollection). The sharded module of
``native.py`` computes exactly this function, spread over ranks.

With ``fused_optimizer=RowwiseAdagrad(...)`` the tables train themselves: each lookup's backward
updates the rows it touched (``fused_optimizer.py``), the weights' ``.grad`` stays ``None``, and
the per-row accumulators are buffers (``rowwise_state.<table>``), saved with the module's state.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fused_optimizer import RowwiseAdagrad, fused_lookup
from .kjt import JaggedEmbeddings, PooledEmbeddings, offsets_of, pool, split_features

POOLINGS = ("sum", "mean", "none")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: its size and the feature keys that look it up."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]

    def __post_init__(self):
        if self.num_embeddings < 1:
            raise ValueError(
                f"table {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}"
            )
        if self.embedding_dim < 1:
            raise ValueError(
                f"table {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}"
            )
        if not self.feature_names:
            raise ValueError(f"table {self.name!r}: feature_names must name at least one key")
        object.__setattr__(self, "feature_names", tuple(self.feature_names))


def check_tables(tables: list[TableConfig], pooling: str) -> None:
    """``ValueError`` for an unknown pooling, no tables, repeated table names, or a feature key
    that more than one table looks up."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if not tables:
        raise ValueError("tables must hold at least one TableConfig")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    features = [f for t in tables for f in t.feature_names]
    if len(set(features)) != len(features):
        raise ValueError(f"each feature key may look up one table only, got {features}")


def lookup_output(
    tables: list[TableConfig],
    pooling: str,
    features,
    rows_of_table,
):
    """Assemble the module output from ``rows_of_table(table, ids) -> [T, D]`` per table."""
    pooled, dims, keys, jagged = [], [], [], {}
    for table in tables:
        ids = torch.cat([features[f].ids for f in table.feature_names])
        rows = rows_of_table(table, ids)
        counts = [features[f].ids.numel() for f in table.feature_names]
        for name, rows_f in zip(table.feature_names, rows.split(counts), strict=True):
            feature = features[name]
            if pooling == "none":
                if feature.weights is not None:
                    raise ValueError(
                        "per-id weights apply to pooled embeddings only (pooling='none')"
                    )
                jagged[name] = JaggedEmbeddings(rows_f, offsets_of(feature.lengths.to(rows.device)))
            else:
                pooled.append(pool(rows_f, feature.lengths, pooling, feature.weights))
                dims.append(table.embedding_dim)
                keys.append(name)
    if pooling == "none":
        return jagged
    return PooledEmbeddings(keys, dims, torch.cat(pooled, dim=1))


class EmbeddingTables(nn.Module):
    """Unsharded embedding tables: ``forward(kjt)`` looks up and pools every feature.

    Args:
        tables: ``TableConfig(name, num_embeddings, embedding_dim, feature_names)`` each.
        pooling: ``"sum"`` / ``"mean"`` (an EmbeddingBagCollection: ``PooledEmbeddings``) or
            ``"none"`` (an EmbeddingCollection: ``{feature: JaggedEmbeddings}``).
        device, dtype, generator: where and how the weights (``N(0, 1/dim)``) are made.
        validate_ids: check every id lies in its table (one host sync per table).
        fused_optimizer: a ``RowwiseAdagrad`` to train the rows inside the lookups' backward.

    ``ValueError`` from ``check_tables``; ``TypeError`` for a fused optimizer of another type.
    """

    def __init__(
        self,
        tables: list[TableConfig],
        *,
        pooling: str = "sum",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
        validate_ids: bool = True,
        fused_optimizer: RowwiseAdagrad | None = None,
    ):
        super().__init__()
        check_tables(tables, pooling)
        self.tables = list(tables)
        self.pooling = pooling
        self.validate_ids = validate_ids  # False when the data reader already checked the ids
        self.weights = nn.ParameterDict(
            {
                t.name: nn.Parameter(
                    torch.randn(t.num_embeddings, t.embedding_dim, generator=generator, dtype=dtype)
                    .div_(t.embedding_dim**0.5)
                    .to(device)
                )
                for t in self.tables
            }
        )
        self.fused_optimizer: RowwiseAdagrad | None = None
        self.rowwise_state = nn.Module()  # buffers: one float32 accumulator per row and table
        if fused_optimizer is not None:
            self.fuse_optimizer(fused_optimizer)

    def fuse_optimizer(self, optimizer: RowwiseAdagrad) -> None:
        """From now on each lookup's backward updates its rows with ``optimizer`` (the weights
        get no ``.grad``); the per-row state starts at zero, on the weights' device."""
        if not isinstance(optimizer, RowwiseAdagrad):
            raise TypeError(
                f"fused_optimizer: expected a RowwiseAdagrad, got {type(optimizer).__name__}"
            )
        self.fused_optimizer = optimizer
        for t in self.tables:
            if not hasattr(self.rowwise_state, t.name):
                weight = self.weights[t.name]
                state = torch.zeros(t.num_embeddings, dtype=torch.float32, device=weight.device)
                self.rowwise_state.register_buffer(t.name, state)

    def _rows(self, table: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weights[table.name]
        ids = ids.to(weight.device)
        if self.fused_optimizer is None:
            return F.embedding(ids, weight)
        state = getattr(self.rowwise_state, table.name)
        return fused_lookup(ids, weight, state, self.fused_optimizer)

    @property
    def feature_names(self) -> list[str]:
        """Every feature key the tables look up, table by table."""
        return [f for t in self.tables for f in t.feature_names]

    def forward(self, features):
        """Look up ``features`` (a ``KeyedJaggedTensor`` or ``KeyedJagged`` holding exactly
        ``feature_names``): ``PooledEmbeddings`` ``[B, Σ dims]`` when pooled, else
        ``{feature: JaggedEmbeddings [T, dim]}``. ``ValueError`` for missing or extra keys, or an
        id out of range (with ``validate_ids``)."""
        parsed = split_features(features, expected=self.feature_names)
        if self.validate_ids:  # one host sync per table: skip it where ids were checked upstream
            for table in self.tables:
                check_ids(table, torch.cat([parsed[f].ids for f in table.feature_names]))
        return lookup_output(self.tables, self.pooling, parsed, self._rows)

    @classmethod
    def from_torchrec(cls, module: nn.Module) -> "EmbeddingTables":
        """Copy a torchrec EmbeddingBagCollection or EmbeddingCollection (weights included)."""
        if hasattr(module, "embedding_bag_configs"):
            configs, pooling = module.embedding_bag_configs(), None
            kinds = {c.pooling.name.lower() for c in configs}
            if len(kinds) != 1 or not kinds <= {"sum", "mean"}:
                raise ValueError(
                    f"tables must all pool by 'sum' or all by 'mean', got {sorted(kinds)}"
                )
            pooling = kinds.pop()
            prefix = "embedding_bags"
        elif hasattr(module, "embedding_configs"):
            configs, pooling, prefix = module.embedding_configs(), "none", "embeddings"
        else:
            raise TypeError(
                f"module must be a torchrec EmbeddingBagCollection or EmbeddingCollection, got "
                f"{type(module).__name__}"
            )
        tables = [
            TableConfig(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names))
            for c in configs
        ]
        state = module.state_dict()
        first = state[f"{prefix}.{tables[0].name}.weight"]
        out = cls(tables, pooling=pooling, device=first.device, dtype=first.dtype)
        with torch.no_grad():
            for t in tables:
                out.weights[t.name].copy_(state[f"{prefix}.{t.name}.weight"])
        return out


def check_ids(table: TableConfig, ids: torch.Tensor) -> None:
    """Every id of ``table``'s features lies in ``[0, num_embeddings)`` (one host sync)."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= table.num_embeddings:
        raise ValueError(
            f"ids of table {table.name!r} (features {list(table.feature_names)}) must lie in "
            f"[0, {table.num_embeddings}), got ids from {low} to {high}"
        )
