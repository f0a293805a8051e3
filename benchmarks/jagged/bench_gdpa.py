"""GDPA on J1 (self, SiLU, causal), J3 (cross, 64 keys per sample), J4 (PMA, 32 seeds).

Useful TFLOP/s count only real (query, key) pairs (workloads.md): forward 4·N·D·pairs, forward +
backward 3.5× that. Anchors, measured in the same run (inputs padded or packed outside timing):

- ``padded act`` (J1): the same SiLU attention on a padded batch ``[B, N, L, D]`` under
  ``torch.compile`` (scores materialised, masked after the activation);
- ``padded SDPA``: softmax SDPA on the padded batch (flash backend where no mask is needed,
  otherwise a boolean key-padding mask);
- ``flex``: FlexAttention (softmax, compiled) on the packed sequences with a document mask;
- ``JFA`` (J1 only): this package's softmax jagged flash attention, the goal's yardstick.

Rows marked ``(graph)`` time CUDA-graph replays of the same step: the kernels alone, without
the host-side cost of building work lists and dispatching (what a compiled, graph-captured
training step pays). ``--quick`` keeps the rows the goals name (under a minute on an H200): on J1
everything above, on J3 and J4 GDPA beside padded SDPA (their goal's anchor), and drops the
host-overhead rows; ``--only J3 J4`` runs those workloads alone (a J1 run spends most of its time
compiling the anchors). ``--smoke`` runs tiny sizes on the CPU (Triton interpreter, eager anchors)
to catch errors fast; ``--sweep`` also times a few tile configurations of the project's kernels.
"""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_bench as ab  # noqa: E402
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from attention_bench import Workload  # noqa: E402
from gem_jagged import gdpa  # noqa: E402
from gem_jagged.batch import JaggedBatch  # noqa: E402
from gem_jagged.ops.gdpa import Regime, arch_of, tiles_for  # noqa: E402
from gem_jagged.ops.gdpa import triton as gdpa_kernels  # noqa: E402
from gem_jagged.prototype import gdpa as prototype_gdpa  # noqa: E402

HEADS, HEAD_DIM = 4, 128
CANDIDATES, SEEDS = 64, 32


def workloads(smoke: bool) -> list[Workload]:
    j1 = np.array([5, 40, 0, 17]) if smoke else common.workload_lengths("J1")
    cand, seeds = (8, 4) if smoke else (CANDIDATES, SEEDS)
    return [
        Workload("J1", j1, j1, True),
        Workload("J3", j1, np.full(len(j1), cand), False),
        Workload("J4", np.full(len(j1), seeds), j1, False, pma=True),
    ]


def project_fn(w, device, tiles=None, rel_bias_radius=None, heads=HEADS, work_list=None):
    """GDPA on ``w`` through the public op, or (sweep: ``tiles`` given) the launchers called
    directly with those tiles; ``work_list`` (``WorkListOptions``) sends J3/J4 to the
    prototype's work-list schedule instead of production's per-sequence one."""
    q_off = None if w.pma else common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)
    kv_arg = None if w.name == "J1" else kv_off  # J1 is self-attention
    if tiles is not None:  # sweep: call the launchers directly with the given tiles
        q_launch = kv_off if q_off is None else q_off
        batch = JaggedBatch.of_owned(q_launch, kv_off, max_len=None)
        forward, backward = gdpa_kernels.gdpa_forward, gdpa_kernels.gdpa_backward
        opts = dict(
            activation="silu", causal=w.causal, out_scale=1.0, broadcast_q=w.pma,
            rel_bias_NB=None, tiles=tiles, batch=batch,
        )  # fmt: skip
        if work_list is not None and kv_arg is not None:
            forward, backward = (
                prototype_gdpa.gdpa_forward_work_list,
                prototype_gdpa.gdpa_backward_work_list,
            )
            opts["options"] = work_list
        else:
            opts["is_cross"] = kv_arg is not None and not w.pma

        class Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                ctx.save_for_backward(q, k, v)
                return forward(q, k, v, q_launch, kv_off, scale=q.shape[-1] ** -0.5, **opts)

            @staticmethod
            def backward(ctx, do):
                q, k, v = ctx.saved_tensors
                dq, dk, dv, _ = backward(
                    do, q, k, v, q_launch, kv_off, scale=q.shape[-1] ** -0.5, **opts
                )
                return dq, dk, dv

        return Op.apply

    rel_bias = None
    if rel_bias_radius is not None:  # a learned relative bias; its gradient joins the backward
        gen = torch.Generator().manual_seed(0)
        rel_bias = torch.randn(heads, 2 * rel_bias_radius + 1, generator=gen) * 0.1
        rel_bias = rel_bias.to(device).requires_grad_()

    def fn(q, k, v):
        return gdpa(
            q, k, v, q_off, kv_arg, causal=w.causal, broadcast_q=w.pma, rel_bias=rel_bias,
            backend="triton",
        )  # fmt: skip

    return fn


