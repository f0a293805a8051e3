"""What a run tells its user: a rich progress bar, log lines, TensorBoard, and the JSON summary.

Every step hands the ``Reporter`` its logits, batch and loss as device tensors; nothing is copied
to the host until the end of a logging window (``metrics.log_every`` steps), so the GPU is never
stalled mid-window. At the end of a window the reporter computes, over the window and over all
ranks: loss, NE and AUC per task (from every rank's predictions), QPS (samples per second), the
padding fraction a padded implementation would waste, the rank imbalance (the slowest rank's cost
over the mean, costed as the load balancer does), E2E MFU, and the largest rank's peak memory.
Throughput in the summary excludes the first ``min(10, steps // 10)`` steps (compilation,
allocator and cache warm-up).

Names say where a figure comes from: the windows' are ``train/<name>`` (``train/loss``,
``train/ctr_ne``, ...; the summary's ``history`` and the TensorBoard tags), the held-out
evaluation's at the end ``eval/<name>`` in TensorBoard. TensorBoard also gets the resolved config
as its hparams (``run_record.flat_config``, every field), with the evaluation's figures as their
metrics; the summary JSON carries the same config under ``config``.
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gem_train.data.loader import cost_coefficients
from gem_train.metrics import (
    Window,
    batch_flops,
    gather_over_ranks,
    peak_flops,
    peak_memory_bytes,
    quality_of,
)
from gem_train.model import TASKS
from gem_train.run_record import flat_config

# The held-out evaluation's figures: TensorBoard's scalars at the end and its hparams' metrics.
EVAL_METRICS = tuple(f"eval/{task}_{what}" for task in TASKS for what in ("ne", "auc"))


def _all_reduce(values: list[float], op) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


class Reporter:
    def __init__(self, run, *, start_step: int, t_start: float):
        self.run, self.cfg = run, run.cfg
        self.is_main = run.rank == 0
        self.peak = peak_flops(run.device, self.cfg.metrics.peak_tflops)
        self.cost_a, self.cost_b = cost_coefficients(self.cfg.model)
        self.start_step, self.warmup = start_step, min(10, (self.cfg.steps - start_step) // 10)
        self.losses: list[float] = []
        self.history: list[dict] = []
        self._pending_losses: list[torch.Tensor] = []
        self.window, self.window_cost = Window(), 0.0
        self.steady = {"samples": 0.0, "flops": 0.0, "seconds": 0.0}
        self.t_start, self.t_window, self.samples = t_start, time.perf_counter(), 0
        self.writer = self._writer()
        self.progress = self._progress()

    def _writer(self):
        if not (self.is_main and self.cfg.metrics.tensorboard):
            return None
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        writer = SummaryWriter(self.cfg.metrics.tensorboard)
        # into this run's own event file (``add_hparams`` would start another run beside it);
        # booleans as words, which TensorBoard would otherwise show as 0 and 1
        config = {
            k: str(v).lower() if isinstance(v, bool) else v
            for k, v in flat_config(self.cfg).items()
        }
        for summary in hparams(config, dict.fromkeys(EVAL_METRICS, math.nan)):
            writer.file_writer.add_summary(summary)
        return writer

    def _progress(self):
        if not (self.is_main and self.cfg.metrics.progress):
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
        )  # fmt: skip
        progress.start()
        self.task = progress.add_task(
            f"gem-train {self.cfg.name}", total=self.cfg.steps, completed=self.start_step, status=""
        )
        return progress

    def close(self) -> None:
        """Stop the progress bar and flush and close the TensorBoard writer; idempotent, so a
        run that fails part-way closes them too."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def step(self, step: int, logits: dict, batch, loss: torch.Tensor, prepared) -> None:
        """Record one step (``prepared``: its ``StepBatch``, for the host-side facts)."""
        real, lengths = prepared.real_samples, prepared.lengths  # padding samples come after
        labels = {"ctr": batch.click[:real], "cvr": batch.conversion[:real]}
        self._pending_losses.append(loss.detach())
        self.samples += real
        self.window.add(
            logits, labels, tokens=int(lengths.sum()),
            padded_tokens=len(lengths) * int(lengths.max(initial=0)),
            flops=batch_flops(self.cfg.model, lengths),
        )  # fmt: skip
        self.window_cost += float((self.cost_a * lengths + self.cost_b * lengths**2).sum())
        if self.progress is not None:
            self.progress.update(self.task, advance=1)
        done = step + 1
        if done == self.start_step + self.warmup and self.warmup > 0:
            self._close_window(step, report=False)  # the warm-up window is not timed
        elif done % self.cfg.metrics.log_every == 0 or done == self.cfg.steps:
            self._close_window(step, report=True)

    def _close_window(self, step: int, *, report: bool) -> None:
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)
        now = time.perf_counter()
        seconds, self.t_window = now - self.t_window, now
        losses = torch.stack(self._pending_losses).float().cpu().tolist()
        self._pending_losses = []
        self.losses.extend(losses)
        w, self.window = self.window, Window()
        samples, flops, cost_sum, loss_sum, loss_count, tokens, padded = _all_reduce(
            [w.samples, w.flops, self.window_cost, sum(losses), len(losses), w.tokens,
             w.padded_tokens],
            dist.ReduceOp.SUM,
        )  # fmt: skip
        cost_max, peak_memory = _all_reduce(
            [self.window_cost, float(peak_memory_bytes(self.run.device))], dist.ReduceOp.MAX
        )
        self.window_cost = 0.0
        if not report:
            return
        self.steady["samples"] += samples
        self.steady["flops"] += flops
        self.steady["seconds"] += seconds
        world = self.run.world
        quality = quality_of(*gather_over_ranks(w.logits, w.labels, world=world))
        figures = {
            "loss": loss_sum / loss_count,
            **quality,
            "padding_fraction": 1.0 - tokens / padded if padded else math.nan,
            "qps": samples / seconds,
            "lr": max(group["lr"] for group in self.run.optimizer.param_groups),
            "rank_imbalance": cost_max / (cost_sum / world) if cost_sum else math.nan,
            "e2e_mfu": flops / seconds / (self.peak * world) if self.peak else math.nan,
            "peak_memory_gib": peak_memory / 2**30,
        }
        row = {"step": step + 1, **{f"train/{key}": value for key, value in figures.items()}}
        self.history.append(row)
        self._scalars(row, step + 1)
        status = (
            f"loss {figures['loss']:.4f}  NE {figures['ctr_ne']:.3f}  "
            f"AUC {figures['ctr_auc']:.3f}  {figures['qps']:.0f} QPS"
        )
        if self.progress is not None:
            self.progress.update(self.task, status=status)
        else:
            self.print(f"step {row['step']:>6}  {status}")

    def _scalars(self, figures: dict, step: int) -> None:
        """TensorBoard scalars of ``figures`` (``step`` and NaNs, figures with no meaning on this
        run, left out)."""
        if self.writer is None:
            return
        for key, value in figures.items():
            if key != "step" and not (isinstance(value, float) and math.isnan(value)):
                self.writer.add_scalar(key, value, step)

    def finish(
        self, evaluation: dict, notes: list[str], *, skipped_nonfinite_steps: int = 0,
        fp8_decisions: dict | None = None,
    ) -> dict:  # fmt: skip
        """The run's summary (written to ``metrics.summary_json`` on rank 0); closes the progress
        bar and the TensorBoard writer. ``evaluation``: the held-out figures (``ctr_ne``, ...),
        TensorBoard's ``eval/<name>`` at the last step. ``skipped_nonfinite_steps``: steps
        skipped for a NaN or infinite loss or gradient (``optim.skip_nonfinite``);
        ``fp8_decisions``: the low-precision linears' fp8-or-BF16 table and the choices made
        (None: no such linears)."""
        self._scalars({f"eval/{key}": value for key, value in evaluation.items()}, self.cfg.steps)
        self.close()
        steady = self.steady
        world = self.run.world
        summary = {
            "config": flat_config(self.cfg),
            "steps": self.cfg.steps,
            "steps_this_run": self.cfg.steps - self.start_step,
            "samples": int(_all_reduce([float(self.samples)], dist.ReduceOp.SUM)[0]),
            "final_ne": evaluation.get("ctr_ne", math.nan),
            "final_auc": evaluation.get("ctr_auc", math.nan),
            "final": evaluation,
            "qps": steady["samples"] / steady["seconds"] if steady["seconds"] else math.nan,
            "e2e_mfu": (
                steady["flops"] / steady["seconds"] / (self.peak * world)
                if self.peak and steady["seconds"]
                else math.nan
            ),
            "wall_s": time.perf_counter() - self.t_start,
            "world_size": world,
            "rank": self.run.rank,
            "device": str(self.run.device),
            "optimisations": notes,
            "skipped_nonfinite_steps": skipped_nonfinite_steps,
            "fp8_decisions": fp8_decisions,
            "pinned_buffer_growths": (
                None if (staging := self.run.batches.staging) is None else staging.grown
            ),
            "losses": self.losses,
            "history": self.history,
        }
        if self.is_main and self.cfg.metrics.summary_json:
            path = Path(self.cfg.metrics.summary_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_standard_json(summary), indent=1, allow_nan=False))
        return summary


def _standard_json(value):
    """NaN and infinities (a figure with no meaning on this run, e.g. MFU on the CPU) as null, so
    the file parses with any JSON reader, not only Python's."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _standard_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_standard_json(v) for v in value]
    return value
