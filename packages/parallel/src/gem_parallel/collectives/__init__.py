"""SM-free collectives: all-gather, reduce-scatter and all-to-all on copy engines or SMs.

``engine="copy_engine"`` moves bytes with the GPUs' DMA engines through PyTorch symmetric memory
(see ``copy_engine.py``), so a collective overlapped with a GEMM leaves the GEMM all its SMs;
``engine="sm"`` is the process group's own collective (NCCL, or gloo on the CPU); ``engine="auto"``
picks by message size and the caller's ``overlap`` hint (``policy.py``). ``install_fsdp_all_gather``
routes FSDP2's parameter all-gathers through the same choice. The copy engines' workspaces live in
a ``CopyEngines`` object that the caller creates and passes (``engines=``).

NVLink multicast is never enabled: the copy-engine path sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
before it allocates symmetric memory.
"""

from .api import all_gather, all_to_all, exchange_split_sizes, reduce_scatter
from .copy_engine import CopyEngines, CopyEngineWork
from .fsdp import FSDPAllGather, install_fsdp_all_gather
from .policy import DEFAULT_POLICY, ENGINES, EnginePolicy, choose_engine, copy_engine_supported

__all__ = [
    "DEFAULT_POLICY",
    "ENGINES",
    "CopyEngineWork",
    "CopyEngines",
    "EnginePolicy",
    "FSDPAllGather",
    "all_gather",
    "all_to_all",
    "choose_engine",
    "copy_engine_supported",
    "exchange_split_sizes",
    "install_fsdp_all_gather",
    "reduce_scatter",
]
