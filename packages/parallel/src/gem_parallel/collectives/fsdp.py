"""FSDP2's parameter all-gather through this package's engines.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a module replace its all-gather with any object
that has ``allocate(size, *, dtype, device)`` and ``__call__(output_tensor, input_tensor, group,
async_op)`` (``FSDPModule.set_custom_all_gather``, torch >= 2.9). FSDP calls it on its own
all-gather stream, with ``input_tensor`` a view of this rank's chunk of ``output_tensor``, and
records an event on that stream right after the call; so the copy-engine path finishes by making
FSDP's stream wait for the copies, and returns no work handle.

FSDP's all-gathers are prefetched to overlap the previous layer's compute, which is exactly where
a collective that occupies no SMs pays off; ``FSDPAllGather`` therefore passes ``overlap=True`` to
the engine policy.
"""

import torch
import torch.distributed as dist

from . import copy_engine
from .api import all_gather_single
from .copy_engine import CopyEngines
from .policy import DEFAULT_POLICY, EnginePolicy, check_engine, choose_engine


class FSDPAllGather:
    """A custom all-gather for FSDP2 that runs through ``engine`` ("auto", "copy_engine", "sm").

    ``policy`` holds the thresholds of ``"auto"``; ``engines`` the copy engines' workspaces (a
    new ``CopyEngines`` when not given, kept as ``self.engines``). ``calls`` counts the engine
    each call took. ``ValueError`` for an unknown engine.
    """

    def __init__(
        self,
        *,
        engine: str = "auto",
        policy: EnginePolicy = DEFAULT_POLICY,
        engines: CopyEngines | None = None,
    ):
        self.engine = check_engine(engine)
        self.policy = policy
        self.engines = engines if engines is not None else CopyEngines()
        self.calls: dict[str, int] = {"copy_engine": 0, "sm": 0}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's all-gather output buffer: an uninitialised tensor of ``size``."""
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        chosen = choose_engine(
            self.engine,
            nbytes=nbytes,
            device=input_tensor.device,
            group=group,
            overlap=True,
            policy=self.policy,
            engines=self.engines,
        )
        self.calls[chosen] += 1
        if chosen == "copy_engine":
            return copy_engine.all_gather_into(
                output_tensor, input_tensor, group, engines=self.engines
            )
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def install_fsdp_all_gather(
    module: torch.nn.Module,
    *,
    engine: str = "auto",
    policy: EnginePolicy = DEFAULT_POLICY,
    engines: CopyEngines | None = None,
) -> FSDPAllGather:
    """Route the all-gathers of every FSDP2 module inside ``module`` through ``engine``.

    Call after ``fully_shard``. ``engines`` shares a ``CopyEngines`` with other callers (default:
    the hook's own). Returns the hook (its ``calls`` counts the engine used per call).
    ``ValueError`` when ``module`` holds no FSDP2 module or the engine is unknown.
    """
    hook = FSDPAllGather(engine=engine, policy=policy, engines=engines)
    installed = 0
    for sub in module.modules():
        if hasattr(sub, "set_custom_all_gather") and hasattr(sub, "_get_fsdp_state"):
            sub.set_custom_all_gather(hook)
            installed += 1
    if installed == 0:
        raise ValueError(
            "module contains no FSDP2 module with set_custom_all_gather: apply "
            "torch.distributed.fsdp.fully_shard first (torch >= 2.9 is needed for custom all-gathers)"
        )
    return hook
