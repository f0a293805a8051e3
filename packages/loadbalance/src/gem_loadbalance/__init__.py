"""gem_loadbalance: a cost model, partitioners and Base Batch Shuffling.

- ``sample_cost`` / ``fit_cost_model`` / ``expected_sample_cost``: what a sample costs
  (``a·L + b·L²``), fitted to measured step times, and the mean every rank can aim at.
- ``partition(costs, k, method=...)``: split priced items into k balanced parts.
- ``BaseBatchShuffler``: balanced local batches on every rank with no communication.
- ``SubBatches`` / ``ShufflingIterableDataset`` / ``kjt_*``: PyTorch data loading and torchrec
  ``KeyedJaggedTensor`` batches (duck-typed; torchrec is never imported).
- ``plan_local_batch`` / ``batch_target`` (``gem_loadbalance.local_batch``): composing one local
  batch whose cost lands on a target, the shuffler's inner step.
- ``gem_loadbalance.workloads``: the project's benchmark workloads (J1–J7, B1) and their lengths.
- ``python -m gem_loadbalance.simulate``: measure the balance on workload B1.
"""

from importlib.metadata import PackageNotFoundError, version

from .cost import CostModel, expected_sample_cost, fit_cost_model, sample_cost
from .integrations import (
    KJTRow,
    KJTSubBatches,
    ShufflingIterableDataset,
    SubBatches,
    collate_kjt_rows,
    kjt_rows,
    kjt_sub_batch_cost,
)
from .local_batch import batch_target, plan_local_batch
from .partition import METHODS, max_over_mean, part_loads, partition
from .shuffler import BaseBatchShuffler, ShufflerConfig, ShufflerStats

try:
    __version__ = version("gem-loadbalance")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"

__all__ = [
    "METHODS",
    "KJTRow",
    "KJTSubBatches",
    "ShufflingIterableDataset",
    "SubBatches",
    "collate_kjt_rows",
    "kjt_rows",
    "kjt_sub_batch_cost",
    "BaseBatchShuffler",
    "CostModel",
    "ShufflerConfig",
    "ShufflerStats",
    "batch_target",
    "expected_sample_cost",
    "fit_cost_model",
    "max_over_mean",
    "part_loads",
    "partition",
    "plan_local_batch",
    "sample_cost",
]
