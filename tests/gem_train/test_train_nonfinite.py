"""A NaN or infinite loss or gradient is found, named by its step, and never trained on: the run
stops with an error by default, or skips and counts such steps with ``optim.skip_nonfinite``."""

import math

import pytest
import torch
from gem_train.config import ConfigError
from gem_train.finite import FiniteGuard, NonFiniteError
from gem_train.train import train


def test_a_diverging_run_stops_naming_the_step(small):
    """``optim.lr 1e6`` turns the loss NaN within a step or two; the run must not end 'done'."""
    with pytest.raises(
        NonFiniteError, match=r"non-finite .* at step \d+ of 6.*optim\.skip_nonfinite"
    ):
        train(small(optim__lr="1e6", optim__warmup_steps=0, optim__grad_clip=0))


def test_skip_nonfinite_skips_and_counts_the_bad_steps(small):
    summary = train(
        small(
            optim__lr="1e6", optim__warmup_steps=0, optim__grad_clip=0, optim__skip_nonfinite="true"
        )
    )
    assert 1 <= summary["skipped_nonfinite_steps"] <= 6


def test_a_healthy_run_skips_nothing(small):
    summary = train(small(steps=2, optim__skip_nonfinite="true"))
    assert summary["skipped_nonfinite_steps"] == 0
    assert all(math.isfinite(x) for x in summary["losses"])


def _model_with_grad(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.full_like(model.weight, value)
    return model


@pytest.mark.parametrize(
    ("loss", "grad", "expected"),
    [
        (math.nan, 1.0, "the loss is non-finite .* at step 3 of 5"),
        (math.inf, 1.0, "the loss is non-finite .* at step 3 of 5"),
        (0.5, math.nan, "a gradient is non-finite .* at step 3 of 5, the loss finite;"),
        (0.5, -math.inf, "a gradient is non-finite .* at step 3 of 5, the loss finite;"),
    ],
)
def test_the_guard_finds_a_bad_loss_or_gradient_without_syncing_each_step(
    small, loss, grad, expected
):
    guard = FiniteGuard(small(steps=5), device=torch.device("cpu"), world=1)
    healthy = _model_with_grad(1.0)
    for step in range(2):
        assert guard.allows_step(step, torch.tensor(0.5), healthy)
    guard.check()
    assert guard.allows_step(2, torch.tensor(loss), _model_with_grad(grad))  # recorded, not read
    assert guard.allows_step(3, torch.tensor(math.nan), healthy)  # a later bad step
    with pytest.raises(NonFiniteError, match=expected):
        guard.check()


def test_the_guard_checks_at_windows_checkpoints_and_the_last_step(small):
    guard = FiniteGuard(
        small(steps=10, metrics__log_every=4, checkpoint__every=3),
        device=torch.device("cpu"),
        world=1,
    )
    assert [s + 1 for s in range(10) if guard.due(s)] == [3, 4, 6, 8, 9, 10]


def test_skipping_mode_refuses_a_step_at_once(small):
    guard = FiniteGuard(small(optim__skip_nonfinite="true"), device=torch.device("cpu"), world=1)
    assert guard.allows_step(0, torch.tensor(0.5), _model_with_grad(1.0))
    assert not guard.allows_step(1, torch.tensor(0.5), _model_with_grad(math.nan))
    assert not guard.allows_step(2, torch.tensor(math.inf), _model_with_grad(1.0))
    assert guard.skipped == 2
    guard.check()  # skipping mode never raises


def test_skipping_needs_the_adamw_tables(small):
    with pytest.raises(
        ConfigError,
        match="optim.skip_nonfinite must be false with optim.embedding_optimizer=rowwise_adagrad",
    ):
        small(optim__skip_nonfinite="true", optim__embedding_optimizer="rowwise_adagrad")


def test_the_command_line_exits_non_zero_with_the_message(flags, capsys):
    from gem_train import cli

    diverging = flags(**{"optim.lr": "1e6", "optim.warmup_steps": 0, "optim.grad_clip": 0})
    assert cli.main(diverging) == 1
    err = capsys.readouterr().err
    assert "gem-train: error: the loss is non-finite" in err and "Traceback" not in err
