"""Jagged flash attention in Triton: forward, and backward split into a dQ and a dK/dV kernel.

Files: ``common.py`` (jit helpers and host helpers the kernels share), ``forward.py``,
``dkdv.py`` (the dK/dV kernel, its finishing kernel and the split rule), ``dq.py`` (the dQ
kernel and the bias gradient), ``backward.py`` (the backward's order of launches),
``token_tiles.py`` (the three kernels of ``Schedule.TOKEN_TILES``, tiles of consecutive tokens
across sequences). Each kernel sits beside its launcher.

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).

Forward (one program per (query tile, head), heaviest tiles first, see ``gem_jagged._worklist``)
    The classic online softmax: the query tile stays in registers while key/value blocks stream
    past; running max ``m``, running sum ``l`` and the output accumulator are rescaled as the max
    grows. Scores live in the log2 domain (``scale · log2 e`` is folded into one multiply, so the
    exponentials are ``exp2``). Key blocks wholly below the causal diagonal run without any mask;
    only the blocks crossing the diagonal or the end of the sequence pay for masking, and blocks
    wholly above it are never visited. The (natural) log-sum-exp of each row is saved for
    the backward pass; a row that sees no key saves ``+inf`` and outputs zeros. Where the
    config says so (``KeyLoads.TMA``) and the layout allows, K and V blocks arrive through TMA
    descriptors over the packed ``[Tk, N·H]`` rows (the copy engine fills shared memory; no
    per-element addresses in registers); a sequence's last block then reads into the next
    sequence's rows, which the masked step zeroes like the pointer loads' mask does.

Backward, dK/dV kernel (one program per (key tile, query-range chunk, head))
    Keeps a key/value tile in registers and streams the query blocks that can see it, rebuilding
    ``Pᵀ = exp2(K Qᵀ · c − lse)`` from the saved log-sum-exp and accumulating ``dV += Pᵀ dO`` and
    ``dK += dSᵀ Q`` with ``dS = P ⊙ (dP − δ)``, ``δ = rowsum(dO ⊙ O)``. The key tiles of a long
    sequence see thousands of query rows; the work list splits that query range into chunks so
    one 20k-token sequence spreads over many programs. Chunks of a split tile add their partial
    dK/dV into a float32 scratch with atomics and count their arrival; the last to arrive casts
    the sums into dK/dV (no finishing launch). Unsplit tiles store directly.

    Short keys (candidates: the short-keys config's ``DqPlacement.IN_DKDV``, no bias). A sequence of
    at most ``BLOCK_N`` keys is one key tile, so its program sees every key of the query rows
    it streams: it computes their ``δ`` from the output block and stores ``dQ = dS K`` too, from
    the ``dS`` it has anyway. The backward of such a batch is one launch instead of three (dQ,
    dK/dV, finish), and ``QKᵀ`` and ``dO Vᵀ`` are computed once instead of twice. The dQ kernel
    still serves the sequences with no keys or more than a tile's, and is not launched when
    the offsets' host check has shown there are none.

Backward, dQ kernel (one program per (query tile, head), a query work list like the forward's)
    Runs first. It computes ``δ`` of its rows from the output tile and ``dO``, which it holds
    anyway, and stores it for the dK/dV kernel (no separate launch, no second pass over ``O``
    and ``dO``). Then it mirrors the forward loop: ``dQ += dS K``. It also owns the
    relative-bias gradient: each program reduces ``dS`` of its tiles by diagonal into its own
    row of a partial buffer, and one sum over the rows finishes it. No per-element atomics, and
    no two programs ever add into the same address. The interior diagonals (|j − i| < R) a tile
    crosses are read out of the ``dS`` tile skewed (``tl.gather``: row r, column c holds
    diagonal d0 + c), so that one column sum per diagonal gives them all, ``dq_diag_chunk``
    diagonals per read (masking the tile once per diagonal instead made the dQ kernel at R = 32
    do 63 full-tile reductions on every tile crossing the band). The right edge bucket (j − i ≥
    R) takes one masked sum of a tile that reaches it, which a causal self-attention tile never
    does. The left edge bucket (j − i ≤ −R, the bulk of a long causal sequence) costs nothing:
    every row of dS sums to zero (``Σ_j P_ij (dP_ij − δ_i) = δ_i − δ_i Σ_j P_ij``), so the
    whole gradient does, and bucket 0 is minus the sum of the others (one op after the sum of
    the partial rows).

Relative bias. The bias of a pair depends on ``clamp(j − i, −R, R)``: every pair of a tile lying
wholly left of the band (``j − i < −R`` for all of it, the bulk of a long causal sequence) takes
the same bucket 0. Such tiles add one scalar to the scores, and the dQ kernel does no bias work
on them at all (bucket 0's gradient comes from the zero row sums of dS, above). A tile crossing
the band loads its bias as a plain tile from ``relative_bias_tiles`` (``bias_tiles.py``: the
bias of every tile offset that is not constant, laid out per kernel geometry), one coalesced
load like a key tile's, instead of computing and gathering a bucket per score.

On Hopper the config can hand each of the three kernels to a Gluon twin (``hopper/``:
the same work lists and math, scheduled by hand with asynchronous ``wgmma`` and the tiles a
program keeps in shared memory instead of registers); it does so at head dim 128 without a bias.
The launchers below choose. The Triton kernels remain what the interpreter runs, the fallback
off Hopper and for rows the Gluon copies cannot tile, and the relative-bias and short-keys
paths.

Tile shapes and code paths come from the ``JaggedAttentionConfig`` every launcher takes
(``config.py``: how ``config_for`` picks one per arch, dtype, head dim, regime and bias).

Host cost. A forward + backward step of a small batch is over in a few hundred microseconds of
device time, so what the host does per call matters: the work lists are kept in the batch's
``JaggedBatch`` (built once per batch, shared by its layers), the forward's query list is handed to the
backward, and the dK/dV split (with its zeroed float32 scratch) is only used when the longest
sequence would otherwise be the tail of the launch (``dkdv_splits``). Q, K and V
are read where they lie as long as each token's heads are dense (the views of a fused QKV
projection are): the kernels take their row strides instead of a contiguous copy of each.
"""

from .backward import jfa_backward
from .common import _rows_of_heads, _tma_ready
from .dkdv import _jfa_dkdv_kernel, backward_dkdv, dkdv_splits, longest_query_rows
from .dq import _jfa_dq_kernel, backward_dq
from .forward import _jfa_fwd_kernel, forward_work_slots, jfa_forward

__all__ = [
    "_jfa_dkdv_kernel",
    "_jfa_dq_kernel",
    "_jfa_fwd_kernel",
    "_rows_of_heads",
    "_tma_ready",
    "backward_dkdv",
    "backward_dq",
    "dkdv_splits",
    "forward_work_slots",
    "jfa_backward",
    "jfa_forward",
    "longest_query_rows",
]
