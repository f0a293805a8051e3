"""Each optimisation is applied from outside by its flag, and a missing package fails clearly."""

import sys

import pytest
from gem_train.train import train


def test_low_precision_recipe_converts_the_dense_linears(small):
    summary = train(small(steps=2, lowprec__recipe="bf16"))
    note = next(n for n in summary["optimisations"] if n.startswith("low precision"))
    assert "bf16" in note and "linears converted" in note


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
