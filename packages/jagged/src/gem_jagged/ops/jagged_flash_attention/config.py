"""The tile shapes and code paths of jagged flash attention's kernels, and how they are picked.

A ``JaggedAttentionConfig`` says, for each of the three kernels (forward, dK/dV, dQ), which
tile it works on (``TileShape``: rows of queries and keys, warps, pipeline stages) and which
implementation runs it (``KernelImpl``: the Triton kernel, or its Gluon twin on Hopper), plus
the two path choices that are not a kernel's: whether the Triton forward streams K and V
through TMA descriptors (``KeyLoads``) and whether dQ has a kernel of its own or is written by
the dK/dV kernel (``DqPlacement``). The launchers take a config as an argument and read
nothing else; the public op takes one too (``config=``), and without one ``config_for`` picks.

How ``config_for`` picks. The tiles are fixed per (arch, element size, head dim, regime, bias)
rather than autotuned: the work lists depend on the query tile height, so a tuner would have to
rebuild them per candidate, and the benchmark's ``--sweep`` times alternatives instead. The
arch is ``"interpreter"`` (Triton's CPU interpreter: every tile 16 rows, so small tests cross
many tile edges, and every path the interpreter can run switched on), ``"sm90"`` (Hopper: the
Gluon kernels where the table asks for them) or another CUDA arch (the same tiles, Triton
kernels only). Float32 inputs take half-height tiles, so that they fit the shared memory
(correctness, not speed). Two-byte inputs take the tiles of their ``Regime``: ``SHORT_KEYS``
when the sequences average at most ``SHORT_KEYS`` keys (candidates attending over a few keys
each: a dK/dV program then holds one 64-key tile, which one sequence fills), ``LONG``
otherwise; and those of the bias path with a relative bias. ``regime_for`` derives the regime
from host-known sizes (``Tk`` and ``B``), so that the launchers and the fake implementation a
compiler traces agree on the work list's size. ``docs/design/jagged_flash_attention.md`` has
the measurements behind each cell.

Through the custom op. A ``torch.library`` custom op cannot take a dataclass, so a config
crosses it as a flat list of ints (``as_ints`` / ``from_ints``): the twelve tile numbers, the
three split and bias-chunk numbers, then the position of each path choice (the schedule last)
in its enum.
"""

import dataclasses
import enum
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "SHORT_KEYS",
    "DqPlacement",
    "JaggedAttentionConfig",
    "KernelImpl",
    "KeyLoads",
    "Regime",
    "Schedule",
    "TileShape",
    "arch_of",
    "config_for",
    "config_for_inputs",
    "regime_for",
]

# Sequences averaging at most this many keys take the short-keys tiles (a 64-key dK/dV tile).
SHORT_KEYS = 64
HEAD_DIMS = (32, 64, 128)
HOPPER_ARCHS = ("sm90",)


class KernelImpl(enum.Enum):
    """Which implementation runs a kernel."""

    TRITON = "triton"  # the Triton kernel (every device, and the interpreter)
    GLUON_HOPPER = "gluon_hopper"  # the Gluon twin of ``hopper/`` (sm_90, 2-byte, no bias)


class KeyLoads(enum.Enum):
    """How the Triton forward reads K and V blocks."""

    POINTERS = "pointers"  # per-element addresses, masked at the sequence's end
    TMA = "tma"  # tensor descriptors over the packed rows, where the layout allows


class DqPlacement(enum.Enum):
    """Which kernel writes dQ."""

    OWN_KERNEL = "own_kernel"  # the dQ kernel, which also computes δ for dK/dV
    IN_DKDV = "in_dkdv"  # the dK/dV kernel, for sequences whose keys fit its one key tile


class Schedule(enum.Enum):
    """How the queries are cut into the tiles the kernels' programs take."""

    PER_SEQUENCE = "per_sequence"  # tiles of one sequence each (work lists), any attention
    TOKEN_TILES = "token_tiles"  # tiles of consecutive tokens across sequences, each masked
    # block-diagonally inside: no tile padded to its height by a short sequence (self-attention
    # only; ``token_tiles.py``)


class Regime(enum.Enum):
    """The batch shape a tile table is made for."""

    LONG = "long"  # sequences averaging more than SHORT_KEYS keys
    SHORT_KEYS = "short_keys"  # at most SHORT_KEYS keys per sequence on average


