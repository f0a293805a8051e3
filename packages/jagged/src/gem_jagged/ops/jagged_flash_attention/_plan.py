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
kernel by pointers, or the Gluon kernel (Hopper), whose K and V descriptors are passed again
at each call for the new pointers (``hopper.row_descriptor_arg``). A plan is used only with q,
k and v 16-byte aligned and no launch hook installed; it is forgotten when an offsets tensor it
serves dies.

The backward pass. An eager J1 step (causal self-attention over 120 histories at head dim 128)
issues its backward's two launches in about 0.7 ms of host time against 0.65 ms of kernels, so
the device waits for the host (docs/performance.md, 2026-12-01, sixteenth session). The first
backward of a forward with a plan records a ``BackwardPlan``: each launch ``jfa_backward`` made,
where each of its per-call arguments comes from (q, k, v, out, dout, lse, the offsets, or a
tensor the call made: dQ, dK, dV, δ, the split tiles' zeroed scratch, found by address), and
the shapes of the tensors to make. Its arguments that outlive the call (the work lists, the
unused scratch) stay as recorded, kept alive by the plan. A later backward of a forward with
the same key makes the tensors and launches with the new addresses. ``jfa_backward`` names
what it made and what it kept; the plan is recorded only when every tensor argument is one of
those or a call tensor, found unambiguously (distinct, 16-byte aligned addresses, no empty
tensor), so a temporary that a later edit adds without naming it stops the recording instead
of being launched again stale. It is used only with dout of q's shape and dtype, 16-byte
aligned once contiguous, on the recorded stream, while the forward plan it was recorded with
is the key's and serves the call's offsets (their versions, the tile tables). Measured
(2026-12-02, seventeenth session): J1's eager step issued in 0.40-0.57 ms instead of
0.85-1.06, below its 0.88 ms of kernels.
"""

import dataclasses
import weakref
from typing import NamedTuple

import torch

from gem_jagged._checks import capturing_cuda_graph
from gem_jagged._direct_launch import DirectLaunch

from . import hopper
from . import triton as kernels

__all__ = [
    "BackwardPlan", "ForwardPlan", "backward_plan", "forget_all", "key_of", "lookup", "remember",
    "remember_backward",
]  # fmt: skip

# key -> plan of the forward, and of the backward pass of a forward with that key
_PLANS: dict[tuple, "ForwardPlan"] = {}
_BACKWARD_PLANS: dict[tuple, "BackwardPlan"] = {}

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
    descriptors: bool  # K and V through TMA descriptors (the Gluon kernel), else by pointers
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

    def forward(self, q, k, v):
        """``(out, lse, work)`` as ``jfa_forward`` returns them; None (nothing launched) when
        q, k or v is not 16-byte aligned or a launch hook is installed."""
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15 or not DirectLaunch.available():
            return None
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        offsets = (self.q_offsets().data_ptr(), self.kv_offsets().data_ptr())
        if self.descriptors:
            k_arg, v_arg = hopper.row_descriptor_arg(k), hopper.row_descriptor_arg(v)
            bias_tiles = ()
        else:
            k_arg, v_arg, bias_tiles = k_ptr, v_ptr, (q_ptr,)
        self.launch(
            self.stream, q_ptr, k_arg, v_arg, out.data_ptr(), lse.data_ptr(), *offsets,
            *bias_tiles,
        )  # fmt: skip
        return out, lse, self.work_5W


class Source(NamedTuple):
    """Where a backward launch's per-call argument comes from: the tensor called ``name``
    (``BackwardPlan.backward``'s), ``offset`` bytes in, or a TMA descriptor of its rows."""

    name: str
    offset: int = 0
    descriptor: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class BackwardPlan:
    """The launches of an eager backward pass after a forward with one key (module
    docstring): each ``DirectLaunch`` with the ``Source`` of each of its per-call arguments,
    and the tensors to make per call (name, shape, dtype, zeroed). ``forward`` is the plan of
    the key when it was recorded: it is used only while that plan is the key's and serves the
    call's offsets (the same tensors, at the same versions, the tile tables unchanged), so its
    work lists are those offsets' lists."""

    launches: tuple[tuple[DirectLaunch, tuple[Source, ...]], ...]
    made: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]
    forward: ForwardPlan

    def backward(self, dout, q, k, v, out, lse, q_offsets, kv_offsets):
        """``(dq, dk, dv)`` as ``jfa_backward`` returns them without a bias; None (nothing
        launched) where the recorded launches do not apply (module docstring)."""
        dout = dout.contiguous()
        inputs = _inputs(dout, q, k, v, out, lse, q_offsets, kv_offsets)
        if (
            dout.shape != q.shape
            or dout.dtype != q.dtype
            or any(t.data_ptr() & 15 for t in inputs.values())
            or current_stream(q.device.index) != self.forward.stream
            or not DirectLaunch.available()
        ):
            return None
        tensors = inputs | {
            name: (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=q.device)
            for name, shape, dtype, zeroed in self.made
        }
        for launch, sources in self.launches:
            launch(self.forward.stream, *(_value(tensors, source) for source in sources))
        return tensors["dq"], tensors["dk"], tensors["dv"]


def _inputs(dout, q, k, v, out, lse, q_offsets, kv_offsets) -> dict[str, torch.Tensor]:
    """The backward's per-call tensors that it does not make, by name (the key-side offsets
    only when they are not the query side's: the key holds their identity)."""
    inputs = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, q_offsets=q_offsets)
    if kv_offsets is not q_offsets:
        inputs["kv_offsets"] = kv_offsets
    return inputs


