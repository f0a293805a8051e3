"""BlockAttention on J5: J2's lengths, causal 64-token blocks from each sequence start, RoPE.

Useful FLOPs count only real pairs inside blocks (a block of ``l`` tokens has ``l(l+1)/2`` causal
pairs): forward 4·N·D·pairs, forward + backward 3.5× that. RoPE (theta 10000, half-split) is part
of the op; the anchors apply it outside, compiled, positions from each sequence start:

- ``flex``: FlexAttention (compiled) on the packed sequence with a document ∧ same-block ∧
  causal block mask, built once outside the timing;
- ``padded SDPA``: the sequences padded to a multiple of 64 and cut into ``[blocks, N, 64, D]``,
  causal SDPA (flash backend) over the blocks as a batch (padding outside the timing).

The ``(graph)`` row times CUDA-graph replays of the project's step (kernels without host-side
launch cost). The full run is already only the goal's rows, so ``--quick`` keeps every row and
only shortens the timing loops (under a minute on an H200, compilation being most of it).
``--smoke`` runs tiny sizes on the CPU (Triton interpreter, eager anchors) to catch errors fast.
"""

import argparse
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
from gem_jagged import block_attention  # noqa: E402

HEADS, HEAD_DIM, BLOCK, THETA = 4, 128, 64, 10000.0


def block_pairs(lengths: np.ndarray, block: int) -> int:
    full, rest = lengths // block, lengths % block
    return int((full * (block * (block + 1) // 2) + rest * (rest + 1) // 2).sum())


def positions_of(lengths, device) -> torch.Tensor:
    return torch.cat([torch.arange(int(n), device=device) for n in lengths])


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of ``x [T, N, H]`` at positions ``pos [T]`` (fp32 math)."""
    half = x.shape[-1] // 2
    inv_freq = THETA ** (
        -torch.arange(half, device=x.device, dtype=torch.float32) * 2 / x.shape[-1]
    )
    angle = pos.to(torch.float32)[:, None, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def flex_fn(lengths, device, smoke, block):
    """Document ∧ same-block ∧ causal mask; RoPE (compiled) applied to q and k inside the timing."""
    doc, pos = ab.doc_ids(lengths, device), positions_of(lengths, device)

    def mask_mod(b, h, q_idx, kv_idx):
        same_block = (doc[q_idx] == doc[kv_idx]) & (pos[q_idx] // block == pos[kv_idx] // block)
        return same_block & (q_idx >= kv_idx)

    rotate = rope if smoke else torch.compile(rope)

    def rotate_qk(q, k, v):
        return rotate(q, pos), rotate(k, pos), v

    total = len(doc)
    return ab.flex_fn(mask_mod, total, total, device=device, smoke=smoke, prologue=rotate_qk)


def padded_blocks_fn(lengths, device, smoke, block):
    """Inputs padded per sequence to whole blocks, as ``[blocks, N, block, D]`` (built outside)."""
    padded = ((lengths + block - 1) // block) * block
    pos = positions_of(padded, device)
    rotate = rope if smoke else torch.compile(rope)

    bounds = np.concatenate([[0], np.cumsum(lengths)])

    def pad(x):
        return torch.cat(
            [
                F.pad(x[int(a) : int(b)], (0, 0, 0, 0, 0, int(n - (b - a))))
                for a, b, n in zip(bounds[:-1], bounds[1:], padded, strict=True)
            ]
        )

    def to_blocks(x):
        return x.reshape(-1, block, *x.shape[1:]).transpose(1, 2)

    def fn(q, k, v):
        q, k = rotate(q, pos), rotate(k, pos)
        out = F.scaled_dot_product_attention(
            to_blocks(q), to_blocks(k), to_blocks(v), is_causal=True
        )
        return out

    return pad, to_blocks, fn


def run(smoke: bool, quick: bool) -> None:
    device, dtype, heads, head_dim = ab.setup(smoke, HEADS, HEAD_DIM)
    block = BLOCK if not smoke else 16
    bench, anchor_bench = ab.benches(smoke, quick=quick)
    lengths = np.array([5, 40, 0, 17]) if smoke else common.workload_lengths("J5")
    print(f"# BlockAttention + RoPE, {common.environment()}, {dtype}, N={heads}, D={head_dim}")
    gen = torch.Generator(device=device).manual_seed(0)
    total = int(lengths.sum())
    q, k, v, do = (
        torch.randn(total, heads, head_dim, device=device, dtype=dtype, generator=gen)
        for _ in range(4)
    )
    offsets = common.offsets_of(lengths, device)

    def project(q, k, v):
        return block_attention(
            q, k, v, offsets, block_size=block, causal=True, rope_theta=THETA, backend="triton"
        )

    pad, to_blocks, padded = padded_blocks_fn(lengths, device, smoke, block)
    pq, pk, pv = pad(q), pad(k), pad(v)
    pdo = to_blocks(pad(do))
    fns = {
        "block_attention": (project, (q, k, v, do)),
        "flex+rope": (flex_fn(lengths, device, smoke, block), (q, k, v, do)),
        "padded SDPA+rope": (padded, (pq, pk, pv, pdo)),
    }
    pairs = block_pairs(lengths, block)
    rows, headline = [], {}
    for backward in (False, True):
        flops = common.attention_flops(pairs, heads=heads, head_dim=head_dim, backward=backward)
        label = "fwd+bwd" if backward else "fwd"
        ms = {}
        for name, entry in fns.items():  # one at a time, printed at once: a cut run still shows
            part = ab.measure(
                {name: entry}, project=("block_attention",), backward=backward, bench=bench,
                anchor_bench=anchor_bench,
                graphed=("block_attention",) if name == "block_attention" else (),
            )  # fmt: skip
            ms.update(part)
            timed = ", ".join(f"{n} {t:.4g} ms" for n, t in part.items())
            print(f"  J5 {label}: {timed}", flush=True)
        base = ms["block_attention"]
        rows += ab.ratio_rows("J5", label, ms, flops, "block_attention")
        common.record(
            "block_attention",
            workload=f"J5 {label}",
            ms=base,
            tflops=common.tflops(flops, base),
            x_flex=ms["flex+rope"] / base,
            x_padded_sdpa=ms["padded SDPA+rope"] / base,
        )
        # the goal: 1.5x FlexAttention with a block mask and RoPE outside (eager: Flex is not
        # replayed here)
        mine, theirs, basis = common.graphed_or_eager(ms, "block_attention", "flex+rope")
        common.record_goal(
            benchmark="block_attention",
            goal="BlockAttention vs FlexAttention",
            workload=f"J5 {label}",
            gemkit=mine,
            anchor="FlexAttention (block mask) + RoPE",
            anchor_value=theirs,
            ratio=theirs / mine,
            unit="ms",
            basis=basis,
            target=1.5,
        )
        key = f"j5_{'fwdbwd' if backward else 'fwd'}"
        for name, slug in (("flex+rope", "flex"), ("padded SDPA+rope", "padded_sdpa")):
            headline[f"{key}_x_{slug}"] = ms[name] / base
            if "block_attention (graph)" in ms:
                headline[f"{key}_graph_x_{slug}"] = ms[name] / ms["block_attention (graph)"]
    common.print_table(
        f"BlockAttention (64-token causal blocks, RoPE) useful TFLOP/s, {common.environment()}",
        [*ab.RATIO_HEADER, "time / block_attention time"],
        rows,
    )
    common.record("block_attention", workload="headline", **headline)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--quick", action="store_true", help="shorter timing loops (< 1 min on an H200)"
    )
    args = parser.parse_args()
    run(args.smoke, args.quick)