def jfa_fn(w, device):
    try:
        from gem_jagged import jagged_flash_attention
    except ImportError as exc:
        print(f"  JFA not importable: {exc}")
        return None
    q_off = common.offsets_of(w.q_lengths, device)
    # the length hint JFA's own benchmark passes: without it this anchor replayed from a CUDA
    # graph in 1.48 ms on J1, against 1.23 there (H200, docs/history/performance.md, 2026-11-30)
    hint = int(w.q_lengths.max())

    def fn(q, k, v):
        return jagged_flash_attention(
            q, k, v, q_off, causal=w.causal, backend="triton", max_q_len=hint, max_kv_len=hint
        )

    return fn


def flex_fn(w, device, smoke):
    """FlexAttention with a document mask; PMA's seeds repeated once per sequence, as packed
    queries (inside the timing)."""
    mask = ab.document_mask(w.q_lengths, w.kv_lengths, device, causal=w.causal)
    batch = len(w.kv_lengths)

    def repeat_seeds(q, k, v):
        return q.repeat(batch, 1, 1), k, v

    total_q, total_kv = int(w.q_lengths.sum()), int(w.kv_lengths.sum())
    prologue = repeat_seeds if w.pma else None
    return ab.flex_fn(mask, total_q, total_kv, device=device, smoke=smoke, prologue=prologue)


def padded_inputs(w, q, k, v, do, device):
    """``[B, N, L, D]`` leaves and the key-padding mask ``[B, 1, 1, Lk]`` (None if all real)."""
    if w.pma:
        pq = q.unsqueeze(0).expand(len(w.kv_lengths), *q.shape).transpose(1, 2).contiguous()
    else:
        pq = ab.pad_heads(q, w.q_lengths, device)
    pk, pv = (ab.pad_heads(t, w.kv_lengths, device) for t in (k, v))
    pdo = ab.pad_heads(do, w.q_lengths, device)
    return pq, pk, pv, pdo, ab.key_padding_mask(w.kv_lengths, pk.shape[2], device)


