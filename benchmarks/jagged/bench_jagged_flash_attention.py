"""Jagged flash attention on J1, J2, J3 against FlexAttention, padded SDPA and nested-jagged SDPA.

Useful TFLOP/s count only real (query, key) pairs (workloads.md): forward 4·N·D·pairs, forward +
backward 3.5× that. J1 and J2 are causal self-attention over user histories; J3 is jagged queries
(J1's lengths) over 64 candidate keys per sample, not causal. Anchors, measured in the same run:

- FlexAttention (compiled) on the packed sequence with a document mask (+ causal), the block mask
  built once outside the timing;
- SDPA (flash backend) on a padded batch ``[B, N, Lmax, D]``, timing the attention only (padding
  and unpadding not counted, which flatters the anchor);
- SDPA on nested jagged tensors (``torch.nested`` layout ``jagged``) where it runs.

The project is timed twice: called eagerly (the public function validates the offsets' values
on the host, one device-to-host copy per call) and inside ``torch.compile(fullgraph=True)``
(validation is skipped while tracing, as in a compiled model, so no host synchronisation
remains); the ratios use the compiled figure, the anchors being compiled too. A third figure
replays the project's step as a CUDA graph (the op is capturable: no host synchronisation), which
removes the host's launch overhead and shows what the kernels themselves sustain.

``--smoke`` runs tiny sizes on the CPU (Triton interpreter, eager anchors) to catch errors fast;
``--sweep`` also times a few kernel configurations of the project's kernel on J1 and J2.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gem_jagged import jagged_flash_attention  # noqa: E402
from gem_jagged.ops.jagged_flash_attention import _op  # noqa: E402

HEADS, HEAD_DIM = 4, 128
CANDIDATES = 64  # J3: keys per sample


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lengths: np.ndarray
    kv_lengths: np.ndarray
    causal: bool


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        lengths = np.array([5, 20, 0, 9])
        return [
            Workload("J1", lengths, lengths, True),
            Workload("J3", lengths, np.full(4, 8), False),
        ]
    j1, j2 = common.workload_lengths("J1"), common.workload_lengths("J2")
    return [
        Workload("J1", j1, j1, True),
        Workload("J2", j2, j2, True),
        Workload("J3", j1, np.full(len(j1), CANDIDATES), False),
    ]


def make_inputs(w: Workload, device, dtype, heads, head_dim):
    gen = torch.Generator(device=device).manual_seed(0)
    tq, tk = int(w.q_lengths.sum()), int(w.kv_lengths.sum())

    def rand(t):
        return torch.randn(t, heads, head_dim, device=device, dtype=dtype, generator=gen)

    return rand(tq), rand(tk), rand(tk), rand(tq)


def project_fn(w, q, k, v, device):
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)
    hints = dict(max_q_len=int(w.q_lengths.max()), max_kv_len=int(w.kv_lengths.max()))
    backend = "triton"

    def fn(q, k, v):
        return jagged_flash_attention(
            q, k, v, q_off, kv_off, causal=w.causal, backend=backend, **hints
        )

    return fn


def flex_fn(w, q, k, v, device, smoke):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_q = torch.repeat_interleave(
        torch.arange(len(w.q_lengths), device=device), torch.as_tensor(w.q_lengths, device=device)
    )
    doc_k = torch.repeat_interleave(
        torch.arange(len(w.kv_lengths), device=device), torch.as_tensor(w.kv_lengths, device=device)
    )
    causal = w.causal

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(
        mask_mod, None, None, len(doc_q), len(doc_k), device=device, _compile=not smoke
    )
    attend = flex_attention if smoke else torch.compile(flex_attention)

    def fn(q, k, v):
        out = attend(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask)
        return out.squeeze(0).transpose(0, 1)

    return fn


def padded_fn(w, device):
    """Attention on padded ``[B, N, L, D]`` tensors (built outside the timing)."""
    lq, lk = int(w.q_lengths.max()), int(w.kv_lengths.max())

    def pad(x, lengths, length):
        return torch.nested.nested_tensor_from_jagged(
            x, common.offsets_of(lengths, device)
        ).to_padded_tensor(0.0, output_size=(len(lengths), length, *x.shape[1:]))

    def prepare(q, k, v, do):
        return (
            pad(q, w.q_lengths, lq).transpose(1, 2).detach().requires_grad_(),
            pad(k, w.kv_lengths, lk).transpose(1, 2).detach().requires_grad_(),
            pad(v, w.kv_lengths, lk).transpose(1, 2).detach().requires_grad_(),
            pad(do, w.q_lengths, lq).transpose(1, 2),
        )

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=w.causal)

    return prepare, fn


def nested_fn(w, device):
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)

    def fn(q, k, v):
        qn = torch.nested.nested_tensor_from_jagged(q, q_off).transpose(1, 2)
        kn = torch.nested.nested_tensor_from_jagged(k, kv_off).transpose(1, 2)
        vn = torch.nested.nested_tensor_from_jagged(v, kv_off).transpose(1, 2)
        return (
            F.scaled_dot_product_attention(qn, kn, vn, is_causal=w.causal).transpose(1, 2).values()
        )

    return fn


def timed(fn, q, k, v, do, *, backward, bench, graphed=False):
    """Time one forward (or forward + backward) step; ``graphed`` replays it as a CUDA graph."""
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if not backward:

        def step():
            with torch.no_grad():
                fn(*leaves)

    else:

        def step():
            torch.autograd.grad(fn(*leaves), leaves, do)

    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return bench(graph.replay)
    return bench(step)


def _once(fn) -> float:
    """Smoke mode: one call (the Triton interpreter is slow), timed on the host."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _anchor_bench(smoke: bool):
    if not smoke:
        return common.try_bench

    def once(fn):
        try:
            return _once(fn)
        except Exception as exc:
            print(f"  anchor failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            return float("nan")

    return once


ANCHORS = ("flex", "padded", "nested")


def run(smoke: bool, sweep: bool, project_only: bool = False) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    heads, head_dim = (HEADS, HEAD_DIM) if not smoke else (2, 32)
    bench = common.bench_ms if not smoke else _once
    print(f"# jagged flash attention, {common.environment()}, {dtype}, N={heads}, D={head_dim}")
    rows = []
    for w in workloads(smoke):
        q, k, v, do = make_inputs(w, device, dtype, heads, head_dim)
        pairs = common.attention_pairs(
            w.q_lengths, w.kv_lengths if not w.causal else None, causal=w.causal
        )
        project = project_fn(w, q, k, v, device)
        fns = {"project": (project, (q, k, v, do))}
        if not smoke:  # smoke mode leaves compilation to the test suite's compile test
            fns["compiled"] = (torch.compile(project, fullgraph=True), (q, k, v, do))
        if not project_only:
            padded_prepare, padded = padded_fn(w, device)
            fns["flex"] = (flex_fn(w, q, k, v, device, smoke), (q, k, v, do))
            fns["padded"] = (padded, padded_prepare(q, k, v, do))
            fns["nested"] = (nested_fn(w, device), (q, k, v, do))
        for backward in (False, True):
            flops = common.attention_flops(pairs, heads=heads, head_dim=head_dim, backward=backward)
            ms = dict.fromkeys((*ANCHORS, "compiled"), float("nan"))
            for name, (fn, args) in fns.items():
                measure = bench if name in ("project", "compiled") else _anchor_bench(smoke)
                ms[name] = timed(fn, *args, backward=backward, bench=measure)
            if device == "cuda":
                ms["graphed"] = timed(
                    project, q, k, v, do, backward=backward, bench=bench, graphed=True
                )
            else:
                ms["graphed"] = float("nan")
            tf = {n: common.tflops(flops, t) for n, t in ms.items()}  # noqa: B023
            label = "fwd+bwd" if backward else "fwd"
            best = ms["compiled"]
            rows.append(
                [w.name, label, ms["project"], tf["project"], best, tf["compiled"],
                 tf["graphed"], tf["flex"], tf["padded"], tf["nested"], ms["flex"] / best,
                 ms["padded"] / best, ms["nested"] / best, ms["flex"] / ms["graphed"]]
            )  # fmt: skip
            common.record(
                "jagged_flash_attention",
                workload=f"{w.name} {label}",
                tflops=tf["compiled"],
                tflops_eager=tf["project"],
                tflops_graphed=tf["graphed"],
                x_flex=ms["flex"] / best,
                x_padded=ms["padded"] / best,
            )
        del fns, q, k, v, do
    common.print_table(
        f"jagged flash attention, useful TFLOP/s ({common.environment()})",
        ["workload", "pass", "eager ms", "eager", "compiled ms", "compiled", "graphed", "flex",
         "padded SDPA", "nested SDPA", "x flex", "x padded", "x nested", "graphed x flex"],
        rows,
    )  # fmt: skip
    if sweep and device == "cuda":
        run_sweep(dtype)


def run_sweep(dtype) -> None:
    """Time a few kernel configurations of the project's kernel (J1, J2 forward and fwd+bwd)."""
    from gem_jagged.ops.jagged_flash_attention import triton as jfa_triton

    base = jfa_triton._GPU_CONFIGS[HEAD_DIM]
    variants = {
        "default": base,
        "fwd w4": dataclasses.replace(base, fwd_warps=4),
        "dkdv s3": dataclasses.replace(base, dkdv_stages=3),
        "dkdv n64 w4": dataclasses.replace(base, dkdv_block_n=64, dkdv_warps=4),
        "dkdv n64 w8 s3": dataclasses.replace(base, dkdv_block_n=64, dkdv_stages=3),
        "dq n32 s3": dataclasses.replace(base, dq_block_n=32, dq_stages=3),
        "dq m64 w4 s3": dataclasses.replace(base, dq_block_m=64, dq_warps=4, dq_stages=3),
        "no split": dataclasses.replace(base, max_splits=1),
    }
    rows = []
    for w in workloads(False):
        q, k, v, do = make_inputs(w, "cuda", dtype, HEADS, HEAD_DIM)
        pairs = common.attention_pairs(
            w.q_lengths, w.kv_lengths if not w.causal else None, causal=w.causal
        )
        flops_f, flops_b = (
            common.attention_flops(pairs, heads=HEADS, head_dim=HEAD_DIM, backward=b)
            for b in (False, True)
        )
        q_off = common.offsets_of(w.q_lengths, "cuda")
        kv_off = common.offsets_of(w.kv_lengths, "cuda")
        max_len = int(w.q_lengths.max())

        def unchecked(q, k, v, q_off=q_off, kv_off=kv_off, max_len=max_len, causal=w.causal):
            """The custom op without the public function's host-side offset validation."""
            scale = HEAD_DIM**-0.5
            return _op.attention_forward(
                q, k, v, q_off, kv_off, None, causal, scale, max_len, "triton"
            )[0]

        for name, cfg in variants.items():
            jfa_triton._GPU_CONFIGS[HEAD_DIM] = cfg
            fn = unchecked
            try:
                t_f = timed(fn, q, k, v, do, backward=False, bench=common.bench_ms)
                t_b = timed(fn, q, k, v, do, backward=True, bench=common.bench_ms)
            except Exception as exc:  # a config that does not compile must not stop the sweep
                print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                t_f = t_b = float("nan")
            rows.append(
                [w.name, name, t_f, common.tflops(flops_f, t_f), t_b - t_f, t_b,
                 common.tflops(flops_b, t_b)]
            )  # fmt: skip
        jfa_triton._GPU_CONFIGS[HEAD_DIM] = base
        print_kernel_profile(w.name, unchecked, q, k, v, do)
    common.print_table(
        "kernel config sweep (project only, custom op called without the host-side offset check)",
        ["workload", "config", "fwd ms", "fwd TFLOP/s", "bwd ms", "fwd+bwd ms", "fwd+bwd TFLOP/s"],
        rows,
    )


def print_kernel_profile(name, fn, q, k, v, do) -> None:
    """Device time per kernel over 5 forward+backward steps (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(fn(*leaves), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(fn(*leaves), leaves, do)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0.0))
    print(f"\n{name}: device time per step by kernel (us)")
    for e in events[:8]:
        print(
            f"  {getattr(e, 'device_time_total', 0.0) / 5:9.1f}  x{e.count // 5:<3d} {e.key[:90]}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    parser.add_argument("--project-only", action="store_true", help="skip the anchors (quick)")
    args = parser.parse_args()
    run(args.smoke, args.sweep, args.project_only)
