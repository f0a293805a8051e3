"""Each optimisation is applied from outside by its flag, and a missing package fails clearly."""

import sys

import pytest
from gem_train.train import train


def test_low_precision_recipe_converts_the_dense_linears(small):
    summary = train(small(steps=2, lowprec__recipe="bf16"))
    note = next(n for n in summary["optimisations"] if n.startswith("low precision"))
    assert "bf16" in note and "linears converted" in note


def test_fp8_choices_are_one_table_made_before_training_and_recorded(small):
    """Every low-precision linear shares one table-mode ``Fp8Decisions`` made at build time (on
    the CPU by the shape rule) for the token counts a sample batch gives the linears; the
    summary records the table and every choice made from it."""
    from gem_lowprec.linear import decisions_of
    from gem_train.components import build_run

    cfg = small(steps=2, lowprec__recipe="mxfp8", model__d_model=128, model__ffn_hidden=256)
    run = build_run(cfg)
    try:
        (decisions,) = decisions_of(run.model.dense)
        assert decisions.table is not None and decisions.table.entries
        assert all(key.m_bucket & (key.m_bucket - 1) == 0 for key in decisions.table.entries)
    finally:
        run.batches.close()
    summary = train(cfg)
    recorded = summary["fp8_decisions"]
    assert recorded["table"] == decisions.state_dict()["table"]
    assert recorded["used"]["entries"]  # the calls' choices, each with its rule
    note = next(n for n in summary["optimisations"] if n.startswith("low precision"))
    assert "(measure, the same on all 1 ranks)" in note


def test_a_resumed_run_makes_the_saved_fp8_choices(small, tmp_path):
    """A resume restores the checkpoint's table instead of the one it would make now: the
    first run's rule-mode reasons come back in a run that asks for measure mode."""
    flags = dict(lowprec__recipe="mxfp8", model__d_model=128, model__ffn_hidden=256,
                 checkpoint__folder=str(tmp_path), checkpoint__every=2)  # fmt: skip
    first = train(small(steps=2, lowprec__fp8_plan="rule", **flags))
    resumed = train(small(steps=4, lowprec__fp8_plan="measure", **flags))
    assert resumed["steps_this_run"] == 2
    whys = {row["why"] for row in resumed["fp8_decisions"]["table"]["entries"]}
    assert resumed["fp8_decisions"]["table"] == first["fp8_decisions"]["table"]
    assert any("lowprec.fp8_plan=rule" in why for why in whys)


def test_autoac_plans_every_block_and_pooling(small):
    summary = train(small(steps=2, memory__autoac=True, memory__budget_gib=4))
    note = next(n for n in summary["optimisations"] if n.startswith("AutoAC"))
    for region in ("blocks.0=", "pma=", "cross="):
        assert region in note


def test_autoac_on_cpu_needs_a_budget(small):
    with pytest.raises(RuntimeError, match="memory.budget_gib"):
        train(small(steps=1, memory__autoac=True))


@pytest.mark.parametrize(
    ("module", "flags", "message"),
    [
        (
            "gem_memory",
            {"memory__autoac": True, "memory__budget_gib": 1},
            "memory.autoac=true needs gem_memory",
        ),
        ("gem_lowprec", {"lowprec__recipe": "mxfp8"}, "lowprec.recipe=mxfp8 needs gem_lowprec"),
        ("gem_loadbalance", {"data__shuffle": True}, "data.shuffle=true needs gem_loadbalance"),
    ],
)
def test_a_missing_package_is_named(small, monkeypatch, module, flags, message):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(RuntimeError, match=message):
        train(small(steps=1, **flags))
