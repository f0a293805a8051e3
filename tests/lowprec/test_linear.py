"""LowPrecisionLinear, convert, the fp8-vs-BF16 decisions and the emulated fp8 GEMMs. Every linear holds its decisions in an ``Fp8Decisions`` object (shared by
``convert``), so each test starts with none."""

import pytest
import torch
from gem_lowprec import Fp8Decisions, LowPrecisionLinear, convert, recipe, to_mx
from gem_lowprec.fallback import m_bucket, measure_fp8_against_bf16
from gem_lowprec.linear import fallback_report, measure_pending
from gem_lowprec.recipes import FallbackConfig, Recipe
from gem_lowprec.scaled_matmul import mx_matmul
from torch import nn


def test_mx_matmul_emulation_is_the_dequantized_product():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(96, 256, generator=gen)
    ma, mb = to_mx(a), to_mx(b)
    out = mx_matmul(ma, mb, torch.float32)
    torch.testing.assert_close(out, ma.dequantize() @ mb.dequantize().t(), rtol=1e-5, atol=1e-4)
    sqnr = 10 * torch.log10((a @ b.t()).pow(2).sum() / (out - a @ b.t()).pow(2).sum())
    assert 26.5 < sqnr < 30.5  # workloads.md: both operands MXFP8 about 28.5 dB


@pytest.mark.parametrize(
    "rec",
    [
        recipe("mxfp8"),
        recipe("mxfp8", weight_grad="fp8"),
        recipe("mxfp8", weight_grad="fp8", hadamard_block=64),
        recipe("fp8_rowwise"),
        recipe("fp8_rowwise", weight_grad="fp8"),
    ],
    ids=["mxfp8", "mxfp8-wgrad-fp8", "mxfp8-wgrad-fp8-hadamard", "rowwise", "rowwise-wgrad-fp8"],
)
@pytest.mark.parametrize("k,n", [(256, 128), (128, 256)], ids=["K>N", "K<N"])
def test_linear_forward_backward_close_to_fp64(rec, k, n):
    """K > N and K < N take the two ways of folding the per-token scale in the fp8 wgrad."""
    gen = torch.Generator().manual_seed(2)
    lin = LowPrecisionLinear(k, n, recipe=rec)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    # token magnitudes spread over 2^±3, as activations and gradients do
    spread = 2.0 ** torch.randint(-3, 4, (2, 64, 1), generator=gen).float()
    x = (torch.randn(2, 64, k, generator=gen) * spread).requires_grad_()
    dy = torch.randn(2, 64, n, generator=gen) * spread.flip(1)
    y = lin(x)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), lin.weight.detach().double().requires_grad_()
    y64 = x64 @ w64.t() + lin.bias.detach().double()
    y64.backward(dy.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(y, y64) < 0.05
    assert rel(x.grad, x64.grad) < 0.05
    exact_wgrad = rec.weight_grad.precision == "bf16"
    # a Hadamard rotation along tokens mixes loud tokens into quiet ones: about 6% here
    fp8_bound = 0.05 if rec.weight_grad.hadamard_block is None else 0.08
    assert rel(lin.weight.grad, w64.grad) < (1e-5 if exact_wgrad else fp8_bound)
    assert not fallback_report(lin) and not lin.decisions.fallback_report()


class ScriptedDecisions(Fp8Decisions):
    """Decisions that answer what the test says (a stand-in for a timing that changes them)."""

    def __init__(self, choice: dict):
        super().__init__()
        self.choice = choice

    def use_fp8(self, *args, **kwargs) -> bool:
        return self.choice["fp8"]


def test_recomputation_repeats_the_choice_of_its_forward():
    """A decision that changes between a checkpointed forward and its recomputation (a timing in
    between) must not change what the recomputation runs, or the saved tensors would differ."""
    from torch.utils.checkpoint import checkpoint

    choice = {"fp8": True}
    decisions = ScriptedDecisions(choice)
    layer = LowPrecisionLinear(128, 128, recipe=recipe("fp8_rowwise"), decisions=decisions)
    x = torch.randn(64, 128, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=False)
    choice["fp8"] = False  # e.g. the key got timed by another call before the backward
    y.square().sum().backward()
    grad_fp8 = x.grad.clone()
    x.grad = None
    layer(x).square().sum().backward()  # a new forward takes the new choice: BF16 exactly
    assert not torch.equal(grad_fp8, x.grad)
    x.grad = None
    choice["fp8"] = True
    checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    torch.testing.assert_close(x.grad, grad_fp8, rtol=0, atol=0)


def test_m_bucket():
    assert [m_bucket(m) for m in (1, 16, 17, 32768, 32769, 40960)] == [
        1, 16, 32, 32768, 65536, 65536,
    ]  # fmt: skip


def test_unaligned_shape_falls_back_and_says_so():
    lin = LowPrecisionLinear(96, 64, recipe=recipe("mxfp8"))
    x = torch.randn(32, 96)
    with pytest.warns(UserWarning, match="falls back to bf16"):
        y = lin(x)
    assert torch.equal(y, nn.functional.linear(x, lin.weight, lin.bias))
    assert any(k[2] == 96 for k in fallback_report(lin))
    assert not lin.decisions.unmeasured_keys()  # nothing is timed on the CPU


def test_convert_skips_heads_and_last_layer_and_shares_parameters():
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)))
    model.add_module("ctr_head", nn.Linear(128, 128))
    model.add_module("final", nn.Linear(128, 1))
    w0 = model.body[0].weight
    convert(model, "mxfp8", skip=("*head*",))
    assert isinstance(model.body[0], LowPrecisionLinear) and model.body[0].weight is w0
    assert isinstance(model.body[2], LowPrecisionLinear)
    assert type(model.ctr_head) is nn.Linear and type(model.final) is nn.Linear
    report = model.lowprec_conversion
    assert report.converted == ["body.0", "body.2"]
    assert set(report.skipped) == {"ctr_head", "final"}
    # one decisions object for the model: a shape is timed once, whichever layer meets it
    assert model.body[0].decisions is model.body[2].decisions is report.decisions
    assert measure_pending(model) == 0 and fallback_report(model) == {}
    with pytest.raises(ValueError, match="recipe name"):
        convert(nn.Linear(4, 4), "int4")


