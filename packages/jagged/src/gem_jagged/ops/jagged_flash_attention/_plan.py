"""Launch plans: an eager call that repeats an earlier call's setting goes straight to its kernel.

An eager forward of a small batch is host-bound. On an H200 host, J3's forward (64 histories,
52.5K query tokens, attending to 64 candidate keys each) took 69 µs to issue against a 76 µs
kernel: 11 µs checking the
arguments, 25 choosing the tiles, finding the work list and preparing the launch, 24 in Triton's
launch path, 6 in the kernel launch itself (docs/performance.md, 2026-12-01, sixteenth session).
On a slower host that made the call slower than padded SDPA.

All of it but the pointers follows from a few host-known facts of the call, its *key*: the
shapes, strides, dtypes and devices of q, k and v, the identity of the offsets tensors, the
options and the current stream. A model calls each attention layer with the same key at every
step, and every layer of a step shares the batch's offsets. So the first eager call with a key
runs the checks and the ordinary launch and records a ``ForwardPlan``: the normalised options,
the work list, and the kernel's ``DirectLaunch`` (``gem_jagged._direct_launch``). A later call
with an equal key, with offsets at the same version, allocates the outputs and launches with its
own pointers. A key equal to that of a call whose checks passed passes them again; the offsets
passed their value check when first seen, and an in-place change bumps their version, which
sends the call down the ordinary path (that records the plan again).

Plans are made only where the eager fast path runs (``_op.eager_path_allowed``), outside
CUDA-graph capture and inference mode, without a relative bias, for a forward kernel reading
the caller's q, k and v in place, 16-byte aligned (``jfa_forward``'s ``record``): the Triton
kernel by pointers, or the Gluon kernel (Hopper), whose K and V descriptors are made again at
each call for the new pointers (and shared with the backward pass as ``jfa_forward`` shares
them). A plan is used only with q, k and v 16-byte aligned and no launch hook installed; it is
forgotten when an offsets tensor it serves dies.
"""

import dataclasses
import weakref

import torch

from gem_jagged._checks import capturing_cuda_graph
from gem_jagged._direct_launch import DirectLaunch

from . import hopper
from . import triton as kernels

__all__ = ["ForwardPlan", "key_of", "lookup", "remember", "forget_all"]

# key -> plan
_PLANS: dict[tuple, "ForwardPlan"] = {}

