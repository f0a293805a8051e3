"""Shared pieces of the jagged attention benchmarks (JFA, GDPA, BlockAttention).

Every script times the project's op and its anchors on the same inputs, one forward or forward +
backward step at a time (``timed``), optionally as a CUDA-graph replay that removes the host's
launch cost. The anchors are built here once for all scripts:

- FlexAttention on the packed sequences ``[1, N, T, D]`` with a mask (document, + causal, + any
  extra condition such as same-block), the block mask built outside the timing, compiled on a GPU;
- SDPA on a padded batch ``[B, N, L, D]`` (padding outside the timing), with an optional boolean
  key-padding mask.

In ``--smoke`` mode (CPU, Triton interpreter) every figure is one call timed on the host
(``once``): the numbers are meaningless, the point is to run every line quickly. This module sits
beside the scripts; they import it as they import ``common``: the folder goes on ``sys.path``
(``sys.path.insert(0, str(Path(__file__).resolve().parent))``), then ``import attention_bench``.
"""

import dataclasses
import time

import common
import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lengths: np.ndarray  # per sequence; for PMA every entry is the seed count
    kv_lengths: np.ndarray
    causal: bool
    pma: bool = False
    heads: int = 4  # docs/workloads.md: J1–J5 4 heads of 128, J6 8 of 64, J7 4 of 64
    head_dim: int = 128

    def pairs(self) -> int:
        """Real (query, key) pairs: causal self-attention counts the lower triangle."""
        kv = None if self.causal else self.kv_lengths
        return common.attention_pairs(self.q_lengths, kv, causal=self.causal)


def device_and_dtype():
    """("cuda", bf16) on a GPU; ("cpu", fp16) through the Triton interpreter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, torch.bfloat16 if device == "cuda" else torch.float16


def setup(smoke: bool, heads: int, head_dim: int):
    """(device, dtype, heads, head_dim): bf16 on a GPU; fp16, 2 heads of 32 in smoke mode."""
    device, dtype = device_and_dtype()
    return (device, dtype, heads, head_dim) if not smoke else (device, dtype, 2, 32)


def make_inputs(w: Workload, device, dtype, heads, head_dim):
    """Packed ``q, k, v, grad_out`` ``[T, N, D]``; PMA's queries are one set of seeds."""
    gen = torch.Generator(device=device).manual_seed(0)
    tq = int(w.q_lengths[0]) if w.pma else int(w.q_lengths.sum())
    tk, tout = int(w.kv_lengths.sum()), int(w.q_lengths.sum())

    def rand(t):
        return torch.randn(t, heads, head_dim, device=device, dtype=dtype, generator=gen)

    return rand(tq), rand(tk), rand(tk), rand(tout)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def timed(fn, q, k, v, do, *, backward, bench, graph=False) -> float:
    """Median ms of a forward (or forward + backward) step of ``fn(q, k, v)``; ``graph`` times
    CUDA-graph replays of the step (warmed up on a side stream, then captured once)."""
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if not backward:

        def step():
            with torch.no_grad():
                fn(*leaves)

    else:

        def step():
            torch.autograd.grad(fn(*leaves), leaves, do)

    if graph:
        return bench(common.cuda_graph_of(step))
    return bench(step)


