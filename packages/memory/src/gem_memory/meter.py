"""Memory meters: how many bytes of tensors are alive, and the most that were alive at once.

The planner and its checks need one number measured the same way everywhere: the peak bytes of
tensors alive during a training step. Two meters provide it.

- ``CudaMeter`` reads the caching allocator's counters (``torch.cuda.memory_allocated`` and
  ``max_memory_allocated``, with the peak reset at every mark). This is what an out-of-memory
  error is about.
- ``AccountingMeter`` (the CPU, or any device without allocator counters) is an accounting of
  storages: a ``TorchDispatchMode`` sees every tensor that an op returns, registers each new
  storage once with its size, and a weak reference on the storage subtracts it again when the
  storage dies. Autograd runs the backward of CPU tensors on the calling thread with the same
  dispatch modes, so saved tensors, recomputed activations, gradients and the temporaries of
  every op are all counted, exactly as an allocator without fragmentation would see them.

Both meters count only what is allocated while they run: parameters, buffers and the inputs
that exist before the step are "static" bytes, added by the caller (``static_bytes``).

``mark()`` closes a segment of the timeline: it returns the bytes alive now and the peak since the
previous mark, which is how the profiler measures each region's forward and backward separately.
"""

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Mark", "make_meter", "AccountingMeter", "CudaMeter", "static_bytes", "measure_peak"]


@dataclass(frozen=True)
class Mark:
    """Bytes alive at a mark and the most alive at once since the previous mark (both dynamic)."""

    live: int
    peak: int


def _dense(t) -> bool:
    """A tensor with a storage of its own to count (not sparse, not meta)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta


class AccountingMeter(TorchDispatchMode):
    """Counts the bytes of every storage created by an op while the mode is active."""

    def __init__(self):
        super().__init__()
        self._live = 0
        self._peak = 0
        self._sizes: dict[int, int] = {}

    # -- the dispatch hook: register new storages --------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # An output sharing an input's storage (a view, an in-place op) allocated nothing; this
        # also keeps views of tensors made before the meter started out of the count.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _dense(t)}
        for t in tree_leaves(out):
            if _dense(t):
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self._register(storage)
        return out

    def _register(self, storage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self._live -= self._sizes.pop(key, 0)

    # -- the timeline ------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Bytes of the storages created under the meter that are still alive."""
        return self._live

    def mark(self) -> Mark:
        """The bytes alive now and the peak since the previous mark; starts a new interval."""
        mark = Mark(self._live, self._peak)
        self._peak = self._live
        return mark


class CudaMeter:
    """The caching allocator's counters, relative to what was allocated when the meter started."""

    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        return False

    @property
    def live(self) -> int:
        """Bytes allocated on the device above what was allocated when the meter started."""
        return torch.cuda.memory_allocated(self.device) - self._base

    def mark(self) -> Mark:
        """The bytes alive now and the peak since the previous mark; starts a new interval."""
        peak = torch.cuda.max_memory_allocated(self.device) - self._base
        torch.cuda.reset_peak_memory_stats(self.device)
        return Mark(self.live, peak)


def make_meter(device: torch.device):
    """``CudaMeter`` on a CUDA device, else the storage accounting."""
    device = torch.device(device)
    return CudaMeter(device) if device.type == "cuda" else AccountingMeter()


def static_bytes(model: torch.nn.Module, *tensors) -> int:
    """Bytes of distinct storages held before a step: parameters, buffers and the given inputs.

    On CUDA the allocator already counts everything the process holds, so this is
    ``torch.cuda.memory_allocated`` there.
    """
    device = _device_of(model, tensors)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers(), *tree_leaves(list(tensors))]:
        if _dense(t):
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _device_of(model: torch.nn.Module, tensors) -> torch.device:
    for t in [*model.parameters(), *tree_leaves(list(tensors))]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def default_loss(output) -> torch.Tensor:
    """Sum of every floating output that requires grad (its backward allocates no copies)."""
    leaves = [
        t
        for t in tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not leaves:
        raise ValueError(
            "model output: expected at least one floating tensor that requires grad, got none"
        )
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def measure_peak(model: torch.nn.Module, sample_inputs, *, loss_fn=None) -> int:
    """Peak bytes of one training step (forward, loss, backward), static bytes included.

    Gradients are set to ``None`` first, as ``optimizer.zero_grad()`` does, so that the step
    allocates them. On CUDA this is ``max_memory_allocated``; elsewhere the storage accounting.

    Args:
        model: the model, as it will train (with a plan applied, say).
        sample_inputs: a tensor or a tuple of positional inputs.
        loss_fn: output -> scalar loss (default: the sum of every floating output needing grad).

    Returns:
        An int, bytes. ``ValueError`` when the default loss finds no output that needs grad.
    """
    inputs = tuple(sample_inputs) if isinstance(sample_inputs, (tuple, list)) else (sample_inputs,)
    loss_fn = loss_fn or default_loss
    for p in model.parameters():
        p.grad = None
    static = static_bytes(model, *inputs)
    meter = make_meter(_device_of(model, inputs))
    with meter:
        loss = loss_fn(model(*inputs))
        loss.backward()
        del loss
        peak = meter.mark().peak
    return static + peak
