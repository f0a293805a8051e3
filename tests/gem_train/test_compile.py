"""The trainer's blocks trace whole under ``torch.compile(fullgraph=True)``: the low-precision
linears (their fp8 table's lookup), the jagged attention op and the norms, with the batch's
token count dynamic. ``aot_eager`` checks the tracing and the autograd graph without inductor's
code generation, so the compiled steps train as the eager ones do."""

from gem_train.components import build_run
from gem_train.profiling import StepTimer
from gem_train.train import train_step


def _losses(cfg, *, compiled: bool, steps: int = 3) -> list[float]:
    run = build_run(cfg)
    try:
        if compiled:
            for block in run.model.dense.blocks:
                block.compile(fullgraph=True, backend="aot_eager", dynamic=True)
        timer = StepTimer(run.device, enabled=False)
        return [
            float(train_step(run, next(run.batches), step, timer)[2].detach())
            for step in range(steps)
        ]
    finally:
        run.batches.close()


def test_blocks_compile_fullgraph_and_train_as_eager(small):
    cfg = small(
        lowprec__recipe="mxfp8", lowprec__token_multiple=128, model__d_model=128,
        model__ffn_hidden=256, model__n_layers=2,
    )  # fmt: skip
    eager = _losses(cfg, compiled=False)
    compiled = _losses(cfg, compiled=True)  # a graph break would raise under fullgraph
    assert len(set(eager)) == len(eager)  # the steps train: each loss is another batch's
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b)
