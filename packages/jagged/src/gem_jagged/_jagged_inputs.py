"""torchrec ``JaggedTensor`` and jagged nested tensors as attention inputs: one unwrapping rule.

The ops compute on a values tensor ``[T, N, H]`` plus offsets ``[B+1]``. Two library types
carry exactly that pair: torchrec's ``JaggedTensor`` (``.values()``, ``.offsets()``) and
PyTorch's nested tensors of layout ``torch.jagged`` (``[B, j, N, H]``; ``.values()``,
``.offsets()``). ``unwrap_jagged`` turns such q, k, v into values and offsets for the op and
returns the function that wraps the op's output back into the inputs' kind, with the queries'
offsets (the nested output shares q's ragged dimension, so ``x + attention(x, ...)`` adds).

gem_jagged does not depend on torchrec: a ``JaggedTensor`` is recognised through
``sys.modules``, so nothing is imported, and an object cannot be one unless torchrec is loaded.
Autograd flows through ``.values()`` and ``nested_tensor_from_jagged``, so a nested q, k or v
receives its gradient as a nested tensor.
"""

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from gem_jagged._checks import building_a_graph

PLAIN, TORCHREC, NESTED = "a plain tensor", "a torchrec JaggedTensor", "a jagged nested tensor"


class Unwrapped(NamedTuple):
    """What an op computes on, and how its output goes back to the caller's kind."""

    q: object
    k: object
    v: object
    q_offsets: object
    kv_offsets: object
    wrap: Callable[[torch.Tensor], object]


def _identity(out: torch.Tensor) -> torch.Tensor:
    return out


def kind_of(x) -> str:
    """``PLAIN`` for anything that is neither of the two jagged types (the op's checks judge
    it), else ``TORCHREC`` or ``NESTED``."""
    if type(x) is torch.Tensor:
        return PLAIN
    if isinstance(x, torch.Tensor):
        return NESTED if x.is_nested and x.layout == torch.jagged else PLAIN
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    if module is not None and isinstance(x, module.JaggedTensor):
        return TORCHREC
    return PLAIN


def _values_and_offsets(name: str, x, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == NESTED:
        if x.dim() != 4 or x._ragged_idx != 1:
            raise ValueError(
                f"{name} must be a jagged nested tensor [B, j, N, H] (ragged dimension 1), got "
                f"shape {tuple(x.shape)} with its ragged dimension at {x._ragged_idx}; transpose "
                "it back to [B, j, N, H]"
            )
        if x.lengths() is not None:
            raise ValueError(
                f"{name} is a nested tensor with holes (offsets and lengths); pass "
                f"{name}.contiguous()"
            )
        return x.values(), x.offsets()
    if x.weights_or_none() is not None:
        raise ValueError(f"{name} is a weighted JaggedTensor; attention takes no per-token weights")
    return x.values(), x.offsets()


def _same_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor, or equal values (read on the host; not while a graph is built, where only
    the same tensor counts)."""
    if a is b:
        return True
    if a.shape != b.shape or a.device != b.device or building_a_graph():
        return False
    return bool(torch.equal(a, b.to(a.dtype)))


def _wrapper(like, kind: str, offsets: torch.Tensor) -> Callable[[torch.Tensor], object]:
    if kind == NESTED:
        return lambda out: torch.nested.nested_tensor_from_jagged(out, offsets=offsets)
    return lambda out: type(like)(values=out, offsets=offsets)


def unwrap_jagged(
    q, k, v, q_offsets, kv_offsets, *,
    names: tuple[str, str | None] = ("q_offsets", "kv_offsets"),
    broadcast_q: bool = False,
    self_attention: bool = False,
) -> Unwrapped:  # fmt: skip
    """Values and offsets for an op called with q, k, v (plain, ``JaggedTensor`` or jagged
    nested tensors) and its offsets arguments, whose names are ``names`` (the second None
    for an op without key offsets).

    All three of one kind; or, with ``broadcast_q`` (PMA), plain seeds q and jagged k, v. Key
    offsets that are q's (the same tensor, or equal values) make self-attention; others are
    cross-attention's key offsets, which ``self_attention`` ops refuse. Plain inputs come back
    untouched, with the identity as ``wrap``.

    Raises:
        ValueError: mixed kinds, offsets passed beside jagged inputs, v's offsets not k's,
            nested tensors that are not ``[B, j, N, H]`` or have holes, weighted
            JaggedTensors, keys of other sequences for a self-attention op.
    """
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        return Unwrapped(q, k, v, q_offsets, kv_offsets, _identity)  # the common call, first
    off_name, kv_name = names
    kinds = {"q": kind_of(q), "k": kind_of(k), "v": kind_of(v)}
    if broadcast_q and kinds["q"] != PLAIN:
        raise ValueError(
            f"q is {kinds['q']}, but with broadcast_q=True q holds the [S, N, H] seeds every "
            "sequence shares: pass it as a plain tensor"
        )
    jagged_kind = kinds["k"] if broadcast_q else kinds["q"]
    for name in ("k", "v") if broadcast_q else ("q", "k", "v"):
        if kinds[name] != jagged_kind:
            first = "k" if broadcast_q else "q"
            raise ValueError(
                f"{name} is {kinds[name]} but {first} is {jagged_kind}; pass them as one kind: "
                "all torchrec JaggedTensors, all jagged nested tensors, or all plain tensors "
                "with offsets"
            )
    if jagged_kind == PLAIN:
        return Unwrapped(q, k, v, q_offsets, kv_offsets, _identity)
    carrier = "k" if broadcast_q else "q"
    for name, given in ((off_name, q_offsets), (kv_name, kv_offsets)):
        if given is not None:
            raise ValueError(
                f"{name}: {carrier} is {jagged_kind} and carries its offsets; pass {name}=None "
                "(or plain tensors with offsets)"
            )
    if not broadcast_q:
        q_values, q_off = _values_and_offsets("q", q, jagged_kind)
    k_values, k_offsets = _values_and_offsets("k", k, jagged_kind)
    v_values, v_offsets = _values_and_offsets("v", v, jagged_kind)
    if not _same_offsets(k_offsets, v_offsets):
        raise ValueError("v's offsets differ from k's; keys and values must be the same sequences")
    if broadcast_q:
        seeds = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() > 0 else 0
        out_offsets = torch.arange(k_offsets.shape[0], device=k_offsets.device) * seeds
        return Unwrapped(
            q, k_values, v_values, None, k_offsets, _wrapper(k, jagged_kind, out_offsets)
        )
    if _same_offsets(q_off, k_offsets):
        k_offsets = None
    elif self_attention:
        raise ValueError(
            "k's offsets differ from q's; the op is self-attention: q, k and v must hold the "
            "same sequences"
        )
    return Unwrapped(
        q_values, k_values, v_values, q_off, k_offsets, _wrapper(q, jagged_kind, q_off)
    )
