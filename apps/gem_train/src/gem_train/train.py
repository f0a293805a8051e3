"""The training loop.

``train(cfg)`` builds the run (``components.build_run``: process group, model, optimisations,
optimizer, data), resumes from the newest checkpoint if there is one, then for each step: take
this rank's next balanced batch (prepared in the background), compute both tasks' logits and the
summed BCE loss, step AdamW, report, and checkpoint when due. Nothing in a step waits for the
device; an optional ``profiling.StepTimer`` times each phase. A ``finite.FiniteGuard`` watches
the loss and gradients: a NaN or infinity stops the run at the next logging window or checkpoint
(``NonFiniteError`` naming the step), or skips the step with ``optim.skip_nonfinite``. A worker
whose ``torchrun`` agent died stops (``supervision.SupervisorLost``). At the end it evaluates NE
and AUC on held-out batches and returns the summary (also written to ``metrics.summary_json``).
With ``checkpoint.async_save`` a save goes on in the background; the next save, the end of the
run and a failing run wait for it. ``metrics.profile_trace`` records a few steps with
``torch.profiler`` (``profiling.ProfileTrace``). However the run ends, the loader's thread, the
progress bar, the TensorBoard writer, the profiler and the process group are closed.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from gem_train.components import Run, build_run
from gem_train.config import TrainConfig
from gem_train.data.loader import StepBatch
from gem_train.metrics import gather_over_ranks, quality_of
from gem_train.model import loss_of
from gem_train.profiling import ProfileTrace, StepTimer
from gem_train.reporting import Reporter


def train(cfg: TrainConfig, *, timer: StepTimer | None = None) -> dict:
    t_start = time.perf_counter()
    run = reporter = trace = None
    try:
        run = build_run(cfg)
        start, resumed_from = resume(run)
        reporter = Reporter(run, start_step=start, t_start=t_start)
        if resumed_from is not None:
            reporter.print(f"resumed from step {start} ({resumed_from})")
        trace = _profile_trace(run, reporter, start)
        return _loop(run, reporter, start, timer or StepTimer(run.device, enabled=False), trace)
    except BaseException as exc:
        # A save still in flight completes (every rank's background save goes on while its
        # main thread fails) before the process group goes; its own failure is told too.
        if run is not None and run.checkpointer is not None:
            try:
                run.checkpointer.wait()
            except Exception as failed:
                exc.add_note(f"the checkpoint save in flight failed too: {failed}")
        raise
    finally:
        # However the run ends (building it included): a loader thread left inside torch at
        # interpreter exit aborts the process, and an unclosed writer loses its last events.
        if run is not None:
            run.batches.close()
        if trace is not None:
            trace.close()
        if reporter is not None:
            reporter.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _profile_trace(run: Run, reporter: Reporter, start: int) -> ProfileTrace:
    """The run's ``metrics.profile_trace``; says so when a resumed run starts past its steps."""
    m = run.cfg.metrics
    last = m.profile_first_step + m.profile_steps - 1
    if m.profile_trace and last <= start:
        reporter.print(
            f"metrics.profile_trace: no trace; steps {m.profile_first_step} to {last} precede "
            f"this run's first step {start + 1} (resumed)"
        )
    return ProfileTrace(
        m.profile_trace, first=m.profile_first_step, count=m.profile_steps,
        total=run.cfg.steps, rank=run.rank, device=run.device,
    )  # fmt: skip


def _loop(run: Run, reporter: Reporter, start: int, timer: StepTimer, trace: ProfileTrace) -> dict:
    cfg, guard = run.cfg, run.guard
    for note in run.notes:
        reporter.print(note)
    run.model.train()
    for step in range(start, cfg.steps):
        run.supervision.check(step)
        trace.begin(step)
        timer.begin()
        prepared = next(run.batches)  # shuffled, padded, pinned by the loader's thread
        batch, logits, loss = train_step(run, prepared, step, timer)
        if guard.due(step):
            guard.check()  # before the window is reported and before any checkpoint
        reporter.step(step, logits, batch, loss, prepared)
        timer.mark("metrics")
        every = cfg.checkpoint.every
        if run.checkpointer and ((every and (step + 1) % every == 0) or step + 1 == cfg.steps):
            save(run, step + 1)
        written = trace.end(step)
        if written is not None:
            reporter.print(f"profile trace of steps {trace.steps[0]} to {step + 1}: {written}")
    evaluation = evaluate(run)  # overlaps an asynchronous save of the last step
    if run.checkpointer is not None:
        run.checkpointer.wait()  # the run is done once its last checkpoint is
    return reporter.finish(
        evaluation, run.notes, skipped_nonfinite_steps=guard.skipped,
        fp8_decisions=fp8_decisions(run),
    )  # fmt: skip