def _train(rec: Recipe | None, steps: int = 40) -> list[float]:
    """A 3-layer MLP regressing a fixed random teacher; the two hidden GEMMs are converted."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)
    )
    if rec is not None:
        convert(model, rec)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 8, generator=gen) * 2 / 128**0.5
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 128, generator=gen)
        target = torch.tanh(x @ teacher).sum(1, keepdim=True) / 8**0.5
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_small_model_trains_with_emulated_mxfp8_within_1pct_of_bf16():
    base = _train(None)
    mx = _train(recipe("mxfp8"))
    final_base, final_mx = sum(base[-5:]) / 5, sum(mx[-5:]) / 5
    assert final_base < 0.5 * base[0]  # it learns
    assert abs(final_mx - final_base) <= 0.01 * final_base, (final_mx, final_base)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp8", "fp8_rowwise"])
def test_gpu_linear_matches_emulation(name):
    rec = Recipe(name=name, fallback=FallbackConfig(measure_on_gpu=False))
    lin = LowPrecisionLinear(1024, 512, recipe=rec, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    y.float().pow(2).sum().backward()
    cpu = LowPrecisionLinear(1024, 512, recipe=rec, dtype=torch.bfloat16)
    cpu.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    xc = x.detach().cpu().requires_grad_()
    yc = cpu(xc)
    yc.float().pow(2).sum().backward()
    assert ((y.cpu().float() - yc.float()).norm() / yc.float().norm()) < 2e-2
    assert ((x.grad.cpu().float() - xc.grad.float()).norm() / xc.grad.float().norm()) < 3e-2


@pytest.mark.gpu
def test_gpu_first_call_timing_inside_checkpoint_saves_what_recompute_saves():
    """The per-shape fp8-vs-bf16 timing runs on a shape's first call, which may be inside a
    checkpointed region; its own saved tensors must not reach the checkpoint's hooks."""
    from torch.utils.checkpoint import checkpoint

    layer = LowPrecisionLinear(256, 384, recipe=Recipe(), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096 + 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=False)  # a shape no earlier test has decided
    y.float().square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