def padded_act_fn(w, key_mask, smoke):
    def fn(q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        weights = F.silu(scores)
        mask = key_mask
        if w.causal:
            lq, lk = q.shape[2], k.shape[2]
            causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
            mask = causal if mask is None else mask & causal
        if mask is not None:
            weights = weights * mask
        return torch.matmul(weights.to(v.dtype), v)

    return fn if smoke else torch.compile(fn, dynamic=False)


def cross_fwd(base, m: int, warps: int, stages: int):
    """``base`` with the per-sequence cross-attention forward's own rows, warps and stages."""
    return dataclasses.replace(base, cross_fwd_m=m, cross_fwd_warps=warps, cross_fwd_stages=stages)


def cross_fwd_split(base, target: int):
    """``base`` with the per-sequence cross-attention forward aiming at ``target`` programs."""
    return dataclasses.replace(base, cross_fwd_split_target=target)


def forward_device_us(fn, q, k, v) -> float:
    """Device µs of the forward's kernels (profiler): J3's and J4's eager forward calls are
    host-bound, their kernels are not."""

    def step():
        with torch.no_grad():
            fn(q, k, v)

    return sum(us for _, us, _ in common.device_kernel_times(step, 10))


def sweep(device, dtype, smoke, only=()) -> None:
    """Tile configurations of the project's kernels, eager and (on a GPU) graph-replayed: the
    replay is the kernels' time, which an eager call of J3 or J4 hides behind its host cost."""
    heads, head_dim = (HEADS, HEAD_DIM) if not smoke else (2, 32)
    arch = arch_of(torch.device(device))
    base = tiles_for(arch=arch, dtype=dtype, head_dim=head_dim, regime=Regime.PLAIN)
    work_list = prototype_gdpa.work_list_options_for(arch=arch)
    variants = {
        "default": base,
        "fwd n128 w8 s2": dataclasses.replace(base, fwd_n=128, fwd_stages=2),
        "fwd m64 w4": dataclasses.replace(base, fwd_m=64, fwd_warps=4),
        "cross fwd 1024 programs (J3)": cross_fwd_split(base, 1024),
        "cross fwd 2048 programs (J3)": cross_fwd_split(base, 2048),
        "cross fwd 4096 programs, m64 w4 s2 (J3)": cross_fwd_split(cross_fwd(base, 64, 4, 2), 4096),
        "bwd dkdv m32 n128": dataclasses.replace(base, dkdv_m=32),
        "bwd dkdv m64 n64 w4": dataclasses.replace(base, dkdv_n=64, dkdv_warps=4),
        "bwd dkdv m128 n64 w8": dataclasses.replace(base, dkdv_m=128, dkdv_n=64),
        "bwd dq m128 n64 w8 (the default before)": dataclasses.replace(base, dq_m=128, dq_warps=8),
        "work-list schedule (prototype, J3/J4)": (base, work_list),
        "cross chunks >= 1 tile (J3)": dataclasses.replace(base, cross_min_part_tiles=1),
        "cross chunks >= 2 tiles (J3)": dataclasses.replace(base, cross_min_part_tiles=2),
        "cross chunks >= 8 tiles (J3)": dataclasses.replace(base, cross_min_part_tiles=8),
        "per-sequence 4096 programs (J3/J4)": dataclasses.replace(base, split_target=4096),
        "per-sequence split <= 2 (J3/J4)": dataclasses.replace(base, max_split=2),
        "per-sequence no split (J3/J4)": dataclasses.replace(base, max_split=1),
    }
    rows = []
    for w in workloads(smoke):
        if only and w.name not in only:
            continue
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        for name, variant in variants.items():
            tiles, schedule = variant if isinstance(variant, tuple) else (variant, None)
            fn = project_fn(w, device, tiles, work_list=schedule)
            fwd = common.try_bench(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
            both = ab.timed(fn, q, k, v, do, backward=True, bench=common.try_bench)
            graph = fwd_us = float("nan")
            if device == "cuda":
                graph = ab.timed(fn, q, k, v, do, backward=True, bench=common.try_bench, graph=True)
                fwd_us = forward_device_us(fn, q, k, v)
            rows.append([w.name, name, fwd, fwd_us, both, graph])
            print(
                f"  sweep {w.name} {name}: fwd {fwd:.4g} ms ({fwd_us:.4g} us of kernels), "
                f"fwd+bwd {both:.4g}, graph {graph:.4g} ms"
            )
    common.print_table(
        "GDPA tile sweep",
        ["workload", "tiles", "fwd ms", "fwd kernels us", "fwd+bwd ms", "fwd+bwd graph ms"],
        rows,
    )


def overhead(rows, w) -> None:
    """Host-side cost of one work-list build on J3 (eager, no kernel): part of every eager call."""
    from gem_jagged._checks import check_offsets
    from gem_jagged._worklist import key_tiles, query_tiles

    q_off, kv_off = common.offsets_of(w.q_lengths, "cuda"), common.offsets_of(w.kv_lengths, "cuda")
    total_q, total_kv = int(w.q_lengths.sum()), int(w.kv_lengths.sum())
    parts = {
        "query_tiles build": lambda: query_tiles(q_off, kv_off, total_q=total_q, block=128),
        "key_tiles build (split)": lambda: key_tiles(
            q_off, kv_off, total_kv=total_kv, block=128, align=64, split_rows=512, max_splits=16
        ),
        "check_offsets (host copy)": lambda: check_offsets(
            "q_offsets", q_off, validate_values=True
        ),
    }
    for name, fn in parts.items():
        rows.append([w.name, "host", name, common.try_bench(fn), float("nan"), float("nan")])


def measure_each(fns, workload, label, backward, bench, anchor_bench) -> dict[str, float]:
    """``ab.measure`` one entry at a time, each printed as soon as it is timed, so that a run cut
    short (compiling the anchors takes most of it) still shows the project's figures."""
    ms = {}
    for name, entry in fns.items():
        part = ab.measure(
            {name: entry}, project=("gdpa",), backward=backward, bench=bench,
            anchor_bench=anchor_bench,
            graphed=[name] if name in ("gdpa", "JFA", "padded SDPA") else [],
        )  # fmt: skip
        ms.update(part)
        timed = ", ".join(f"{n} {t:.4g} ms" for n, t in part.items())
        print(f"  {workload} {label}: {timed}", flush=True)
    return ms


def run(
    smoke: bool, do_sweep: bool, quick: bool, only: tuple[str, ...] = (), rel_bias_radius=None
) -> None:
    device, dtype, heads, head_dim = ab.setup(smoke, HEADS, HEAD_DIM)
    bench, anchor_bench = ab.benches(smoke, quick=quick)
    bias_note = "" if rel_bias_radius is None else f", gdpa with rel_bias R={rel_bias_radius}"
    print(f"# GDPA (SiLU), {common.environment()}, {dtype}, N={heads}, D={head_dim}{bias_note}")
    rows, headline = [], {}
    for w in workloads(smoke):
        if only and w.name not in only:
            continue
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        pq, pk, pv, pdo, key_mask = padded_inputs(w, q, k, v, do, device)
        padded_sdpa = ab.padded_sdpa_fn(causal=w.causal, key_mask=key_mask)
        fns = {
            "gdpa": (
                project_fn(w, device, rel_bias_radius=rel_bias_radius, heads=heads),
                (q, k, v, do),
            ),
            "padded SDPA": (padded_sdpa, (pq, pk, pv, pdo)),
        }
        if not quick or w.name == "J1":
            fns["flex"] = (flex_fn(w, device, smoke), (q, k, v, do))
        if w.name == "J1":  # the activation anchor of workloads.md and the goal's yardstick
            fns["padded act"] = (padded_act_fn(w, key_mask, smoke), (pq, pk, pv, pdo))
            jfa = jfa_fn(w, device)
            if jfa is not None:
                fns["JFA"] = (jfa, (q, k, v, do))
        for backward in (False, True):
            flops = common.attention_flops(
                w.pairs(), heads=heads, head_dim=head_dim, backward=backward
            )
            label = "fwd+bwd" if backward else "fwd"
            ms = measure_each(fns, w.name, label, backward, bench, anchor_bench)
            rows += ab.ratio_rows(w.name, label, ms, flops, "gdpa")
            common.record(
                "gdpa",
                workload=f"{w.name} {label}",
                ms=ms["gdpa"],
                tflops=common.tflops(flops, ms["gdpa"]),
                **{f"x_{n.replace(' ', '_')}": ms[n] / ms["gdpa"] for n in ms if n != "gdpa"},
                graph_ms=ms.get("gdpa (graph)", float("nan")),
            )
            if w.name in ("J3", "J4") and rel_bias_radius is None:  # the goal: 3x padded SDPA
                mine, theirs, basis = common.graphed_or_eager(ms, "gdpa", "padded SDPA")
                common.record_goal(
                    benchmark="gdpa",
                    goal="GDPA vs padded SDPA",
                    workload=f"{w.name} {label}",
                    gemkit=mine,
                    anchor="padded SDPA",
                    anchor_value=theirs,
                    ratio=theirs / mine,
                    unit="ms",
                    basis=basis,
                    target=3.0,
                )
            key = f"{w.name.lower()}_{'fwdbwd' if backward else 'fwd'}"
            for name in fns.keys() - {"gdpa"}:
                slug = name.lower().replace(" ", "_")
                headline[f"{key}_x_{slug}"] = ms[name] / ms["gdpa"]
                if "gdpa (graph)" in ms:  # graph against graph where the anchor has one
                    anchor = ms.get(f"{name} (graph)", ms[name])
                    headline[f"{key}_graph_x_{slug}"] = anchor / ms["gdpa (graph)"]
    if device == "cuda" and not quick and (not only or "J3" in only):
        overhead(rows, workloads(smoke)[1])
    common.print_table(
        f"GDPA useful TFLOP/s, {common.environment()}",
        [*ab.RATIO_HEADER, "time / gdpa time"],
        rows,
    )
    common.record("gdpa", workload="headline", **headline)
    if do_sweep:
        sweep(device, dtype, smoke, only)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configurations")
    parser.add_argument(
        "--quick", action="store_true", help="only the rows the goals name (< 1 min on an H200)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=("J1", "J3", "J4"), default=(), help="workloads to run"
    )
    parser.add_argument(
        "--rel-bias", type=common.radius, default=None, metavar="R",
        help="give the project's call a learned relative bias of radius R (anchors have none)",
    )  # fmt: skip
    args = parser.parse_args()
    run(args.smoke, args.sweep, args.quick, tuple(args.only), args.rel_bias)
