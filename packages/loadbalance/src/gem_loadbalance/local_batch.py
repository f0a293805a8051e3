"""Composing one local batch: which pooled samples leave now, so the batch costs what every rank aims at.

Each rank sees only its own stream, yet every rank's step should cost the same. The shuffler
holds a pool of samples (the batch being formed, the look-ahead, and samples held back from
earlier batches) and asks ``plan_local_batch`` for ``count`` of them whose total cost lands on a
``target``. The targets of all ranks agree without talking because they come from the same
quantity: the expected cost of a sample (``mean_cost``), which every rank estimates from the same
length distribution or receives from a shared calibration.

``batch_target``
    The neutral target is ``count · mean_cost``. A rank whose pool holds more cost than neutral
    (it drew heavy samples) must shed the excess, one whose pool is light must hold back; the
    target moves by ``gain`` times the pool's excess but never more than ``headroom`` (a fraction)
    either side of neutral. With the default gain the rule is nearly bang-bang: a heavy rank runs
    at exactly ``1 + headroom`` times neutral until its excess is gone. The clip is what balances
    ranks: the heaviest rank of a step costs at most ``1 + headroom`` times neutral, and because
    the clip is symmetric the pools' excess stays centred on zero, so the mean rank stays at
    neutral. ``headroom`` trades balance against how much excess a pool must carry (a random walk
    pushed back at rate ``headroom``): too small and heavy samples reach their delay limit
    together and force an overshoot; 1% is safe with ``max_delay=2`` on B1.
``plan_local_batch``
    1. Samples at their delay limit (natural batch ≤ step − max_delay) are forced in.
    2. The remaining slots are filled in urgency order (oldest natural batch first, heaviest first
       within a batch) for as long as the slots still open can be filled under the target with
       the cheapest samples; the open slots then take the cheapest samples left. Heavy samples
       thus leave as early as the target allows and never pile up at their deadline, which is
       what makes naive targeting (oldest first, then fix the sum) overshoot.
    3. A few best-pair swaps (one selected sample out, one pooled sample in, chosen by binary
       search over sorted costs) move the total onto the target; with hundreds of candidates the
       residual is usually a few parts per million.

Everything is numpy over at most a few thousand floats, so composing a batch costs far less
than the step it feeds.
"""

import numpy as np

__all__ = ["batch_target", "deadline_floor", "plan_local_batch"]


def batch_target(
    *,
    count: int,
    mean_cost: float,
    pool_cost: float,
    pool_count: int,
    headroom: float,
    gain: float,
) -> float:
    """Cost the next batch of ``count`` samples should have (see the module docstring).

    ``mean_cost`` is the expected cost of a sample, ``pool_cost`` / ``pool_count`` the total cost
    and the number of the samples pooled, ``headroom`` the clip (a fraction of the neutral
    target, either side) and ``gain`` the share of the pool's excess the target moves by.
    Returns ``count · mean_cost + gain · excess`` clipped to ``(1 ± headroom)`` of neutral.
    """
    neutral = count * mean_cost
    excess = pool_cost - pool_count * mean_cost
    return float(
        np.clip(neutral + gain * excess, neutral * (1.0 - headroom), neutral * (1.0 + headroom))
    )


def deadline_floor(
    costs: np.ndarray, natural_batch: np.ndarray, *, step: int, count: int, max_delay: int
) -> float:
    """The least this batch must cost so that samples nearing their delay limit fit in time.

    Samples due within the next ``j + 1`` batches (natural batch ≤ step + j − max_delay) must
    leave within ``j + 1`` batches, together with enough other samples to fill their
    ``(j + 1) · count`` slots. Counting the ``j · count`` samples still to be read as free (so the
    bound never overstates) and the rest as the cheapest pooled samples, the floor spreads that
    cost evenly over the ``j + 1`` batches, for every ``j`` up to ``max_delay``. When a pool has
    piled up heavy samples this raises the current batch a little instead of overshooting one
    batch a lot; in a healthy pool it stays far below the target.

    ``costs`` (float ``[pool]``) and ``natural_batch`` (int ``[pool]``) describe the pooled
    samples; returns the floor as a float (0.0 when nothing is due).
    """
    floor = 0.0
    order = np.argsort(costs, kind="stable")
    for j in range(max_delay + 1):
        due = natural_batch <= step + j - max_delay
        n_due = int(due.sum())
        slots = (j + 1) * count
        if n_due == 0 or n_due > slots:
            continue
        fill = order[~due[order]][: max(slots - n_due - j * count, 0)]
        floor = max(floor, (float(costs[due].sum()) + float(costs[fill].sum())) / (j + 1))
    return floor


