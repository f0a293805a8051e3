"""The shapes of the three meshes, as plain integers: what a plan decides and a mesh builder needs.

All three meshes cover the same ranks, laid out row-major (the last dimension is contiguous, so
it lands inside a host first, then inside a zone):

- dense  ``(dp_replicate, dp_shard)``: HSDP, weights sharded over ``dp_shard`` (inside a zone) and
  replicated over ``dp_replicate`` (across zones).
- expert ``(dp_replicate, edp_shard, ep)``: the dense mesh with ``dp_shard`` split into
  ``edp_shard x ep``; experts are split over ``ep`` (inside a host) and their weights HSDP-sharded
  over ``(dp_replicate, edp_shard)``.
- sparse ``(sparse_mp, sparse_replica)`` when ``sparse_inner == "replica"`` (GEM: the replicas of
  one shard sit in one host, so gathering a fully sharded replica runs on NVLink), or
  ``(sparse_replica, sparse_mp)`` when ``sparse_inner == "mp"``.
"""

from dataclasses import asdict, dataclass

SPARSE_INNER = ("replica", "mp")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (≥ 1), ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_divisors(value: int, n: int) -> str:
    """'a or b': the divisors of ``n`` just below and above ``value`` (for error messages)."""
    ds = divisors(n)
    below = [d for d in ds if d < value]
    above = [d for d in ds if d > value]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)


@dataclass(frozen=True)
class MeshLayout:
    """The three meshes' sizes (see the module docstring): ``world`` ranks, dense
    ``dp_replicate x dp_shard``, ``ep`` dividing ``dp_shard``, sparse ``sparse_mp x
    sparse_replicas`` (``sparse_mp=0``: the world over the replicas) with ``sparse_inner`` the
    contiguous sparse dimension. ``ValueError`` names the nearest valid value of a field whose
    product or divisibility does not hold."""

    world: int
    dp_replicate: int
    dp_shard: int
    ep: int = 1
    sparse_mp: int = 0  # 0: the whole world (sparse_replicas = 1)
    sparse_replicas: int = 1
    sparse_inner: str = "replica"

    def __post_init__(self):
        for name in ("world", "dp_replicate", "dp_shard", "ep", "sparse_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sparse_mp == 0:
            object.__setattr__(self, "sparse_mp", self.world // self.sparse_replicas)
        if self.dp_replicate * self.dp_shard != self.world:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} must equal the world "
                f"size {self.world}; with dp_replicate={self.dp_replicate} use dp_shard="
                f"{self.world // self.dp_replicate}"
                if self.world % self.dp_replicate == 0
                else f"dp_replicate={self.dp_replicate} does not divide the world size {self.world}: "
                f"use dp_replicate={nearest_divisors(self.dp_replicate, self.world)}"
            )
        if self.ep > self.world:
            raise ValueError(f"ep={self.ep} exceeds the world size {self.world}")
        if self.dp_shard % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard} (experts are split inside a "
                f"shard group): use ep={nearest_divisors(self.ep, self.dp_shard)}"
            )
        if self.sparse_mp * self.sparse_replicas != self.world:
            raise ValueError(
                f"sparse_mp={self.sparse_mp} x sparse_replicas={self.sparse_replicas} must equal the "
                f"world size {self.world}: use sparse_replicas="
                f"{nearest_divisors(self.sparse_replicas, self.world) or self.world}"
            )
        if self.sparse_inner not in SPARSE_INNER:
            raise ValueError(
                f"sparse_inner must be one of {SPARSE_INNER}, got {self.sparse_inner!r}"
            )

    @property
    def edp_shard(self) -> int:
        """The experts' data-parallel shard size: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    # (names, shape) of each mesh; strides follow from row-major order.
    @property
    def dense(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dimension names, shape) of the dense mesh."""
        return ("dp_replicate", "dp_shard"), (self.dp_replicate, self.dp_shard)

    @property
    def expert(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dimension names, shape) of the expert mesh."""
        return ("dp_replicate", "edp_shard", "ep"), (self.dp_replicate, self.edp_shard, self.ep)

    @property
    def sparse(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dimension names, shape) of the sparse mesh, the contiguous dimension last."""
        if self.sparse_inner == "replica":
            return ("sparse_mp", "sparse_replica"), (self.sparse_mp, self.sparse_replicas)
        return ("sparse_replica", "sparse_mp"), (self.sparse_replicas, self.sparse_mp)

    def group(self, dim: str) -> tuple[int, int]:
        """(size, stride) of the process group along mesh dimension ``dim``."""
        for names, shape in (self.expert, self.dense, self.sparse):
            if dim in names:
                i = names.index(dim)
                stride = 1
                for s in shape[i + 1 :]:
                    stride *= s
                return shape[i], stride
        raise ValueError(
            f"unknown mesh dimension {dim!r}; known: dp_replicate, dp_shard, edp_shard, ep, "
            "sparse_mp, sparse_replica"
        )

    def to_dict(self) -> dict:
        """The fields as a dict."""
        return asdict(self)

    def describe(self) -> str:
        """One line naming the three meshes' dimensions."""
        sparse_names, sparse_shape = self.sparse
        return (
            f"dense (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}); "
            f"expert (dp_replicate={self.dp_replicate}, edp_shard={self.edp_shard}, ep={self.ep}); "
            f"sparse ({', '.join(f'{n}={s}' for n, s in zip(sparse_names, sparse_shape, strict=True))})"
        )
