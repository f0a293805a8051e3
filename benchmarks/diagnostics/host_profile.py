"""Where the host time of an eager call goes: Python-level profiles of the calls that were
measured host-bound (docs/history/performance.md, 2026-11-29).

Several goals were missed only in eager mode: a GDPA cross-attention (J3) or PMA (J4)
forward + backward took 0.94 / 0.64 ms eager against 0.37 / 0.19 ms of device time, the fused
RMSNorm + MX quantize (Q3) 100 µs against a 31 µs kernel, and the fp8 linears of G1 took
0.3–0.5 ms longer eager than their kernels' sum. A launch of an empty Triton kernel
costs 11–35 µs of host time on the H200 host, which does not add up to those figures. For each
call this script prints:

- ``host us``: wall time of back-to-back calls without a sync, per call (what issuing costs);
- ``wall us``: the same calls including the final sync (about max(host, device));
- the functions with the most own time under ``cProfile`` (per call), which names the Python
  that the time goes to (Triton's launcher, argument binding, tensor construction, ...);

and, for one kernel, a launch through ``kernel[grid](...)`` against one through the
``CompiledKernel`` that launch returned (``compiled[grid](*args)``), which skips argument
binding and the cache-key computation. ``--smoke`` runs tiny sizes on the CPU (interpreter;
the numbers mean nothing there).

On the GPU the attention group also profiles J1's step compiled with ``torch.compile``, whose
graph calls the custom ops: it was measured host-bound in PyTorch's custom-op and AOT wrappers
(docs/history/performance.md, 2026-12-02), and a last table splits its host time into the ops'
implementations and the rest (``custom_op_share``).
"""

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jagged"))
import attention_bench as ab  # noqa: E402
import bench_gdpa  # noqa: E402
import common  # noqa: E402
import triton  # noqa: E402
from gem_jagged import JaggedBatch, jagged_flash_attention  # noqa: E402
from gem_lowprec import LowPrecisionLinear, rmsnorm_to_mx, to_mx, to_mx_2d  # noqa: E402
from gem_lowprec.recipes import FallbackConfig, Recipe, WeightGradConfig  # noqa: E402


