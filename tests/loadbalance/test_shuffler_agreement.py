"""The default calibration: ranks agree once on the mean cost, over a real gloo process group.

Two processes, each shuffling its own stream with ``calibration="agree"`` (the default) and no
group given (the default group): both must hold the same mean, equal to the sum of their first
look-aheads' costs over the sum of their counts, and produce exactly the batches of a shuffler
given that mean as a fixed ``expected_cost`` (what ``gem_loadbalance.simulate`` measures).
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gem_loadbalance import BaseBatchShuffler

LOCAL_BATCH, LOOKAHEAD, SUB_BATCH, SUB_BATCHES = 8, 2, 4, 20


def rank_source(rank: int) -> list[list[float]]:
    """Sub-batches of heavy-tailed costs, different on each rank."""
    costs = np.exp(np.random.default_rng([7, rank]).normal(0.0, 1.5, SUB_BATCH * SUB_BATCHES))
    return [costs[i : i + SUB_BATCH].round(4).tolist() for i in range(0, costs.size, SUB_BATCH)]


WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from gem_loadbalance import BaseBatchShuffler
    sys.path.insert(0, sys.argv[3])
    from test_shuffler_agreement import LOCAL_BATCH, rank_source

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2
    )
    shuffler = BaseBatchShuffler(rank_source(rank), cost=float, local_batch_size=LOCAL_BATCH)
    batches = list(shuffler)
    print(json.dumps({"agreed": shuffler.state_dict()["agreed_cost"], "batches": batches}))
    dist.destroy_process_group()
    """
)


def test_ranks_agree_on_one_mean_and_it_is_a_fixed_expected_cost(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = str(tmp_path / "store")
    here = str(__import__("pathlib").Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), store, here],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    first = (LOOKAHEAD + 1) * LOCAL_BATCH // SUB_BATCH  # sub-batches read before batch 0
    sums = [sum(float(np.sum(s)) for s in rank_source(r)[:first]) for r in range(2)]
    expected = (sums[0] + sums[1]) / (2 * first * SUB_BATCH)
    assert results[0]["agreed"] == results[1]["agreed"] == pytest.approx(expected, rel=1e-12)
    for rank, result in enumerate(results):
        fixed = BaseBatchShuffler(
            rank_source(rank),
            cost=float,
            local_batch_size=LOCAL_BATCH,
            expected_cost=result["agreed"],
            prior_weight=float("inf"),
        )
        assert list(fixed) == result["batches"]


def test_one_process_agrees_with_itself_and_a_resume_keeps_the_agreed_mean():
    source = rank_source(0)
    uninterrupted = BaseBatchShuffler(source, cost=float, local_batch_size=LOCAL_BATCH)
    batches = list(uninterrupted)
    first = (LOOKAHEAD + 1) * LOCAL_BATCH // SUB_BATCH
    own = sum(float(np.sum(s)) for s in source[:first]) / (first * SUB_BATCH)
    assert uninterrupted.state_dict()["agreed_cost"] == pytest.approx(own, rel=1e-12)
    head = BaseBatchShuffler(source, cost=float, local_batch_size=LOCAL_BATCH)
    iterator = iter(head)
    done = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(head.state_dict()))
    resumed = BaseBatchShuffler(source, cost=float, local_batch_size=LOCAL_BATCH)
    resumed.load_state_dict(state)
    assert done + list(resumed) == batches


def test_the_running_estimate_is_still_available_and_calibration_is_checked():
    source = rank_source(0)
    running = BaseBatchShuffler(
        source, cost=float, local_batch_size=LOCAL_BATCH, calibration="running"
    )
    list(running)
    assert running.state_dict()["agreed_cost"] is None
    with pytest.raises(ValueError, match="calibration"):
        BaseBatchShuffler(source, cost=float, local_batch_size=LOCAL_BATCH, calibration="auto")