# The forward kernels' arguments that change from call to call, in ``ForwardPlan``'s order: by
# pointers (the Triton kernel; its bias tiles are ``q`` standing in, never read, for a bias-free
# launch), or K and V through descriptors made per call (the Gluon kernel).
PER_CALL_ARGS = (
    "q_TqNH", "k_TkNH", "v_TkNH", "out_TqNH", "lse_NTq", "q_offsets_Bp1", "kv_offsets_Bp1",
    "bias_tiles_NOMN",
)  # fmt: skip
PER_CALL_ARGS_DESCRIPTORS = (
    "q_TqNH", "k_desc", "v_desc", "out_TqNH", "lse_NTq", "q_offsets_Bp1", "kv_offsets_Bp1",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardPlan:
    """What an eager forward with one key needs beyond its pointers (see the module docstring).
    ``causal`` and ``scale`` are the call's options normalised (the backward pass reads them);
    ``cfg`` is the tile table entry the launch used, which ``config_chosen_by(chosen_by)`` must
    still hand back (a tuning sweep or a test may change the tables)."""

    launch: DirectLaunch
    cfg: kernels.JaggedAttentionConfig
    chosen_by: tuple
    descriptor_rows: int | None  # None: by pointers; else K/V descriptors of blocks this tall
    work_5W: torch.Tensor
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, int]
    stream: int
    causal: bool
    scale: float
    q_offsets: weakref.ref
    kv_offsets: weakref.ref
    versions: tuple[int, int]

    def serves(self, q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> bool:
        """Whether these offsets are the recorded ones, unchanged since, and the tile tables
        still choose the recorded entry."""
        return (
            self.q_offsets() is q_offsets
            and self.kv_offsets() is kv_offsets
            and self.versions == (q_offsets._version, kv_offsets._version)
            and kernels.config_chosen_by(self.chosen_by) is self.cfg
        )

    def forward(self, q, k, v, descriptors=None):
        """``(out, lse, work)`` as ``jfa_forward`` returns them (``descriptors``: its memo of
        TMA descriptors); None (nothing launched) when q, k or v is not 16-byte aligned or a
        launch hook is installed."""
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15 or not DirectLaunch.available():
            return None
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        offsets = (self.q_offsets().data_ptr(), self.kv_offsets().data_ptr())
        if self.descriptor_rows is None:
            k_arg, v_arg, bias_tiles = k_ptr, v_ptr, (q_ptr,)
        else:
            rows = self.descriptor_rows
            k_arg = hopper.row_descriptor(k, rows, descriptors)
            v_arg = hopper.row_descriptor(v, rows, descriptors)
            bias_tiles = ()
        self.launch(
            self.stream, q_ptr, k_arg, v_arg, out.data_ptr(), lse.data_ptr(), *offsets,
            *bias_tiles,
        )  # fmt: skip
        return out, lse, self.work_5W


def key_of(q, k, v, q_offsets, kv_offsets, *, causal, scale, rel_bias, hints, backend):
    """The call's key, or None where plans do not apply (module docstring). Never raises: a bad
    argument gets None here and its error from the checks."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return None
    plain = (q, k, v, q_offsets) if kv_offsets is None else (q, k, v, q_offsets, kv_offsets)
    if rel_bias is not None or any(type(t) is not torch.Tensor for t in plain):
        return None
    if not q.is_cuda or capturing_cuda_graph() or q_offsets.is_inference():
        return None
    if kv_offsets is not None and kv_offsets.is_inference():
        return None
    if any(type(x) is bool for x in (scale, *hints)):  # rejected by the checks; equal to 0 / 1
        return None
    device = torch._C._cuda_getDevice()  # Triton launches on the current device's stream
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
        q.device, k.device, v.device, id(q_offsets), id(kv_offsets), causal, scale, *hints,
        backend, device, torch._C._cuda_getCurrentRawStream(device),
    )  # fmt: skip


def lookup(key, q_offsets, kv_offsets) -> ForwardPlan | None:
    """The plan recorded for ``key`` if it still serves these offsets."""
    if key is None:
        return None
    plan = _PLANS.get(key)
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    if plan is None or not plan.serves(q_offsets, kv_offsets):
        return None
    return plan


def remember(key, recorded, out, lse, work_5W, q_offsets, kv_offsets, *, causal, scale) -> None:
    """Record the plan of a call whose checks passed, from its launch ``recorded``
    (``kernels.RecordedForward``)."""
    if torch.is_inference_mode_enabled():  # its work list would be an inference tensor
        return
    per_call = PER_CALL_ARGS if recorded.descriptor_rows is None else PER_CALL_ARGS_DESCRIPTORS
    launch = DirectLaunch.record(
        recorded.kernel, recorded.compiled, recorded.grid, recorded.args, recorded.constexprs,
        per_call=per_call,
    )  # fmt: skip
    if launch is None:
        return

    def forget(_, key=key):
        _PLANS.pop(key, None)

    _PLANS[key] = ForwardPlan(
        launch=launch,
        cfg=recorded.cfg,
        chosen_by=recorded.chosen_by,
        descriptor_rows=recorded.descriptor_rows,
        work_5W=work_5W,
        out_shape=tuple(out.shape),
        lse_shape=tuple(lse.shape),
        stream=key[-1],  # key_of's last entry: the stream current at the call
        causal=causal,
        scale=scale,
        q_offsets=weakref.ref(q_offsets, forget),
        kv_offsets=weakref.ref(kv_offsets, forget),
        versions=(q_offsets._version, kv_offsets._version),
    )


def forget_all() -> None:
    """Drop every plan (the next eager call of each key records its own again)."""
    _PLANS.clear()