def top_functions(step, calls: int, count: int) -> list[str]:
    """The ``count`` functions with the most own time per call, as printable lines."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    common.sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    lines = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}" if line else path
        lines.append(
            f"  {tottime / calls * 1e6:8.1f} own  {cumtime / calls * 1e6:8.1f} cum  "
            f"x{ncalls / calls:<5.3g} {name} ({where[-60:]})"
        )
    return lines


COMPILED_J1 = "JFA J1 fwd+bwd, torch.compile"


def attention_steps(smoke: bool):
    device, dtype, heads, head_dim = ab.setup(smoke, 4, 128)
    workloads = {w.name: w for w in bench_gdpa.workloads(smoke)}
    steps = {}
    for name in ("J3", "J4"):
        w = workloads[name]
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        fn = bench_gdpa.project_fn(w, device, heads=heads)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        steps[f"GDPA {name} fwd+bwd"] = lambda fn=fn, leaves=leaves, do=do: torch.autograd.grad(
            fn(*leaves), leaves, do
        )
    w = workloads["J3"]
    q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
    q_off, kv_off = (common.offsets_of(x, device) for x in (w.q_lengths, w.kv_lengths))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def jfa_step():
        out = jagged_flash_attention(*leaves, q_off, kv_off, backend="triton")
        return torch.autograd.grad(out, leaves, do)

    def jfa_forward():
        with torch.no_grad():
            return jagged_flash_attention(*leaves, q_off, kv_off, backend="triton")

    steps["JFA J3 fwd+bwd"] = jfa_step
    steps["JFA J3 fwd"] = jfa_forward
    # J1: causal self-attention over long histories (on Hopper, the Gluon kernels' launches)
    w = workloads["J1"]
    q1, k1, v1, do1 = ab.make_inputs(w, device, dtype, heads, head_dim)
    off1 = common.offsets_of(w.q_lengths, device)
    leaves1 = [t.detach().requires_grad_() for t in (q1, k1, v1)]

    def jfa_j1_step():
        out = jagged_flash_attention(*leaves1, off1, causal=True, backend="triton")
        return torch.autograd.grad(out, leaves1, do1)

    def jfa_j1_forward():
        with torch.no_grad():
            return jagged_flash_attention(*leaves1, off1, causal=True, backend="triton")

    steps["JFA J1 fwd+bwd"] = jfa_j1_step
    steps["JFA J1 fwd"] = jfa_j1_forward
    batch1 = JaggedBatch(off1)  # a model's way: checks and work lists once per batch

    def jfa_j1_prebuilt_step():
        out = jagged_flash_attention(*leaves1, batch1, causal=True, backend="triton")
        return torch.autograd.grad(out, leaves1, do1)

    steps["JFA J1 fwd+bwd, prebuilt JaggedBatch"] = jfa_j1_prebuilt_step
    if not smoke:  # (compiling under the interpreter would only slow the smoke test down)
        compiled = torch.compile(
            lambda q, k, v: jagged_flash_attention(q, k, v, off1, causal=True, backend="triton"),
            fullgraph=True,
        )  # fmt: skip
        steps[COMPILED_J1] = lambda: torch.autograd.grad(compiled(*leaves1), leaves1, do1)

    def empty_step():
        return torch.autograd.grad(_EmptyAttention.apply(*leaves1), leaves1, do1)

    steps["autograd floor: empty Function, J1 fwd+bwd"] = empty_step
    return steps


def custom_op_share(step, calls: int) -> dict[str, float]:
    """Host µs per call of ``step`` (e.g. a compiled step, whose graph calls the JFA custom
    ops), of it the µs inside each op's implementation, and that implementation called
    directly with the op's last arguments. What is left of the step is PyTorch's (the compiled
    graph's runtime, autograd, the dispatcher). Where the implementation takes longer inside
    the step than called directly, the same Python runs slower there: on torch 2.11 any Python
    inside a compiled region ran about 1.7x slower, a toy op's loop too (docs/history/performance.md,
    2026-12-02, eighteenth and nineteenth sessions)."""
    from gem_jagged.ops.jagged_flash_attention import _op

    spent: dict[str, float] = {}
    last_call: dict[str, tuple] = {}
    patched = []
    for name, op in (
        ("forward op", _op.attention_forward),
        ("backward op", _op.attention_backward),
    ):
        for device_type, fn in list(op._backend_fns.items()):

            def timed(*args, _fn=fn, _name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start
                    last_call[_name] = (_fn, args, kwargs)

            op._backend_fns[device_type] = timed
            patched.append((op._backend_fns, device_type, fn))
    try:
        step()
        common.sync()
        spent.clear()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        result = {"step": (time.perf_counter() - start) / calls * 1e6}
        common.sync()
    finally:
        for fns, device_type, fn in patched:
            fns[device_type] = fn
    for name, seconds in spent.items():
        fn, args, kwargs = last_call[name]
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        result[f"{name}, inside the step"] = seconds / calls * 1e6
        result[f"{name}, called directly"] = (time.perf_counter() - start) / calls * 1e6
        common.sync()
    return result


class _EmptyAttention(torch.autograd.Function):
    """What PyTorch alone costs an eager attention step: ``apply``, the autograd engine and the
    output and gradient allocations of ``q, k, v -> out``, with no kernel and no check."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        return tuple(torch.empty_like(dout) for _ in range(3))


