"""A ``LowPrecisionLinear`` whose choices come from a table compiles with ``fullgraph=True``:
the table lookup and the bucket arithmetic trace (no private ``torch._C`` call, no warning), and
a dynamic token count is guarded by its bucket rather than specialised."""

import dataclasses

import pytest
import torch
from gem_lowprec import LowPrecisionLinear
from gem_lowprec.fallback import Fp8Decisions, m_bucket
from gem_lowprec.fp8_table import Fp8Choice, Fp8Key, Fp8Table, recipe_id
from gem_lowprec.recipes import Recipe


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
def test_table_mode_linear_compiles_fullgraph_and_matches_eager(recipe):
    recipe = Recipe(name=recipe)
    # M in the 64 bucket runs fp8 and in the 128 bucket BF16, by the table; M = 200 (bucket
    # 256) is not a multiple of 16: BF16 by the shape rule, before any table lookup
    key = Fp8Key(recipe_id(recipe), 128, 256, "float32", "float32", 64)
    table = Fp8Table({
        key: Fp8Choice(True, "fp8 faster"),
        dataclasses.replace(key, m_bucket=128): Fp8Choice(False, "BF16 faster"),
    })  # fmt: skip
    torch.manual_seed(0)
    layer = LowPrecisionLinear(128, 256, recipe=recipe, decisions=Fp8Decisions(table=table))
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (64, 96, 200):
        x = torch.randn(m, 128, requires_grad=True)
        y = compiled(x)
        (grad_x,) = torch.autograd.grad(y.square().sum(), x)
        x_eager = x.detach().requires_grad_()
        y_eager = layer(x_eager)
        (grad_eager,) = torch.autograd.grad(y_eager.square().sum(), x_eager)
        torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
        torch.testing.assert_close(grad_x, grad_eager, rtol=1e-6, atol=1e-6)
    used = {key.m_bucket: choice.keep_fp8 for key, choice in layer.decisions.used.items()}
    assert used == {64: True, 128: False}  # M = 200 never reaches the table
    assert (recipe.name, 256, 128, 256, torch.float32) in layer.decisions.fallback_report()


@pytest.mark.parametrize("m, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_m_bucket_is_the_next_power_of_two(m, bucket):
    assert m_bucket(m) == bucket
