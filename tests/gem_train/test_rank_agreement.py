"""Ranks agree: started with different flags they refuse together at the start, naming the first
field that differs, instead of deadlocking (a different ``--steps``), aborting inside gloo (a
different ``d_model``) or training apart (a different ``--seed``); and what is decided at run
time from local measurements (AutoAC's plan) is one decision on every rank. Two gloo processes,
spawned as in ``test_checkpoint_distributed``."""

import os
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gem_train.conftest import small_config  # noqa: E402
from tests.parallel.parallel_launch import free_port  # noqa: E402


def _worker(rank, world, port, per_rank, result_dir):
    import torch
    from gem_train.config import ConfigError
    from gem_train.train import train

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    try:
        train(small_config(**per_rank[rank]))
        outcome = "trained"
    except ConfigError as exc:
        outcome = f"ConfigError: {exc}"
    Path(result_dir, f"rank{rank}.txt").write_text(outcome)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads, joined while Python finalizes, can abort the process


@pytest.mark.parametrize(
    "per_rank, field, values",
    [
        ([{"steps": 3}, {"steps": 5}], "steps", ("3", "5")),
        ([{"model__d_model": 64}, {"model__d_model": 32}], "model.d_model", ("64", "32")),
        ([{"seed": 0}, {"seed": 1}], "seed", ("0", "1")),
    ],
    ids=["steps", "d_model", "seed"],
)
def test_ranks_with_different_flags_refuse_together_naming_the_field(
    tmp_path, per_rank, field, values
):
    t0 = time.perf_counter()
    mp.start_processes(
        _worker, args=(2, free_port(), per_rank, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    assert time.perf_counter() - t0 < 120  # no deadlock: both refuse at the start
    expected = (
        f"ConfigError: the ranks resolved different configs: {field} is {values[0]} on rank 0 "
        f"but {values[1]} on rank 1"
    )
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith(expected)


def _autoac_worker(rank, world, port, result_dir):
    import dataclasses
    import json

    import gem_memory
    import torch
    import torch.distributed as dist
    from gem_train.components import make_source
    from gem_train.model import GemModel
    from gem_train.optimizations import apply_autoac

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    real, seen = gem_memory.plan_checkpointing, {}

    def timed_apart(*args, budget_bytes, **kwargs):
        """The real plan, then the policies this rank's own timings might pick."""
        seen["budget"] = budget_bytes
        plan = real(*args, budget_bytes=budget_bytes, **kwargs)
        mine = {name: ("full" if rank == 1 else "keep") for name in plan.policies}
        return dataclasses.replace(plan, policies=mine)

    gem_memory.plan_checkpointing = timed_apart
    cfg = small_config(memory__autoac=True, memory__budget_gib=(4, 2)[rank])
    torch.manual_seed(0)
    note = apply_autoac(GemModel(cfg.model), cfg, torch.device("cpu"), make_source(cfg), world=2)
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps([note, seen["budget"]]))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def test_autoac_is_one_plan_on_every_rank(tmp_path):
    """Budgets and recompute timings differ per rank; the plan does not: every rank plans under
    the smallest budget and applies rank 0's policies."""
    import json

    mp.start_processes(
        _autoac_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    (note0, budget0), (note1, budget1) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert budget0 == budget1 == 2 * 2**30
    assert note0 == note1 and "=keep" in note0 and "=full" not in note0


def _fp8_worker(rank, world, port, result_dir):
    import json

    import torch
    import torch.distributed as dist
    from gem_lowprec.fallback import m_bucket
    from gem_lowprec.linear import decisions_of
    from gem_train.components import make_source
    from gem_train.model import GemModel
    from gem_train.optimizations import _tokens_per_linear, apply_lowprec

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # the ranks' sample batches differ (another data seed on rank 1): their token counts do
    cfg = small_config(lowprec__recipe="mxfp8", model__d_model=128, model__ffn_hidden=256,
                       data__seed=rank, data__median_len=(8, 20)[rank])  # fmt: skip
    torch.manual_seed(0)
    model = GemModel(cfg.model)
    apply_lowprec(model, cfg, torch.device("cpu"), make_source(cfg), world=2)
    (decisions,) = decisions_of(model.dense)
    linears = [m for m in model.dense.modules() if hasattr(m, "recipe")]
    own = sorted(
        {
            m_bucket(m)
            for m in _tokens_per_linear(model, cfg, torch.device("cpu"), make_source(cfg), linears)
        }
    )
    table = decisions.state_dict()["table"]
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps([table, own]))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def test_fp8_choices_are_rank_zeros_table_on_every_rank(tmp_path):
    """Each rank's sample batch gives other token counts, but only rank 0 builds the table and
    every rank holds it: the same fp8-or-BF16 choice for every (shape, tokens) key."""
    import json

    mp.start_processes(
        _fp8_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    (table0, own0), (table1, own1) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
    )
    assert own0 != own1  # rank 1 alone would have built a table for other token counts
    assert table0 == table1 and table0["entries"]
    assert sorted({row["m_bucket"] for row in table0["entries"]}) == own0