@dataclass(frozen=True, kw_only=True)
class TileShape:
    """One kernel's tile and launch shape.

    ``block_m`` is the query rows of a tile (for dK/dV: streamed per step), ``block_n`` the key
    rows (for dK/dV: held by a program); powers of two, at least 16. ``warps`` and ``stages``
    are Triton's ``num_warps`` and the software pipeline's depth (for the Gluon kernels: the
    depth of their ring of streamed blocks).
    """

    block_m: int
    block_n: int
    warps: int
    stages: int


@dataclass(frozen=True, kw_only=True)
class JaggedAttentionConfig:
    """Tile shapes and code paths of the forward, dK/dV and dQ kernels.

    Args:
        forward, dkdv, dq: each kernel's ``TileShape``.
        split_rows: a dK/dV key tile that sees more query rows than this may be split ...
        max_splits: ... into at most this many chunks (``dkdv_splits``).
        dq_diag_chunk: interior bias diagonals the dQ kernel reduces per skewed read of a dS
            tile (capped at ``dq.block_n`` at launch: a gather index wider than its source
            along the axis can fail to compile).
        forward_impl, dkdv_impl, dq_impl: ``KernelImpl`` of each kernel; a Gluon kernel runs
            only where it can (sm_90, 2-byte inputs, no bias, rows it can copy), the Triton
            kernel otherwise.
        key_loads: ``KeyLoads`` of the Triton forward (TMA only where the layout allows).
        dq_placement: ``DqPlacement``; ``IN_DKDV`` applies without a bias and with the Triton
            dK/dV kernel only.
        schedule: ``Schedule``; ``TOKEN_TILES`` runs the three Triton kernels of
            ``token_tiles.py`` on the forward's, dK/dV's and dQ's tile shapes (self-attention
            only; the op raises for cross-attention).
    """

    forward: TileShape
    dkdv: TileShape
    dq: TileShape
    split_rows: int = 1024
    max_splits: int = 4
    dq_diag_chunk: int = 64
    forward_impl: KernelImpl = KernelImpl.TRITON
    dkdv_impl: KernelImpl = KernelImpl.TRITON
    dq_impl: KernelImpl = KernelImpl.TRITON
    key_loads: KeyLoads = KeyLoads.POINTERS
    dq_placement: DqPlacement = DqPlacement.OWN_KERNEL
    schedule: Schedule = Schedule.PER_SEQUENCE

    def as_ints(self) -> list[int]:
        """The config as the flat int list the custom ops take (``from_ints`` reads it)."""
        tiles = [getattr(t, f.name) for t in (self.forward, self.dkdv, self.dq) for f in _TILE]
        paths = [list(type(choice)).index(choice) for choice in self._paths()]
        return [*tiles, self.split_rows, self.max_splits, self.dq_diag_chunk, *paths]

    @classmethod
    def from_ints(cls, ints: list[int]) -> "JaggedAttentionConfig":
        """The config ``as_ints`` wrote.

        Raises:
            ValueError: a list of the wrong length or with a path index out of range.
        """
        if len(ints) != _NUM_INTS:
            raise ValueError(f"a config is {_NUM_INTS} ints, got {len(ints)}")
        width = len(_TILE)
        forward, dkdv, dq = (
            TileShape(**{f.name: int(ints[i * width + j]) for j, f in enumerate(_TILE)})
            for i in range(3)
        )
        split_rows, max_splits, dq_diag_chunk = (int(x) for x in ints[3 * width : 3 * width + 3])
        choices = []
        for kind, index in zip(_PATH_ENUMS, ints[3 * width + 3 :], strict=True):
            if not 0 <= index < len(kind):
                raise ValueError(f"{kind.__name__} index {index} is out of range")
            choices.append(list(kind)[index])
        return cls(
            forward=forward, dkdv=dkdv, dq=dq, split_rows=split_rows, max_splits=max_splits,
            dq_diag_chunk=dq_diag_chunk, forward_impl=choices[0], dkdv_impl=choices[1],
            dq_impl=choices[2], key_loads=choices[3], dq_placement=choices[4],
            schedule=choices[5],
        )  # fmt: skip

    def _paths(self) -> tuple:
        return (
            self.forward_impl, self.dkdv_impl, self.dq_impl, self.key_loads, self.dq_placement,
            self.schedule,
        )  # fmt: skip