def plan_local_batch(
    costs: np.ndarray,
    natural_batch: np.ndarray,
    *,
    step: int,
    count: int,
    target: float,
    max_delay: int,
    lookahead: int | None = None,
    swap_rounds: int = 16,
) -> np.ndarray:
    """Indices into the pool of the ``count`` samples that form batch ``step``.

    ``costs[i]`` and ``natural_batch[i]`` describe pooled sample ``i`` (its natural batch is the
    batch it would belong to without shuffling). Every sample with
    ``natural_batch <= step - max_delay`` is included; with ``lookahead``, no sample with
    ``natural_batch > step + lookahead`` is (a sub-batch may straddle the read horizon).

    Args:
        costs: float ``[pool]``, each pooled sample's cost.
        natural_batch: int ``[pool]``, each pooled sample's natural batch.
        step: the batch being formed.
        count: how many samples it takes (0 ≤ count ≤ pool).
        target: the cost to land on (``batch_target``, raised to ``deadline_floor``).
        max_delay: how many batches late a sample may leave.
        lookahead: how many batches early a sample may leave (None: any).
        swap_rounds: the most best-pair swaps tried.

    Returns:
        int64 ``[count]`` indices into the pool: the forced samples first, then the chosen ones.

    Raises:
        ValueError: ``costs`` and ``natural_batch`` not 1-D of one length, ``count`` out of range,
            more samples at their delay limit than ``count``, or fewer eligible samples than
            ``count``.
    """
    costs = np.asarray(costs, dtype=np.float64)
    natural_batch = np.asarray(natural_batch, dtype=np.int64)
    if costs.shape != natural_batch.shape or costs.ndim != 1:
        raise ValueError(
            f"costs and natural_batch must be 1-D of one length, got {costs.shape} and "
            f"{natural_batch.shape}"
        )
    if not 0 <= count <= costs.size:
        raise ValueError(f"count must lie in [0, {costs.size}] (the pool size), got {count}")
    forced_mask = natural_batch <= step - max_delay
    forced = np.flatnonzero(forced_mask)
    eligible = ~forced_mask
    if lookahead is not None:
        eligible &= natural_batch <= step + lookahead
    optional = np.flatnonzero(eligible)
    slots = count - forced.size
    if slots < 0:
        raise ValueError(
            f"{forced.size} samples reached their delay limit but the batch holds only {count}"
        )
    if slots > optional.size:
        raise ValueError(
            f"count {count} exceeds the {forced.size + optional.size} samples eligible at step {step}"
        )
    if slots == 0:
        return forced
    budget = target - float(costs[forced].sum())
    option_costs = costs[optional]

    # Stage 2: urgency order (oldest natural batch first, heaviest first within one), admitting
    # the longest prefix for which the open slots can still be filled under the budget with the
    # cheapest samples; the open slots then take the cheapest samples left.
    urgency = np.lexsort((-option_costs, natural_batch[optional]))
    cheapest = np.concatenate([[0.0], np.cumsum(np.sort(option_costs)[:slots])])
    prefix_cost = np.cumsum(option_costs[urgency[:slots]])
    n_prefix = np.arange(1, slots + 1)
    fits = prefix_cost + cheapest[slots - n_prefix] <= budget
    n_taken = slots if fits.all() else int(np.argmin(fits))
    taken = np.zeros(option_costs.size, dtype=bool)
    taken[urgency[:n_taken]] = True
    if n_taken < slots:
        rest = np.flatnonzero(~taken)
        rest = rest[np.argpartition(option_costs[rest], slots - n_taken - 1)[: slots - n_taken]]
        taken[rest] = True
    total = float(option_costs[taken].sum())

    # Stage 3: best-pair swaps toward the budget.
    selected = np.flatnonzero(taken)
    unselected = np.flatnonzero(~taken)
    diff = total - budget
    tolerance = 1e-6 * max(abs(target), 1.0)
    for _ in range(swap_rounds):
        if unselected.size == 0 or abs(diff) <= tolerance:
            break
        unselected = unselected[np.argsort(option_costs[unselected], kind="stable")]
        sorted_out = option_costs[unselected]
        # Swapping selected i for unselected j changes the total by c_j - c_i; aim c_j at c_i - diff.
        wanted = option_costs[selected] - diff
        above = np.clip(np.searchsorted(sorted_out, wanted), 0, sorted_out.size - 1)
        below = np.clip(above - 1, 0, sorted_out.size - 1)
        miss_above = np.abs(wanted - sorted_out[above])
        miss_below = np.abs(wanted - sorted_out[below])
        partner = np.where(miss_below < miss_above, below, above)
        miss = np.minimum(miss_above, miss_below)
        i = int(np.argmin(miss))
        if miss[i] >= abs(diff):
            break
        j = int(partner[i])
        diff += float(sorted_out[j] - option_costs[selected[i]])
        selected[i], unselected[j] = unselected[j], selected[i]
    return np.concatenate([forced, optional[selected]])
