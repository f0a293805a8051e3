"""Which engine moves the bytes: the copy engines or the process group's own kernels.

An NCCL collective runs as a kernel that occupies SMs for its whole duration (the cost model
counts 24 of an H200's 132 for an all-gather at full bandwidth). When it overlaps a GEMM, those
SMs are taken from the GEMM, which slows down accordingly. A copy-engine collective moves the
same bytes with ``cudaMemcpyAsync`` between buffers mapped into every GPU of the host (PyTorch
symmetric memory): the DMA engines do the work and the only kernels left are tiny barriers. It
costs more latency per call (one copy launch per peer, two barriers), so it wins when the
transfer is overlapped with compute and the message is large enough for the launches to
amortise; an exposed (not overlapped) collective is usually as fast or faster through NCCL.

``choose_engine`` encodes that rule with thresholds that ``benchmarks/parallel/
bench_copy_engine_overlap.py`` measures (the crossover by message size). Every rank of a group must
take the same decision, or the ranks would call different collectives and hang; so the decision
depends only on values that agree across ranks: the message size (equal on every rank for
all-gather and reduce-scatter), the ``overlap`` flag the caller passes, the device type and the
group. An all-to-all with uneven splits has a different size on each rank, so ``auto`` sends it
through the process group unless the caller names the engine. The copy engines are considered
only when the caller passes the ``CopyEngines`` that keeps the groups' workspaces.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .copy_engine import CopyEngines

ENGINES = ("auto", "copy_engine", "sm")


@dataclass(frozen=True)
class EnginePolicy:
    """Thresholds for ``engine="auto"``.

    ``copy_engine_min_bytes_overlapped``: smallest message (bytes per rank, the input of an
    all-gather or the output of a reduce-scatter) sent through the copy engines when the caller says
    the collective overlaps compute. ``copy_engine_min_bytes_exposed``: the same when it does not
    overlap; ``None`` keeps exposed collectives on the process group at every size.
    """

    copy_engine_min_bytes_overlapped: int = 256 * 1024
    copy_engine_min_bytes_exposed: int | None = None

    def __post_init__(self):
        if self.copy_engine_min_bytes_overlapped < 0:
            raise ValueError(
                "copy_engine_min_bytes_overlapped must be >= 0, got "
                f"{self.copy_engine_min_bytes_overlapped}"
            )
        if (
            self.copy_engine_min_bytes_exposed is not None
            and self.copy_engine_min_bytes_exposed < 0
        ):
            raise ValueError(
                "copy_engine_min_bytes_exposed must be >= 0 or None, got "
                f"{self.copy_engine_min_bytes_exposed}"
            )

    def engine_for(self, nbytes: int, *, overlap: bool) -> str:
        """``"copy_engine"`` or ``"sm"`` for a message of ``nbytes`` bytes per rank, where the
        copy-engine path can run; ``overlap`` says whether the collective overlaps compute."""
        threshold = (
            self.copy_engine_min_bytes_overlapped if overlap else self.copy_engine_min_bytes_exposed
        )
        return "copy_engine" if threshold is not None and nbytes >= threshold else "sm"


DEFAULT_POLICY = EnginePolicy()


def check_engine(engine: str) -> str:
    """``engine`` itself when it is one of ``ENGINES``; ``ValueError`` otherwise."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def copy_engine_supported(
    device: torch.device, group: dist.ProcessGroup, *, engines: CopyEngines | None = None
) -> tuple[bool, str]:
    """Whether the copy-engine path can run for tensors on ``device`` over ``group``, and if not,
    why (a sentence). It needs CUDA tensors, an NCCL group, symmetric memory in this torch, a
    ``CopyEngines`` to keep the group's workspace in (``engines``) and every rank of the group on
    this host; the last is learnt once per group by a collective, so every rank must ask."""
    if device.type != "cuda":
        return False, f"the tensor is on {device.type}; the copy-engine path needs CUDA tensors"
    backend = str(dist.get_backend(group))
    if backend != "nccl" and "cuda:nccl" not in backend.split(","):
        return (
            False,
            f"the group's backend is {backend!r}; the copy-engine path needs NCCL for CUDA",
        )
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return False, f"this torch build has no symmetric memory ({exc})"
    if engines is None:
        return False, "no engines= was passed (a CopyEngines keeps the group's workspace)"
    if not engines.on_one_host(group):
        return False, "the group spans several hosts; copy engines reach only this host's GPUs"
    return True, ""


def choose_engine(
    engine: str,
    *,
    nbytes: int,
    device: torch.device,
    group: dist.ProcessGroup,
    overlap: bool,
    policy: EnginePolicy = DEFAULT_POLICY,
    engines: CopyEngines | None = None,
) -> str:
    """Resolve ``engine`` to ``"copy_engine"`` or ``"sm"`` (the process group's collective).

    ``"sm"`` stays ``"sm"``; ``"copy_engine"`` stays so where ``copy_engine_supported`` allows it
    and raises ``ValueError`` with its reason otherwise; ``"auto"`` takes ``policy.engine_for``
    (by ``nbytes`` and ``overlap``) where the copy engines can run, else ``"sm"``. ``ValueError``
    also for an engine not in ``ENGINES``.
    """
    check_engine(engine)
    if engine == "sm":
        return "sm"
    ok, why = copy_engine_supported(device, group, engines=engines)
    if engine == "copy_engine":
        if not ok:
            raise ValueError(f"engine='copy_engine' cannot run here: {why}")
        return "copy_engine"
    return policy.engine_for(nbytes, overlap=overlap) if ok else "sm"
