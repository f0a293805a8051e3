"""GDPA's launch configuration: tile shapes, program counts and code paths, picked by one function.

A ``GdpaTiles`` is a frozen value that the caller passes to the launchers (``tiles=``); nothing is
read from module state. ``tiles_for(arch=, dtype=, head_dim=, regime=)`` is the table the project
measured (``docs/design/gdpa.md`` records the numbers behind each cell):

- the interpreter (CPU) gets small tiles that keep its runs short and still cover several tiles
  per sequence, and a per-sequence split small enough that programs past a sequence's tiles are
  exercised;
- a GPU with fp32 operands gets halved tiles: fp32 takes twice the shared memory of bf16 per
  tile, and the bf16 tiles (128 × 64 queries × keys, three stages, head dim 128) do not fit in an
  H200's 227 KiB;
- a GPU with bf16/fp16 and head dim ≤ 64 gets 4-warp programs and 64 × 64 dK/dV tiles;
- head dim 128 gets 8-warp programs, the cross-attention forward's own smaller tiles and finer
  split (``cross_fwd_*``), and 64-row dQ tiles on 4 warps unless the relative bias is learned:
  there the bias gradient spills registers at 64 rows, so the bias regime keeps 128 rows on 8 warps.

The regime is what the host knows about a call beyond device, dtype and head dim:
``regime_for(rel_bias_NB=...)``.
"""

import dataclasses
import enum
from dataclasses import dataclass
from typing import Literal

import torch

from gem_jagged._intmath import next_power_of_2

__all__ = [
    "ACTIVATION_CODES",
    "Arch",
    "GdpaTiles",
    "Regime",
    "SigmoidForm",
    "activation_code",
    "arch_of",
    "regime_for",
    "seed_block",
    "tiles_for",
]

Arch = Literal["cuda", "interpreter"]

# The kernels' constexpr ``ACT``: the exact forms, and the forms built on ``tanh.approx.f32``.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "sigmoid": 4, "identity": 5}
TANH_APPROX_CODES = {"silu": 6, "gelu_tanh": 7, "sigmoid": 8}


class SigmoidForm(enum.Enum):
    """How the sigmoid-based activations (silu, gelu_tanh, sigmoid) are evaluated."""

    EXACT = "exact"  # ``tl.sigmoid``: exponential and reciprocal; runs everywhere
    TANH_APPROX = "tanh_approx"  # ``½ + ½·tanh.approx(x/2)``: one instruction, NVIDIA GPUs only


# ``as_ints`` runs inside compiled graphs, where Dynamo cannot iterate an enum class; a tuple of
# its members it can.
_SIGMOID_FORMS = tuple(SigmoidForm)


class Regime(enum.Enum):
    """What beyond device, dtype and head dim changes the best tiles."""

    PLAIN = "plain"
    RELATIVE_BIAS = "relative_bias"  # a learned ``rel_bias``: its gradient adds registers to dQ


@dataclass(frozen=True, kw_only=True)
class GdpaTiles:
    """Tile shapes, launch options and code paths of the kernels (rows of queries ``m``, of keys
    ``n``; ``warps`` and ``stages`` as Triton takes them).

    ``fwd_*``: the self-attention forward, and the per-sequence forward where ``cross_fwd_*`` is
    None. ``dkdv_*``, ``dq_*``: the backward kernels of both schedules. ``split_target``,
    ``max_split``: the per-sequence schedule (cross-attention, PMA) aims at ``split_target``
    programs in all, at most ``max_split`` per (sequence, head), so that one long sequence is not
    the tail of the launch. ``cross_min_part_tiles``: a cross-attention dK/dV chunk of query tiles
    is at least this long (each chunk adds its dK/dV to fp32 buffers with atomics).
    ``cross_fwd_m``/``_warps``/``_stages``/``_split_target``: the per-sequence cross-attention
    forward's own rows, warps, stages and program target, else the ``fwd_*`` ones and
    ``split_target``. ``sigmoid``: the form of the sigmoid-based activations.
    """

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    dkdv_m: int = 64
    dkdv_n: int = 128
    dkdv_warps: int = 8
    dkdv_stages: int = 2
    dq_m: int = 128
    dq_n: int = 64
    dq_warps: int = 8
    dq_stages: int = 2
    split_target: int = 1024
    max_split: int = 16
    cross_min_part_tiles: int = 4
    cross_fwd_m: int | None = None
    cross_fwd_warps: int | None = None
    cross_fwd_stages: int | None = None
    cross_fwd_split_target: int | None = None
    sigmoid: SigmoidForm = SigmoidForm.EXACT

    def as_ints(self) -> list[int]:
        """The fields as one ``int`` list (None as -1, ``sigmoid`` by its position in
        ``SigmoidForm``), the form a ``torch.library`` custom op can carry."""
        values = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, SigmoidForm):
                values.append(_SIGMOID_FORMS.index(value))
            else:
                values.append(-1 if value is None else int(value))
        return values

    @classmethod
    def from_ints(cls, values: list[int]) -> "GdpaTiles":
        """The inverse of ``as_ints``."""
        fields = dataclasses.fields(cls)
        if len(values) != len(fields):
            raise ValueError(f"GdpaTiles takes {len(fields)} ints, got {len(values)}")
        kwargs = {}
        for field, value in zip(fields, values, strict=True):
            if field.name == "sigmoid":
                kwargs[field.name] = _SIGMOID_FORMS[value]
            else:
                kwargs[field.name] = None if value == -1 else int(value)
        return cls(**kwargs)