def test_gpu_first_call_inside_a_cuda_graph_capture_is_not_timed():
    """A shape first met while a CUDA graph is captured runs fp8 unmeasured (a timing there
    would be recorded into the graph, not run) and is timed by ``measure_pending`` after."""
    from torch.utils.checkpoint import checkpoint

    layer = LowPrecisionLinear(256, 896, recipe=Recipe(), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) where timing is not allowed either
        checkpoint(layer, x, use_reentrant=False).float().square().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    assert any(key[1:3] == (256, 896) for key in layer.decisions.unmeasured_keys())
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer(x).float().square().sum().backward()
    assert any(key[1:3] == (256, 896) for key in layer.decisions.unmeasured_keys())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()
    assert measure_pending(layer) >= 1
    assert not any(key[1:3] == (256, 896) for key in layer.decisions.unmeasured_keys())


@pytest.mark.gpu
def test_gpu_decision_is_timed_once_per_m_bucket_and_never_under_hooks():
    """Jagged batches change M every step: one timing per power-of-two bucket of M; a first call
    inside a checkpoint is not timed (it runs fp8), the next plain call of that bucket is."""
    from torch.utils.checkpoint import checkpoint

    layer = LowPrecisionLinear(256, 640, recipe=Recipe(), device="cuda", dtype=torch.bfloat16)
    decisions = layer.decisions
    unmeasured_keys = decisions.unmeasured_keys

    def keys():
        return [key for key in decisions.measured if key[1:3] == (256, 640)]

    for m in (16384 + 128, 16384 + 1024, 30000 // 16 * 16):  # one bucket: 32768
        layer(torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()
    assert [key[-1] for key in keys()] == [32768]
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).float().square().sum().backward()
    assert [key[-1] for key in keys()] == [32768]
    assert any(key[1:3] == (256, 640) and key[-1] == 2048 for key in unmeasured_keys())
    layer(x).sum().backward()
    assert [key[-1] for key in keys()] == [32768, 2048]
    x = torch.randn(5000 // 16 * 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).float().square().sum().backward()
    assert any(key[1:3] == (256, 640) and key[-1] == 8192 for key in unmeasured_keys())
    assert decisions.measure_pending() == 1
    assert [key[-1] for key in keys()] == [32768, 2048, 8192] and not unmeasured_keys()


@pytest.mark.gpu
def test_gpu_decision_under_autocast_times_the_autocast_output():
    """A float32 input under BF16 autocast is timed as it runs: cast to BF16, fp8 with a BF16
    output against the BF16 linear autocast would run, not against a float32 GEMM."""
    layer = LowPrecisionLinear(256, 640, recipe=Recipe(), device="cuda")  # float32 weight
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(torch.randn(4096, 256, device="cuda"))
    assert y.dtype == torch.bfloat16
    keys = [key for key in layer.decisions.measured if key[1:3] == (256, 640)]
    assert [key[3:] for key in keys] == [(torch.bfloat16, torch.bfloat16, 4096)]


def test_under_autocast_a_float32_input_is_cast_first_as_nn_linear_casts_it():
    """The fp8 GEMM quantizes the autocast dtype, whatever the input's: a float32 input gives
    bit for bit what its BF16 rounding gives (and needs no float32 quantize kernel)."""
    torch.manual_seed(0)
    layer = LowPrecisionLinear(256, 128, recipe=Recipe())
    x = torch.randn(64, 256, requires_grad=True)
    x16 = x.detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y16 = layer(x), layer(x16)
    assert y.dtype == torch.bfloat16 and not layer.decisions.fallbacks  # fp8 ran
    torch.testing.assert_close(y, y16, rtol=0, atol=0)
    y.float().square().sum().backward()
    y16.float().square().sum().backward()
    torch.testing.assert_close(x.grad, x16.grad.float(), rtol=0, atol=0)


def test_measure_pending_times_what_was_met_under_hooks():
    """``measure_pending`` times each key met only where timing was not allowed, with the shape
    met, moves it to the measured decisions, and does nothing where timing is not allowed."""
    calls = []
    allowed = {"now": False}

    def measure(recipe, m, k, n, x_dtype, w_dtype, out_dtype, device):
        calls.append((m, k, n, x_dtype, w_dtype, out_dtype))
        return False, ""

    decisions = Fp8Decisions(measure=measure, timing_allowed=lambda x: allowed["now"])
    key = (Recipe(), 256, 640, torch.float32, torch.bfloat16, 8192)
    decisions.unmeasured[key] = (5000, torch.device("cpu"), torch.float32)
    assert decisions.measure_pending() == 0 and decisions.unmeasured_keys() == [key]
    allowed["now"] = True
    assert decisions.measure_pending() == 1
    # timed as met: float32 input, float32 weight, bf16 output (autocast)
    assert calls == [(5000, 256, 640, torch.float32, torch.float32, torch.bfloat16)]
    assert decisions.measured[key] == (False, "")
    assert decisions.unmeasured_keys() == [] and decisions.measure_pending() == 0


@pytest.mark.parametrize(
    "rounds, min_speedup, keeps_fp8",
    [
        # (bf16 ms, fp8 ms) per round, alternating bf16 then fp8
        ([(1.00, 0.90), (1.00, 0.90), (1.00, 0.90)], 1.02, True),
        ([(1.00, 0.99), (1.00, 0.99), (1.00, 0.99)], 1.02, False),  # within the margin: BF16
        ([(1.00, 0.99), (1.00, 0.99), (1.00, 0.99)], 1.0, True),
        ([(1.00, 0.50), (1.00, 1.20), (1.00, 1.10)], 1.02, False),  # one lucky round: median
        ([(1.00, 0.90), (3.00, 0.90), (1.00, 0.90)], 1.02, True),  # one slow BF16 round: median
    ],
)
def test_fp8_is_kept_only_when_its_median_beats_bf16_by_the_margin(rounds, min_speedup, keeps_fp8):
    """The one-time fp8-vs-BF16 decision alternates the two paths, compares medians and keeps
    fp8 only when it is ``min_speedup`` times faster: a tie, or one lucky round, keeps BF16."""
    script = iter(t for pair in rounds for t in pair)
    order = []

    def fake_time(fn, x, w, reps=5):
        order.append(fn)
        return next(script)

    recipe = Recipe(name="fp8_rowwise", fallback=FallbackConfig(min_speedup=min_speedup))
    keep, why = measure_fp8_against_bf16(
        recipe, 32, 64, 64, torch.float32, torch.float32, torch.float32, "cpu", timer=fake_time
    )
    assert keep is keeps_fp8
    assert len(order) == 6 and order[0] is not order[1] and order[0] is order[2]
    assert "median of 3" in why


def test_min_speedup_below_one_is_refused():
    with pytest.raises(ValueError, match="min_speedup must be a number >= 1.0"):
        FallbackConfig(min_speedup=0.9)


def test_benchmark_smoke_runs():
    """``bench_lowprec_linear.py --smoke``: every path of the G1 benchmark runs on the CPU."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks/lowprec/bench_lowprec_linear.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--sweep"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "G1 breakdown" in done.stdout and "graph speedup" in done.stdout
    for path in (
        "mxfp8 wgrad bf16",
        "mxfp8 wgrad fp8",
        "fp8_rowwise wgrad bf16",
        "fp8_rowwise wgrad fp8",
    ):
        assert f"| {path} " in done.stdout, path
    assert "launch-shape sweep" in done.stdout