def quantize_steps(smoke: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q1 = torch.randn((64, 256) if smoke else (16384, 8192), device=device, dtype=torch.bfloat16)
    q3 = torch.randn((64, 256) if smoke else (32768, 1024), device=device, dtype=torch.bfloat16)
    weight = torch.ones(q3.shape[1], device=device, dtype=torch.bfloat16)
    return {
        "Q1 to_mx": lambda: to_mx(q1, backend="triton"),
        "Q2 to_mx_2d": lambda: to_mx_2d(q1, backend="triton"),
        "Q3 rmsnorm_to_mx": lambda: rmsnorm_to_mx(q3, weight, backend="triton"),
    }


def linear_steps(smoke: bool):
    """G1's 1024 -> 4096 linear, forward + backward: BF16 and the fp8 recipes (no fallback)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, k, n = (128, 128, 256) if smoke else (32768, 1024, 4096)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    steps = {}
    for name, wgrad in (("bf16", "bf16"), ("fp8_rowwise", "fp8"), ("mxfp8", "bf16")):
        recipe = Recipe(
            name=name,
            weight_grad=WeightGradConfig(wgrad),
            fallback=FallbackConfig(measure_on_gpu=False),
        )
        mod = LowPrecisionLinear(k, n, bias=False, recipe=recipe, device=device, dtype=x.dtype)
        steps[f"G1 {name} wgrad {wgrad} fwd+bwd"] = lambda mod=mod: mod(x).backward(dy)
    return steps


def launch_paths(smoke: bool, calls: int) -> list[list]:
    """Host us of one kernel launched through the JIT function and through its CompiledKernel."""
    from gem_lowprec.codec import elem_format
    from gem_lowprec.ops.rmsnorm_mx import triton as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, n = (64, 256) if smoke else (32768, 1024)
    x = torch.randn(m, n, device=device, dtype=torch.bfloat16).view(torch.int16)
    w = torch.ones(n, device=device, dtype=torch.bfloat16).view(torch.int16)
    data = torch.empty(m, n, device=device, dtype=torch.uint8)
    scale = torch.empty(m, n // 32, device=device, dtype=torch.uint8)
    y = torch.empty(0, device=device, dtype=torch.float32)
    block_m = kernels.GPU_TILES.block_m(n)
    grid = (triton.cdiv(m, block_m), 1, 1)
    constexprs = dict(
        BLOCK_M=block_m, NB=n // 32, RCEIL=True, HW_CONVERT=False, IN_BF16=True, W_BF16=True,
        STORE_Y=False, WIDE_INDEX=False, **elem_format(torch.float8_e4m3fn).kernel_constants,
    )  # fmt: skip
    args = (x, w, data, scale, y, m, n, 1e-6)

    def jit_launch():
        return kernels.rmsnorm_mx_kernel[grid](*args, **constexprs, num_warps=4)

    compiled = jit_launch()
    rows = [["kernel[grid](...)", *common.host_and_wall_us(jit_launch, calls)]]
    if compiled is not None and hasattr(compiled, "run"):  # not under the interpreter
        bound = [*args, *constexprs.values()]
        runner = compiled[grid]
        rows.append(
            ["CompiledKernel[grid](*args)", *common.host_and_wall_us(lambda: runner(*bound), calls)]
        )
    rows.append(
        [
            "torch.empty(1024)",
            *common.host_and_wall_us(lambda: torch.empty(1024, device=device), calls),
        ]
    )
    return rows


def run(smoke: bool, top: int, only: str) -> None:
    calls = 2 if smoke else 50
    print(f"# host profile, {common.environment()}")
    hook = getattr(getattr(triton, "knobs", None), "runtime", None)
    print(
        f"triton {triton.__version__}, launch_enter_hook = {getattr(hook, 'launch_enter_hook', None)}"
    )
    rows = []
    groups = {"attention": attention_steps, "quantize": quantize_steps, "linear": linear_steps}
    steps = {}
    for group, make in groups.items():
        if not only or only == group:
            steps.update(make(smoke))
    for name, step in steps.items():
        host, wall = common.host_and_wall_us(step, calls)
        rows.append([name, host, wall])
        print(f"\n{name}: host {host:.0f} us, wall {wall:.0f} us per call; own time per call:")
        print("\n".join(top_functions(step, calls, top)), flush=True)
        common.record("host_profile", call=name, host_us=host, wall_us=wall)
    common.print_table(
        "eager calls: host vs wall (us per call)", ["call", "host us", "wall us"], rows
    )
    compiled = steps.get(COMPILED_J1)
    if compiled is not None:
        share = custom_op_share(compiled, calls)
        common.print_table(
            f"{COMPILED_J1}: host us per step, and inside the custom ops' implementations",
            ["what", "host us"],
            [[what, us] for what, us in share.items()],
        )
    common.print_table(
        "one kernel (rmsnorm_mx), launch paths (us per call)",
        ["path", "host us", "wall us"],
        launch_paths(smoke, calls * 4),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--top", type=common.positive_int, default=14, help="functions listed per call"
    )
    parser.add_argument(
        "--only", choices=("attention", "quantize", "linear"), default="", help="one group"
    )
    args = parser.parse_args()
    run(args.smoke, args.top, args.only)
