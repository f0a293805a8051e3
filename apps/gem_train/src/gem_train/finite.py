"""Non-finite losses and gradients: found, reported with their step, and never trained on.

Every step the ``FiniteGuard`` looks at the loss and at the global norm of every gradient (the
norm of a tensor is finite exactly when all its elements are, barring an overflow of the sum of
squares, which counts as non-finite too: such a gradient is unusable either way). How it reacts
depends on ``optim.skip_nonfinite``:

- ``false`` (the default): the run stops. To keep the device running ahead of the host, the guard
  records the first bad step in a device tensor (no sync) and reads it only where the loop waits
  for the device anyway: at the end of each logging window (``metrics.log_every``; 1 checks every
  step), before each checkpoint (so that no non-finite state is ever saved) and at the last step.
  The run therefore stops at most one window after the first bad step, with a ``NonFiniteError``
  that names that step. The parameters may already hold NaN then; nothing is saved or evaluated.
- ``true``: a step whose loss or gradients are non-finite is skipped (no optimizer update, its
  gradients dropped) and counted (``skipped_nonfinite_steps`` in the summary). Deciding whether to
  step is a host decision, so this mode costs one host sync per step. It requires the AdamW
  tables (``optim.embedding_optimizer=adamw``): the fused row-wise Adagrad updates the tables
  inside the backward, before a step could be skipped; the config refuses the combination.

Under ``torchrun`` the ranks reduce their findings (one small all-reduce per check) so that they
all stop, or all skip, together: a rank that stopped alone would leave the others waiting in
their next collective.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gem_train.config import TrainConfig


class NonFiniteError(RuntimeError):
    """The loss or a gradient became NaN or infinite; the message names the first such step."""


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class FiniteGuard:
    """Watches each step's loss and gradients; see the module docstring for the two modes.

    Args:
        cfg: the run's config (``optim.skip_nonfinite``, ``metrics.log_every``,
            ``checkpoint.every``, ``steps``).
        device: where the losses and gradients live.
        world: the number of ranks; above 1, findings are all-reduced over the default group.
    """

    def __init__(self, cfg: TrainConfig, *, device: torch.device, world: int):
        self.cfg, self.device, self.world = cfg, device, world
        self.skip = cfg.optim.skip_nonfinite
        self.skipped = 0
        self._none = cfg.steps + 1  # "no bad step yet", larger than every 1-based step
        self._first_bad = torch.full((2,), self._none, dtype=torch.int64, device=device)

    def _bad(self, loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
        """``[loss is non-finite, a gradient is non-finite]`` as a device bool tensor."""
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        loss_bad = ~torch.isfinite(loss.detach().float())
        if not grads:
            return torch.stack([loss_bad, torch.zeros_like(loss_bad)])
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return torch.stack([loss_bad, ~torch.isfinite(norm.float())])

    def allows_step(self, step: int, loss: torch.Tensor, model: torch.nn.Module) -> bool:
        """After the backward of 0-based ``step``: whether the optimizer may step.

        Stopping mode: records the step if it is bad and returns ``True`` without a sync. Skipping
        mode: syncs, and returns ``False`` (counting the step) when any rank found a non-finite
        loss or gradient.
        """
        bad = self._bad(loss, model)
        if not self.skip:
            step_t = torch.full_like(self._first_bad, step + 1)
            self._first_bad = torch.minimum(self._first_bad, torch.where(bad, step_t, self._none))
            return True
        flag = bad.any().to(torch.int32)
        if self.world > 1:
            flag = self._all_reduce(flag, dist.ReduceOp.MAX)
        if bool(flag):
            self.skipped += 1
            return False
        return True

    def due(self, step: int) -> bool:
        """Whether the loop checks after 0-based ``step`` (window end, checkpoint, last step)."""
        done, every = step + 1, self.cfg.checkpoint.every
        return (
            done % self.cfg.metrics.log_every == 0
            or done == self.cfg.steps
            or bool(every and done % every == 0)
        )

    def check(self) -> None:
        """Raise if any rank saw a non-finite loss or gradient so far (stopping mode; one sync).

        Raises:
            NonFiniteError: naming the first bad step (1-based) and what was non-finite, on every
                rank alike.
        """
        if self.skip:
            return
        first = self._first_bad
        if self.world > 1:
            first = self._all_reduce(first, dist.ReduceOp.MIN)
        loss_step, grad_step = (int(x) for x in first.cpu())
        if min(loss_step, grad_step) == self._none:
            return
        of = f"of {self.cfg.steps}"
        if loss_step <= grad_step:
            what = f"the loss is non-finite (NaN or infinite) at step {loss_step} {of}"
        else:
            what = f"a gradient is non-finite (NaN or infinite) at step {grad_step} {of}, the loss finite"
        raise NonFiniteError(
            f"{what}; the run stops (nothing more is trained, saved or "
            f"evaluated). Lower optim.lr={self.cfg.optim.lr:g} or tighten optim.grad_clip, or pass "
            "--optim.skip_nonfinite true to skip such steps"
        )

    def _all_reduce(self, value: torch.Tensor, op) -> torch.Tensor:
        """``value`` reduced over the ranks (moved to the CPU for gloo)."""
        on_host = dist.get_backend() == "gloo"
        reduced = value.cpu() if on_host else value.clone()
        dist.all_reduce(reduced, op=op)
        return reduced