def _value(tensors: dict[str, torch.Tensor], source: Source):
    tensor = tensors[source.name]
    if source.descriptor:
        return hopper.row_descriptor_arg(tensor)
    return tensor.data_ptr() + source.offset


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _sources(launch, named: dict[str, torch.Tensor], made: set[str], kept) -> dict | None:
    """Each per-call argument of ``launch`` (argument name -> ``Source``): a tensor of ``named``
    at its address, a tensor inside one ``made`` there, or a descriptor of one's rows; None if
    a tensor argument is none of those nor inside one of ``kept``."""
    by_address = {t.data_ptr(): name for name, t in named.items()}
    sources = {}
    for arg, value in launch.named_args().items():
        descriptor = hasattr(value, "block_shape")  # a TMA descriptor
        tensor = value.base if descriptor else value
        if not isinstance(tensor, torch.Tensor):
            continue
        address = tensor.data_ptr()
        if address in by_address:
            sources[arg] = Source(by_address[address], descriptor=descriptor)
            continue
        inside = [n for n in made if _span(named[n])[0] < address < _span(named[n])[1]]
        if inside and not descriptor:
            sources[arg] = Source(inside[0], offset=address - named[inside[0]].data_ptr())
        elif descriptor or not any(lo <= address < hi for lo, hi in map(_span, kept)):
            return None
    return sources


def backward_plan(key, q_offsets, kv_offsets) -> BackwardPlan | None:
    """The backward plan recorded after a forward with ``key``, if it still serves these
    offsets (``BackwardPlan``)."""
    plan = None if key is None else _BACKWARD_PLANS.get(key)
    if plan is None or _PLANS.get(key) is not plan.forward:
        return None
    return plan if plan.forward.serves(q_offsets, kv_offsets) else None


def remember_backward(key, recorded, q, k, v, out, lse, q_offsets, kv_offsets) -> None:
    """Record the backward plan of ``key`` from what ``jfa_backward`` did (``recorded``:
    ``kernels.RecordedBackward``) with these tensors, where its launches allow one (module
    docstring); only while the forward's plan of ``key`` lives (it is forgotten with it)."""
    forward = _PLANS.get(key)
    if forward is None or not recorded.plannable or not recorded.launches:
        return
    if not forward.serves(q_offsets, kv_offsets):  # its work lists may be other offsets'
        return
    named = _inputs(recorded.dout, q, k, v, out, lse, q_offsets, kv_offsets)
    named |= {name: t for name, (t, _) in recorded.made.items()}
    addresses = [t.data_ptr() for t in named.values()]
    if len(set(addresses)) < len(addresses) or any(
        t.numel() == 0 or t.data_ptr() & 15 for t in named.values()
    ):
        return
    launches = []
    for launch in recorded.launches:
        sources = _sources(launch, named, set(recorded.made), recorded.kept)
        direct = None if sources is None else DirectLaunch.record(launch, per_call=tuple(sources))
        if direct is None:
            return
        launches.append((direct, tuple(sources.values())))
    _BACKWARD_PLANS[key] = BackwardPlan(
        launches=tuple(launches),
        made=tuple(
            (name, tuple(t.shape), t.dtype, zeroed) for name, (t, zeroed) in recorded.made.items()
        ),
        forward=forward,
    )


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
        backend, device, current_stream(device),
    )  # fmt: skip


def current_stream(device_index: int) -> int:
    """The current CUDA stream of a device, as the launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


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
    (``kernels.RecordedForward``); the backward plan of an earlier one is forgotten."""
    _BACKWARD_PLANS.pop(key, None)
    if torch.is_inference_mode_enabled():  # its work list would be an inference tensor
        return
    per_call = PER_CALL_ARGS_DESCRIPTORS if recorded.descriptors else PER_CALL_ARGS
    launch = DirectLaunch.record(recorded.launch, per_call=per_call)
    if launch is None:
        return

    def forget(_, key=key):
        _PLANS.pop(key, None)
        _BACKWARD_PLANS.pop(key, None)

    _PLANS[key] = ForwardPlan(
        launch=launch,
        cfg=recorded.cfg,
        chosen_by=recorded.chosen_by,
        descriptors=recorded.descriptors,
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
    _BACKWARD_PLANS.clear()