_INTERPRETER_TILES = GdpaTiles(
    fwd_m=16, fwd_n=16, fwd_warps=4, fwd_stages=1, dkdv_m=16, dkdv_n=16, dkdv_warps=4,
    dkdv_stages=1, dq_m=16, dq_n=16, dq_warps=4, dq_stages=1, split_target=64, max_split=3,
    cross_min_part_tiles=2,
)  # fmt: skip
_FP32_TILES = GdpaTiles(
    fwd_m=64, fwd_n=32, fwd_warps=4, fwd_stages=2, dkdv_m=32, dkdv_n=64, dkdv_warps=4,
    dkdv_stages=1, dq_m=64, dq_n=32, dq_warps=4, dq_stages=1,
)  # fmt: skip


def arch_of(device: torch.device) -> Arch:
    """``"cuda"`` for a CUDA device, else ``"interpreter"`` (Triton's CPU interpreter)."""
    return "cuda" if device.type == "cuda" else "interpreter"


def regime_for(*, rel_bias_NB: torch.Tensor | None) -> Regime:
    """The regime of a call: ``RELATIVE_BIAS`` when it learns a ``[N, 2R+1]`` bias."""
    return Regime.PLAIN if rel_bias_NB is None else Regime.RELATIVE_BIAS


def tiles_for(*, arch: Arch, dtype: torch.dtype, head_dim: int, regime: Regime) -> GdpaTiles:
    """The measured tiles for a call (the module docstring gives the reasons).

    Args:
        arch: ``"cuda"`` or ``"interpreter"`` (``arch_of(device)``).
        dtype: the dtype of q, k, v (``torch.float16``, ``torch.bfloat16`` or ``torch.float32``).
        head_dim: H, one of 32, 64, 128.
        regime: ``regime_for(...)`` of the call.

    Returns:
        A ``GdpaTiles``.

    Raises:
        ValueError: for an unknown ``arch`` or ``regime``.
    """
    if arch not in ("cuda", "interpreter"):
        raise ValueError(f"arch must be 'cuda' or 'interpreter', got {arch!r}")
    if not isinstance(regime, Regime):
        raise ValueError(f"regime must be a Regime, got {regime!r}")
    if arch == "interpreter":
        return _INTERPRETER_TILES
    if dtype == torch.float32:
        return _FP32_TILES
    sigmoid = SigmoidForm.TANH_APPROX if dtype == torch.bfloat16 else SigmoidForm.EXACT
    if head_dim <= 64:
        return GdpaTiles(
            fwd_warps=4, dkdv_warps=4, dq_warps=4, dkdv_m=64, dkdv_n=64, sigmoid=sigmoid
        )
    tiles = GdpaTiles(
        cross_fwd_m=64, cross_fwd_warps=4, cross_fwd_stages=1, cross_fwd_split_target=4096,
        sigmoid=sigmoid,
    )  # fmt: skip
    if regime == Regime.RELATIVE_BIAS:
        return tiles  # 64-row dQ tiles spill in the bias gradient: keep 128 rows on 8 warps
    return dataclasses.replace(tiles, dq_m=64, dq_warps=4)


def activation_code(activation: str, *, sigmoid: SigmoidForm) -> int:
    """The kernels' ``ACT`` for ``activation`` (a name of ``reference.ACTIVATIONS``)."""
    if sigmoid == SigmoidForm.TANH_APPROX and activation in TANH_APPROX_CODES:
        return TANH_APPROX_CODES[activation]
    return ACTIVATION_CODES[activation]


def seed_block(num_seeds: int) -> int:
    """PMA: query rows of a tile of seeds, ``S`` rounded up to a power of two in [16, 64]."""
    return max(16, min(64, next_power_of_2(max(num_seeds, 1))))
