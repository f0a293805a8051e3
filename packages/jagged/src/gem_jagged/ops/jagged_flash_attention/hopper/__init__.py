"""Jagged flash attention on Hopper, written in Gluon (explicit layouts, asynchronous MMAs):
the work of ``triton/``'s forward, dK/dV and dQ kernels, from the same work lists, with the
same math, scheduled by hand (``forward.py``, ``backward.py``; this module chooses and launches).

Forward (one program per query tile and head, 2 per SM at head dim 128):

    Q tile [M, H]                        → shared memory, once (cp.async)
    K, V blocks [Nk, H]                  → a ring of NUM_STAGES slots (TMA, mbarriers)
    S₀ = Q K₀ᵀ, softmax → P₀
    for block j = 1, 2, …:
        Sⱼ = Q Kⱼᵀ          wgmma, async ┐ on the tensor cores together
        O += Pⱼ₋₁ Vⱼ₋₁      wgmma, async ┘ (Pⱼ₋₁ straight from registers)
        online softmax of Sⱼ → Pⱼ, α     while O += Pⱼ₋₁ Vⱼ₋₁ finishes
        O ·= α; refill block j − 1's slot
    O += Pₙ₋₁ Vₙ₋₁; O / l, and the log-sum-exp

Not done here, each measured slower or no faster (``docs/design/jagged_flash_attention.md``):
lazy rescaling of O (FlashAttention-4's), issuing Sⱼ₊₁ before Sⱼ's softmax (ptxas then
serializes every MMA, advisory C7514, which ``scripts/hopper_compile.py`` reports), and Q in
registers.

dK/dV (one program per key tile, query-range chunk and head):

    K, V tile [Nk, H]                    → shared memory, once (cp.async)
    for each query block [M, H] of the chunk, NUM_STAGES − 1 blocks ahead (TMA ring; its rows'
    log-sum-exp and δ by cp.async into a ring of their own):
        Sᵀ  = K Qᵀ          wgmma, async ┐ both issued before either is waited for
        dPᵀ = V dOᵀ         wgmma, async ┘
        Pᵀ  = exp2(Sᵀ · c − lse)          while dPᵀ is still on the tensor cores
        dV += Pᵀ dO         wgmma, async, Pᵀ straight from registers
        dSᵀ = Pᵀ ⊙ (dPᵀ − δ)              while dV's MMA runs
        dK += dSᵀ Q         wgmma, async, dSᵀ from registers

dQ (one program per query tile and head; it also stores δ = rowsum(dO ⊙ O) for dK/dV):

    Q, dO tile [M, H]                    → shared memory, once (cp.async); a Q tile as tall
                                           as a key block lands in the K ring's last slot
                                           and moves on to registers, and its O tile lands
                                           in the V ring's last slot for δ
    for each key block [Nk, H] up to the tile's last visible key (TMA ring, three slots):
        S  = Q Kᵀ, dP = dO Vᵀ   wgmma, async, both in flight
        P  = exp2(S · c − lse)            while dP is still on the tensor cores
        dS = P ⊙ (dP − δ)
        dQ += dS K          wgmma, async, dS from registers; it runs on while the next
                            block's S and dP are issued, and is waited for before its key
                            block's ring slot is refilled

Three ring slots give each K/V block two steps to arrive; with two, one step was too short and
the warps stalled at the ring's barrier (the dQ kernel's largest stall under Nsight Compute).
The third slot fits beside two programs per SM only because Q lives in registers (112 KB of
shared memory instead of 128). Taller query tiles (head dim 64: 128 rows on 8 warps over
64-key blocks) keep Q in shared memory: with Q in registers there, the head-dim-64 cases of
the GPU test against fp64 fail.

dQ stays a kernel of its own, recomputing S and dP: summing each block's dQ part from the dK/dV
kernel with float32 atomics instead (FlashAttention-2's way) is slower (at 64-key tiles, over a
gigabyte of atomic adds per long-history step).

Why second kernels: Triton keeps the tiles a program holds for its whole loop (K and V in
dK/dV, Q and dO in dQ) in registers next to the float32 accumulators and score tiles; its dK/dV
kernel sits at the 255-register limit with spills (``ptxas``, sm_90), and the compiler does not
overlap the exponentials with the MMAs. Here those tiles stay in shared memory, where ``wgmma``
reads its left operand (except dQ's Q tile, above), and the MMAs are issued asynchronously in
the order above. Programs small enough to run two per SM beat larger tiles; a third per SM
(32-key blocks, or a register cap) does not.

Launch order. Program ``pid`` takes work-list slot ``pid mod slots`` of head ``pid div slots``:
heads outermost, each head's tiles heaviest first. The programs running at any moment then
stream one head's rows (J1: 27 MB of K and V per head, against 50 MB of L2) instead of every
head's, and fewer of them miss in L2.

Sequence ends. The tile a program keeps (Q for the forward and dQ, K and V for dK/dV) arrives
by ``cp.async``, whose mask writes zeros for rows past the sequence's end. The streamed blocks
arrive by TMA (no per-element addresses in registers), and a block crossing the end holds the
next sequence's rows there. Their
scores are masked, but a row of Inf or NaN would still reach a product through a zero
probability, so those rows are zeroed in shared memory before any MMA reads them (V in the
forward; K and V in dQ; Q and dO in dK/dV). Rows past the end are never written.

Gluon compiles for the GPU only (no interpreter): the Triton launchers (``triton/``) use these
kernels on sm_90 for 2-byte inputs without a relative bias whose rows 16-byte copies and 32-bit
TMA coordinates can reach, where the config asks for them (``JaggedAttentionConfig``'s
``forward_impl``, ``dkdv_impl``, ``dq_impl`` = ``KernelImpl.GLUON_HOPPER``), and the Triton
kernels everywhere else. The GPU tests hold them to the tolerance rule against fp64 and compare
them with Triton's.

This module decides where the kernels run (``supported``) and imports no Gluon; ``launch.py``
holds the launchers and imports the kernels, so Gluon loads only where they run.
"""

import torch

HEAD_DIMS = (64, 128)
# Whether each device index is an sm_90 GPU: a fact of the hardware, asked once.
_HOPPER: dict[int, bool] = {}


def on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU (the answer remembered per device)."""
    if not t.is_cuda:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _HOPPER[index]


def supported(*rows_TNH: torch.Tensor, rel_bias: bool, rows: int, num_warps: int) -> bool:
    """Whether these kernels can take a pass over the token-major tensors ``rows_TNH`` (q, k,
    v, and the output and its gradient where read) on their device, with tiles of ``rows``
    rows (keys for dK/dV, queries for the forward and dQ) on ``num_warps`` warps (16 rows per
    warp: one wgmma slice each). The copies move 16-byte vectors, so every row must start
    16-byte aligned with a row stride the compiler can see is a multiple of 16 elements, and
    the TMA copies' 32-bit coordinates must reach every row."""
    q = rows_TNH[0]
    return (
        on_hopper(q)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in HEAD_DIMS
        and not rel_bias
        and rows == 16 * num_warps
        and all(tileable_rows(t) and tma_reachable(t) for t in rows_TNH)
    )


def tileable_rows(t: torch.Tensor) -> bool:
    """Whether every row of ``t [T, ...]`` starts 16-byte aligned at a row stride the compiler
    sees is a multiple of 16 elements (what the kernels' 16-byte copies need)."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def tma_reachable(t: torch.Tensor) -> bool:
    """Whether the TMA copies' 32-bit row coordinates reach every row of ``t [T, ...]`` and the
    ring's blocks past it (and there is a row at all)."""
    return 0 < t.shape[0] < 2**31 - 2**16