def once(fn) -> float:
    """Smoke mode: one call (the Triton interpreter is slow), timed on the host."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def try_once(fn) -> float:
    """``once`` for an anchor: NaN (and why) when it cannot run, e.g. Flex's backward on a CPU."""
    try:
        return once(fn)
    except Exception as exc:
        print(f"  anchor failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return float("nan")


def benches(smoke: bool, *, quick: bool = False):
    """(project bench, anchor bench): the project's failure stops the run, an anchor's does not.
    ``quick`` shortens the GPU's warm-up and repetitions (compilation dominates a quick run)."""
    if smoke:
        return once, try_once
    reps = dict(warmup_ms=10, rep_ms=40) if quick else {}

    def project(fn):
        return common.bench_ms(fn, **reps)

    def anchor(fn):
        return common.try_bench(fn, **reps)

    return project, anchor


def measure(fns, *, project, backward, bench, anchor_bench, graphed=()) -> dict[str, float]:
    """ms of every ``name: (fn, (q, k, v, do))``; on a GPU also ``"<name> (graph)"`` for each of
    ``graphed``. ``project`` names the entries whose failure must stop the run; an anchor that
    cannot run (or be captured in a graph) reads NaN."""
    ms = {}
    for name, (fn, args) in fns.items():
        measure_one = bench if name in project else anchor_bench
        ms[name] = timed(fn, *args, backward=backward, bench=measure_one)
    if torch.cuda.is_available():
        for name in graphed:
            fn, args = fns[name]
            try:
                ms[f"{name} (graph)"] = timed(
                    fn, *args, backward=backward, graph=True,
                    bench=bench if name in project else anchor_bench,
                )  # fmt: skip
            except Exception as exc:
                if name in project:
                    raise
                print(f"  {name} (graph) failed: {type(exc).__name__}: {str(exc)[:160]}")
                torch.cuda.synchronize()
                ms[f"{name} (graph)"] = float("nan")
    return ms


def ratio_rows(workload: str, label: str, ms: dict[str, float], flops: float, base: str):
    """Table rows ``[workload, pass, impl, ms, TFLOP/s, time / base time]``."""
    return [
        [workload, label, name, t, common.tflops(flops, t), t / ms[base]] for name, t in ms.items()
    ]


RATIO_HEADER = ["workload", "pass", "impl", "ms", "TFLOP/s"]


# ----------------------------------------------------------------------------------------------
# Anchors
# ----------------------------------------------------------------------------------------------


def doc_ids(lengths, device) -> torch.Tensor:
    """Sequence index of every packed token."""
    lengths = torch.as_tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def document_mask(q_lengths, kv_lengths, device, *, causal: bool):
    """Flex ``mask_mod``: same sequence (+ causal on packed indices, for self-attention)."""
    doc_q, doc_k = doc_ids(q_lengths, device), doc_ids(kv_lengths, device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return mask_mod


def flex_fn(mask_mod, total_q: int, total_kv: int, *, device, smoke: bool, prologue=None):
    """FlexAttention on packed ``[T, N, D]`` inputs; ``prologue(q, k, v)`` runs first (inside the
    timing: RoPE, PMA's seed repetition). Compiled on a GPU, eager in smoke mode."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(
        mask_mod, None, None, total_q, total_kv, device=device, _compile=not smoke
    )
    # Static shapes: each workload compiles once for its own sizes (a second size would
    # otherwise recompile with dynamic shapes, slower to build and to run).
    attend = flex_attention if smoke else torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v):
        if prologue is not None:
            q, k, v = prologue(q, k, v)
        out = attend(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=block_mask)
        return out.squeeze(0).transpose(0, 1)

    return fn


def pad_heads(x: torch.Tensor, lengths, device) -> torch.Tensor:
    """Packed ``[T, N, D]`` to padded ``[B, N, L, D]`` (``L`` the longest length, at least 1)."""
    length = int(max(np.max(lengths), 1))
    nested = torch.nested.nested_tensor_from_jagged(x, common.offsets_of(lengths, device))
    padded = nested.to_padded_tensor(0.0, output_size=(len(lengths), length, *x.shape[1:]))
    return padded.transpose(1, 2)


def key_padding_mask(kv_lengths, lk: int, device):
    """``[B, 1, 1, Lk]`` true on real keys; None when every sequence has ``lk`` keys."""
    if (np.asarray(kv_lengths) == lk).all():
        return None
    lengths = torch.as_tensor(kv_lengths, device=device)
    return (torch.arange(lk, device=device)[None, :] < lengths[:, None])[:, None, None, :]


def padded_sdpa_fn(*, causal: bool, key_mask=None):
    """Softmax SDPA on padded ``[B, N, L, D]``: the flash backend without a mask, otherwise a
    boolean mask (key padding, ∧ causal)."""

    def fn(q, k, v):
        if key_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        mask = key_mask
        if causal:
            lq, lk = q.shape[2], k.shape[2]
            mask = mask & torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return fn


# FlashAttention-4 (``flash-attn-4``, CuTe DSL; forward and backward on sm_90 and sm_100) is the
# strongest public softmax kernel on Hopper (docs/workloads.md). It is not a dependency of the
# project: where it is not installed the anchor reads NaN and says why, once.
_FA4_IMPORT_ERROR: list[str] = []


def fa4_varlen():
    """FlashAttention-4's ``flash_attn_varlen_func``, or None (and the reason, printed once)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # ImportError, or a CuTe DSL runtime that cannot load
        if not _FA4_IMPORT_ERROR:
            _FA4_IMPORT_ERROR.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            print(f"  FlashAttention-4 unavailable ({_FA4_IMPORT_ERROR[0]}); its columns read NaN")
        return None
    return flash_attn_varlen_func


def _cu_seqlens(lengths, device) -> torch.Tensor:
    return common.offsets_of(lengths, device).to(torch.int32)


def fa4_fn(w: Workload, device, *, scale: float | None = None):
    """FlashAttention-4 on the packed ``[T, N, D]`` tensors (``cu_seqlens`` int32, causal
    bottom-right aligned as the project's), or None where it is not installed or not a GPU."""
    varlen = fa4_varlen() if torch.cuda.is_available() and not w.pma else None
    if varlen is None:
        return None
    cu_q, cu_k = _cu_seqlens(w.q_lengths, device), _cu_seqlens(w.kv_lengths, device)
    max_q, max_k = int(max(np.max(w.q_lengths), 1)), int(max(np.max(w.kv_lengths), 1))

    def fn(q, k, v):
        out = varlen(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, causal=w.causal, softmax_scale=scale,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in some versions

    return fn


def torch_varlen_fn(w: Workload, device):
    """``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside PyTorch) on the packed
    tensors, or None where this PyTorch has no varlen attention or there is no GPU."""
    if not torch.cuda.is_available() or w.pma:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu_q, cu_k = _cu_seqlens(w.q_lengths, device), _cu_seqlens(w.kv_lengths, device)
    max_q, max_k = int(max(np.max(w.q_lengths), 1)), int(max(np.max(w.kv_lengths), 1))
    window = (-1, 0) if w.causal else (-1, -1)
    if w.causal and not np.array_equal(w.q_lengths, w.kv_lengths):
        return None  # its causal window is top-left aligned for Lq != Lk; the project's is not

    def fn(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window)

    return fn
