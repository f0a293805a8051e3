"""The one-time agreement on the mean sample cost: every rank of a job aims at the same target.

Base Batch Shuffling balances ranks without communicating by giving each rank's batch the same
target cost, ``count · mean_cost``. That works only if every rank holds the same ``mean_cost``.
Each rank's own running estimate does not: with heavy-tailed costs the estimates of different
ranks disagree by about ``cost CV / sqrt(samples read)`` for hundreds of steps, and the
disagreement is imbalance. A shared calibration fixes it, and the cheapest one every job has is
the data the ranks read before their first batch: each rank has read its look-ahead, so one
all-reduce of ``(cost sum, count)`` at the start gives every rank the same mean over
``world · (lookahead + 1) · local_batch_size`` samples. That value is then kept fixed for the
whole run (saved with the shuffler's state, so a resume needs no communication): mixing each
rank's own reads back in would make the ranks drift apart again.

The all-reduce goes over ``group`` (a ``torch.distributed`` process group) or, by default, over
the default group when ``torch.distributed`` is initialized; a process outside any group agrees
with itself. On an NCCL group the two numbers travel in a CUDA tensor, otherwise on the CPU.
Inside a ``DataLoader`` worker of a distributed job the process group cannot be used (the
worker is a copy of a rank, not a member of the group), and the agreement raises instead of
silently falling back to a per-worker estimate.
"""

__all__ = ["agree_on_mean"]


def agree_on_mean(cost_sum: float, count: int, *, group=None) -> float:
    """The mean sample cost over every rank of ``group``: ``Σ cost_sum / Σ count``.

    Args:
        cost_sum: this rank's total cost read so far (float, ≥ 0).
        count: the number of samples behind it (int, ≥ 0).
        group: a ``torch.distributed`` process group; None: the default group when
            ``torch.distributed`` is initialized, else this process alone.

    Returns:
        The agreed mean (float; 0.0 when no rank has read a sample). Every rank of the group
        returns the same float.

    Raises:
        ValueError: called inside a ``DataLoader`` worker while ``torch.distributed`` is
            initialized (give the shuffler ``expected_cost`` or ``calibration="running"``).
    """
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if group is None and not distributed:
        return cost_sum / count if count else 0.0
    if torch.utils.data.get_worker_info() is not None:
        raise ValueError(
            "calibration='agree' cannot all-reduce from a DataLoader worker of a distributed "
            "job; give expected_cost (a cost every rank computes alike) or calibration='running'"
        )
    device = "cpu"
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    totals = torch.tensor([float(cost_sum), float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(totals, group=group)
    total, n = totals.tolist()
    return total / n if n else 0.0