_TILE = dataclasses.fields(TileShape)
_PATH_ENUMS = (KernelImpl, KernelImpl, KernelImpl, KeyLoads, DqPlacement, Schedule)
_NUM_INTS = 3 * len(_TILE) + 3 + len(_PATH_ENUMS)


def _tiles(block_m: int, block_n: int, warps: int, stages: int) -> TileShape:
    return TileShape(block_m=block_m, block_n=block_n, warps=warps, stages=stages)


# Every tile 16 rows and small chunks of bias diagonals, so that small tests cross tile and
# chunk edges; every path the interpreter runs (TMA loads, dQ in the dK/dV kernel) is on.
_INTERPRETER = JaggedAttentionConfig(
    forward=_tiles(16, 16, 4, 1), dkdv=_tiles(16, 16, 4, 1), dq=_tiles(16, 16, 4, 1),
    split_rows=32, max_splits=3, dq_diag_chunk=8,
    key_loads=KeyLoads.TMA, dq_placement=DqPlacement.IN_DKDV,
)  # fmt: skip

# Float32 (4-byte elements, IEEE dots): half-height tiles, two stages; correctness, not speed.
_FLOAT32 = MappingProxyType({
    32: JaggedAttentionConfig(
        forward=_tiles(64, 32, 4, 2), dkdv=_tiles(32, 64, 4, 2), dq=_tiles(64, 32, 4, 2)
    ),
    64: JaggedAttentionConfig(
        forward=_tiles(64, 32, 4, 2), dkdv=_tiles(32, 64, 4, 2), dq=_tiles(64, 32, 4, 2)
    ),
    128: JaggedAttentionConfig(
        forward=_tiles(64, 32, 4, 2), dkdv=_tiles(32, 32, 4, 2), dq=_tiles(64, 32, 4, 2)
    ),
})  # fmt: skip

_GLUON = dict(
    forward_impl=KernelImpl.GLUON_HOPPER, dkdv_impl=KernelImpl.GLUON_HOPPER,
    dq_impl=KernelImpl.GLUON_HOPPER,
)  # fmt: skip

# bf16 / fp16, long sequences, no bias. Head dim 128: 64-row query tiles on 4 warps for the
# forward and dQ (one shared work list), dK/dV on 64-key tiles with 4 warps and two stages (two
# programs per SM), the Triton forward's K and V through TMA; on Hopper the Gluon kernels.
_LONG = MappingProxyType({
    32: JaggedAttentionConfig(
        forward=_tiles(128, 64, 4, 3), dkdv=_tiles(64, 128, 8, 3), dq=_tiles(128, 64, 8, 2)
    ),
    64: JaggedAttentionConfig(
        forward=_tiles(128, 64, 8, 3), dkdv=_tiles(64, 128, 8, 3), dq=_tiles(128, 64, 8, 2)
    ),
    128: JaggedAttentionConfig(
        forward=_tiles(64, 64, 4, 3), dkdv=_tiles(64, 64, 4, 2), dq=_tiles(64, 64, 4, 3),
        key_loads=KeyLoads.TMA, **_GLUON,
    ),
})  # fmt: skip

# bf16 / fp16, short keys, no bias: a dK/dV program holds one 64-key tile and writes dQ of the
# sequences that fit it; the forward loads its few key blocks by pointers (a descriptor costs
# host time at every launch, and such a call is host-bound); the Triton kernels on Hopper too.
# Head dim 128 streams 32 query rows per dK/dV step on 4 warps, and its dQ keeps two stages.
_SHORT_KEYS = MappingProxyType({
    32: dataclasses.replace(
        _LONG[32], dkdv=_tiles(64, 64, 8, 3), dq_placement=DqPlacement.IN_DKDV
    ),
    64: dataclasses.replace(
        _LONG[64], dkdv=_tiles(64, 64, 8, 3), dq_placement=DqPlacement.IN_DKDV
    ),
    128: JaggedAttentionConfig(
        forward=_tiles(64, 64, 4, 3), dkdv=_tiles(32, 64, 4, 2), dq=_tiles(64, 64, 4, 2),
        dq_placement=DqPlacement.IN_DKDV,
    ),
})  # fmt: skip

