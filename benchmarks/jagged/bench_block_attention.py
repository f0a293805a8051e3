"""BlockAttention on J5: J2's lengths, causal 64-token blocks from each sequence start, RoPE.

Useful FLOPs count only real pairs inside blocks (a block of ``l`` tokens has ``l(l+1)/2`` causal
pairs): forward 4·N·D·pairs, forward + backward 3.5× that. RoPE (theta 10000, half-split) is part
of the op; the anchors apply it outside, compiled, positions from each sequence start:

- ``flex``: FlexAttention (compiled) on the packed sequence with a document ∧ same-block ∧
  causal block mask, built once outside the timing;
- ``padded SDPA``: the sequences padded to a multiple of 64 and cut into ``[blocks, N, 64, D]``,
  causal SDPA (flash backend) over the blocks as a batch (padding outside the timing).

The ``(graph)`` row times CUDA-graph replays of the project's step (kernels without host-side
launch cost). ``--smoke`` runs tiny sizes on the CPU (Triton interpreter, eager anchors) to catch
errors fast.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths_t = torch.as_tensor(lengths, device=device)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
    pos = positions_of(lengths, device)

    def mask_mod(b, h, q_idx, kv_idx):
        same_block = (doc[q_idx] == doc[kv_idx]) & (pos[q_idx] // block == pos[kv_idx] // block)
        return same_block & (q_idx >= kv_idx)

    mask = create_block_mask(
        mask_mod, None, None, len(doc), len(doc), device=device, _compile=not smoke
    )
    attend = flex_attention if smoke else torch.compile(flex_attention)
    rotate = rope if smoke else torch.compile(rope)

    def fn(q, k, v):
        q, k = rotate(q, pos), rotate(k, pos)
        out = attend(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=mask)
        return out.squeeze(0).transpose(0, 1)

    return fn


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


def timed(fn, q, k, v, do, *, backward, bench, graph=False):
    """Median ms of a forward (or forward + backward) step; ``graph`` times CUDA-graph replays."""
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if not backward:

        def step():
            with torch.no_grad():
                fn(*leaves)

    else:

        def step():
            torch.autograd.grad(fn(*leaves), leaves, do)

    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        return bench(cuda_graph.replay)
    return bench(step)


def run(smoke: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    heads, head_dim, block = (HEADS, HEAD_DIM, BLOCK) if not smoke else (2, 32, 16)
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
    rows = []
    for backward in (False, True):
        flops = common.attention_flops(pairs, heads=heads, head_dim=head_dim, backward=backward)
        ms = {}
        for name, (fn, args) in fns.items():
            measure = common.bench_ms if name == "block_attention" else common.try_bench
            ms[name] = timed(fn, *args, backward=backward, bench=measure)
        if device == "cuda":
            ms["block_attention (graph)"] = timed(
                project, q, k, v, do, backward=backward, bench=common.try_bench, graph=True
            )
        label = "fwd+bwd" if backward else "fwd"
        base = ms["block_attention"]
        for name, t in ms.items():
            rows.append(["J5", label, name, t, common.tflops(flops, t), t / base])
        common.record(
            "block_attention",
            workload=f"J5 {label}",
            ms=base,
            tflops=common.tflops(flops, base),
            x_flex=ms["flex+rope"] / base,
            x_padded_sdpa=ms["padded SDPA+rope"] / base,
        )
    common.print_table(
        f"BlockAttention (64-token causal blocks, RoPE) useful TFLOP/s, {common.environment()}",
        ["workload", "pass", "impl", "ms", "TFLOP/s", "time / block_attention time"],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    run(parser.parse_args().smoke)
