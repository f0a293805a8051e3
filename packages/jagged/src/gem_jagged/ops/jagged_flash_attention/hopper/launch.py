"""The Gluon kernels' launchers: TMA descriptors, shared-memory layouts and the launch arguments
of the forward, dQ and dK/dV kernels (``hopper/__init__.py`` decides when they run)."""

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import LOG2E
from .backward import _jfa_dkdv_hopper_kernel, _jfa_dq_hopper_kernel
from .forward import _jfa_fwd_hopper_kernel

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def _block_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a ``[rows, head_dim]`` block (made once per shape and dtype:
    building a layout costs host time at every launch otherwise)."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPES[dtype])


def row_descriptor(t: torch.Tensor, rows: int, memo: dict | None) -> TensorDescriptor:
    """A descriptor of ``t [T, N, H]`` as ``[T, N·H]``, blocks of ``rows`` rows × one head.

    ``memo`` (a dict, or None) hands back the descriptor made before for the same memory,
    shape, strides and block: a forward and its backward's dQ stream the same K and V blocks,
    and making one costs tens of microseconds of host time."""
    key = None
    if memo is not None:
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype, rows)
        if (hit := memo.get(key)) is not None:
            return hit
    layout = _block_layout(rows, t.shape[2], t.dtype)
    rows_2d = t.view(t.shape[0], t.shape[1] * t.shape[2])
    descriptor = TensorDescriptor(
        rows_2d, list(rows_2d.shape), list(rows_2d.stride()), [rows, t.shape[2]], layout
    )
    if memo is not None:
        memo[key] = descriptor
    return descriptor


def _launch_shape(tiles) -> tuple[int, int, int, int]:
    """``(block_m, block_n, warps, stages)`` of one kernel's ``TileShape``."""
    return tiles.block_m, tiles.block_n, tiles.warps, tiles.stages


def launch_forward(
    grid, q, k, v, out, lse, q_offsets, kv_offsets, work,
    *, scale, causal, config, descriptors=None,
):  # fmt: skip
    """Launch the forward kernel with the Triton launcher's arguments (q, k, v as
    ``_rows_of_heads`` leaves them; out contiguous), on ``config.forward``'s tiles.
    ``descriptors``: a memo of TMA descriptors (a dict) shared with the backward's launches, or
    None."""
    total_q, num_heads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages = _launch_shape(config.forward)
    args = (
        q, row_descriptor(k, block_n, descriptors), row_descriptor(v, block_n, descriptors),
        out, lse, q_offsets, kv_offsets, work.packed_5W,
        num_heads, total_q, scale * LOG2E.value, q.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        SCALE_SIGN=-1 if scale < 0 else 1, NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    _jfa_fwd_hopper_kernel[grid](*args, **constexprs)


def launch_dq(
    grid, q, k, v, out, dout, lse, delta, dq, q_offsets, kv_offsets, qwork,
    *, scale, causal, config, descriptors=None,
):  # fmt: skip
    """Launch the dQ kernel with the Triton launcher's arguments (q, k, v as
    ``_rows_of_heads`` leaves them; out and dout contiguous), on ``config.dq``'s tiles; it
    fills ``delta`` as well."""
    total_q, num_heads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages = _launch_shape(config.dq)
    args = (
        q, row_descriptor(k, block_n, descriptors), row_descriptor(v, block_n, descriptors),
        out, dout, lse, delta, dq, q_offsets, kv_offsets, qwork.packed_5W,
        num_heads, total_q, scale, scale * LOG2E.value, q.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    _jfa_dq_hopper_kernel[grid](*args, **constexprs)


def launch_dkdv(
    grid, q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch, q_offsets, kv_offsets, kwork,
    *, scale, causal, config, descriptors=None,
):  # fmt: skip
    """Launch the dK/dV kernel with the Triton launcher's arguments (q, k, v as
    ``_rows_of_heads`` leaves them; dout contiguous), on ``config.dkdv``'s tiles."""
    total_q, num_heads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages = _launch_shape(config.dkdv)
    args = (
        row_descriptor(q, block_m, descriptors), k, v, row_descriptor(dout, block_m, descriptors),
        lse, delta, dk, dv, dk_scratch, dv_scratch, q_offsets, kv_offsets, kwork.packed_5W,
        num_heads, total_q, scale, scale * LOG2E.value, k.stride(0),
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    _jfa_dkdv_hopper_kernel[grid](*args, **constexprs)