# bf16 / fp16 with a relative bias, long sequences. Head dim 128: the forward on 128-row tiles
# with 8 warps and pointer loads, dQ on 64-row tiles with 4 warps (a work list each), dK/dV
# with two stages. Head dims 32 and 64 take the tiles of the plain path.
_BIAS_LONG = MappingProxyType({
    32: _LONG[32],
    64: _LONG[64],
    128: JaggedAttentionConfig(
        forward=_tiles(128, 64, 8, 3), dkdv=_tiles(64, 128, 8, 2), dq=_tiles(64, 64, 4, 2)
    ),
})  # fmt: skip

# bf16 / fp16 with a relative bias, short keys: the bias tiles with 64-key dK/dV tiles; dQ
# keeps its own kernel (it owns the bias gradient).
_BIAS_SHORT_KEYS = MappingProxyType({
    hd: dataclasses.replace(cfg, dkdv=dataclasses.replace(cfg.dkdv, block_n=64))
    for hd, cfg in _BIAS_LONG.items()
})  # fmt: skip

_TWO_BYTE = MappingProxyType({
    (Regime.LONG, False): _LONG,
    (Regime.SHORT_KEYS, False): _SHORT_KEYS,
    (Regime.LONG, True): _BIAS_LONG,
    (Regime.SHORT_KEYS, True): _BIAS_SHORT_KEYS,
})  # fmt: skip


def config_for(
    *, arch: str, dtype: torch.dtype, head_dim: int, regime: Regime, rel_bias: bool
) -> JaggedAttentionConfig:
    """The config of one (arch, dtype, head dim, regime, bias) cell.

    Args:
        arch: ``"interpreter"`` (the Triton interpreter: the 16-row config, whatever the other
            arguments), ``"sm90"`` (Hopper), or another CUDA arch such as ``"sm80"`` (the
            same tiles, Triton kernels only); ``arch_of`` names a device's.
        dtype: the inputs' dtype: float16/bfloat16, or float32 (half-height tiles, any regime
            and bias).
        head_dim: 32, 64 or 128.
        regime: ``Regime`` of the batch (``regime_for``).
        rel_bias: whether a relative bias is added (the bias tiles).

    Returns:
        The ``JaggedAttentionConfig``; the same object for the same arguments.

    Raises:
        ValueError: a head dim without tiles on a GPU arch.
    """
    if arch == "interpreter":
        return _INTERPRETER
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} has no tiles; supported: {HEAD_DIMS}")
    if dtype.itemsize > 2:
        return _FLOAT32[head_dim]
    config = _TWO_BYTE[(regime, bool(rel_bias))][head_dim]
    if arch not in HOPPER_ARCHS:
        config = dataclasses.replace(
            config, forward_impl=KernelImpl.TRITON, dkdv_impl=KernelImpl.TRITON,
            dq_impl=KernelImpl.TRITON,
        )  # fmt: skip
    return config


def regime_for(*, total_kv: int, num_seqs: int) -> Regime:
    """``SHORT_KEYS`` when the ``num_seqs`` sequences average at most ``SHORT_KEYS`` of the
    ``total_kv`` keys (``Tk / B``, both host-known shapes), else ``LONG``."""
    return Regime.SHORT_KEYS if total_kv / max(num_seqs, 1) <= SHORT_KEYS else Regime.LONG


# A device's compute capability, per device index: a fact of the hardware, asked once.
_CAPABILITIES: dict[int, tuple[int, int]] = {}


def arch_of(device: torch.device) -> str:
    """``"interpreter"`` for a tensor off CUDA (the Triton interpreter runs it), else the
    device's arch as ``"sm<major><minor>"`` (an H100 or H200: ``"sm90"``)."""
    if device.type != "cuda":
        return "interpreter"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    major, minor = _CAPABILITIES[index]
    return f"sm{major}{minor}"


def config_for_inputs(
    q: torch.Tensor, k: torch.Tensor, q_offsets: torch.Tensor, *, rel_bias: bool
) -> JaggedAttentionConfig:
    """``config_for`` the inputs' device, dtype, head dim and regime, from host-known shapes
    only (fake tensors too): ``q [Tq, N, H]``, ``k [Tk, N, H]``, ``q_offsets [B+1]``."""
    return config_for(
        arch=arch_of(q.device), dtype=q.dtype, head_dim=q.shape[2],
        regime=regime_for(total_kv=k.shape[0], num_seqs=q_offsets.shape[0] - 1),
        rel_bias=rel_bias,
    )  # fmt: skip