def train_step(run: Run, prepared: StepBatch, step: int, timer: StepTimer):
    """One optimizer step; returns the device batch, the real samples' logits and the loss, none
    of them synced. Padding samples (``lowprec.token_multiple``) are dropped before the loss.
    ``run.guard`` sees the loss and gradients before the update and may skip it
    (``optim.skip_nonfinite``)."""
    batch = prepared.to(run.device)
    timer.mark("data")
    run.set_lr(step)
    with run.autocast():
        logits = run.model(batch, prepared.max_len)
    logits = {task: value[: prepared.real_samples] for task, value in logits.items()}
    loss, _ = loss_of(logits, batch)
    timer.mark("forward")
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    timer.mark("backward")
    if run.guard.allows_step(step, loss, run.model):
        run.clip_gradients()
        run.optimizer.step()
    timer.mark("optimizer")
    return batch, logits, loss


def save(run: Run, step: int) -> None:
    state = {"step": step, "data": run.batches.state_dict()}
    if (fp8 := fp8_decisions(run)) is not None:
        state["fp8"] = fp8  # a resume makes the saved choices, whatever it would measure now
    run.checkpointer.save(step, run.model, run.optimizer, state)


def resume(run: Run) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint it comes from: ``(0, None)``, or the newest
    checkpoint's step and folder (verified, then loaded)."""
    if run.checkpointer is None or not run.cfg.checkpoint.resume:
        return 0, None
    path = run.checkpointer.latest()
    if path is None:
        return 0, None
    state = run.checkpointer.load(path, run.model, run.optimizer)
    run.batches.load_state_dict(state["data"])
    if "fp8" in state and fp8_decisions(run) is not None:
        from gem_lowprec.fp8_plan import restore_fp8

        restore_fp8(run.model.dense, state["fp8"])
    return int(state["step"]), path


def fp8_decisions(run: Run) -> dict | None:
    """The fp8-or-BF16 table the low-precision linears share and the choices made from it
    (``gem_lowprec.fp8_plan.fp8_state``), or None without low-precision linears."""
    if run.cfg.lowprec.recipe == "none":
        return None
    from gem_lowprec.linear import decisions_of

    if not decisions_of(run.model.dense):
        return None
    from gem_lowprec.fp8_plan import fp8_state

    return fp8_state(run.model.dense)


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """NE and AUC per task on ``data.eval_batches`` held-out batches (split over the ranks)."""
    cfg = run.cfg
    run.model.eval()
    logits, labels = {"ctr": [], "cvr": []}, {"ctr": [], "cvr": []}
    for i in range(-(-cfg.data.eval_batches // run.world)):  # the same count on every rank
        batch = _eval_batch(run, i * run.world + run.rank).to(run.device)
        with run.autocast():
            out = run.model(batch, int(batch.lengths.max()))
        for task, label in (("ctr", batch.click), ("cvr", batch.conversion)):
            logits[task].append(out[task].float().cpu())
            labels[task].append(label.cpu())
    run.model.train()
    return quality_of(*gather_over_ranks(logits, labels, world=run.world))


def _eval_batch(run: Run, index: int):
    source = run.eval_source
    if hasattr(source, "batch"):  # synthetic: a held-out stream
        return source.batch(index)
    per_batch = run.cfg.data.batch_size // run.cfg.data.sub_batch_size  # Parquet: held-out rows
    return type(source.sub_batch(0)).cat(
        [source.sub_batch(index * per_batch + k) for k in range(per_batch)]
    )
