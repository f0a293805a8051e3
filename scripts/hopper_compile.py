"""Compile the project's Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton compiles ahead of time for any target it knows, and its wheel ships ``ptxas``. This script
swaps in a driver that reports an sm_90 device, turns every launch into a compile-only warm-up,
runs the ops' launchers on CPU tensors (with the GPU tile configs and code paths, such as the
low-precision kernels' hardware fp8 conversion, not the interpreter's), and prints each kernel's
registers per thread, spilled bytes and shared memory as ``ptxas -v`` reports them, and whether
``ptxas`` serialized the kernel's asynchronous MMAs (its advisory C7514: each ``wgmma`` then
waits for the one before, which undoes a hand-written pipeline; a Gluon forward that issued
the next block's scores before the softmax ran 1.29-1.37x slower for it, docs/history/performance.md,
2026-12-02, nineteenth session). A kernel that does not compile for sm_90 fails here, without
device time.

The numbers are this machine's Triton's: the GPU image may run another version, whose code
generation differs. They are a guide to register pressure (spills), not a measurement of speed.

    python scripts/hopper_compile.py              # every op
    python scripts/hopper_compile.py --ops jfa    # some of them

Exits 1 when a kernel fails to compile.
"""

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile
import traceback
from contextlib import contextmanager

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("hopper_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime.driver import driver as active_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SM_COUNT = 132  # H200


class _OfflineHopper(CudaDriver):
    """Answers what compiling asks of a driver; needs no CUDA runtime."""

    def __init__(self):
        pass

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return HOPPER

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextmanager
def compile_only():
    """Every kernel launch compiles for sm_90 and returns; yields ``[(name, kernel)]``."""
    compiled = []
    do_compile, run = JITFunction._do_compile, JITFunction.run

    def recording_compile(self, *args, **kwargs):
        kernel = do_compile(self, *args, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    def warm_up_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    previous = active_driver._active  # None until something asked; no default exists here
    active_driver.set_active(_OfflineHopper())
    JITFunction._do_compile, JITFunction.run = recording_compile, warm_up_only
    try:
        yield compiled
    finally:
        JITFunction._do_compile, JITFunction.run = do_compile, run
        active_driver._active = previous


class _Patches:
    """Attributes set for the duration of a ``with``, restored after."""

    def __init__(self, *patches):
        self.patches = patches  # (object, attribute name, value)

    def __enter__(self):
        self.saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self.patches]
        for obj, name, value in self.patches:
            setattr(obj, name, value)

    def __exit__(self, *exc):
        for obj, name, value in self.saved:
            setattr(obj, name, value)


def gpu_configs() -> _Patches:
    """The ops pick tiles and code paths by device type; have them pick the GPU's."""
    from gem_jagged import _checks
    from gem_jagged.ops.jagged_flash_attention import hopper

    properties = type("Properties", (), {"multi_processor_count": SM_COUNT})()
    return _Patches(
        (hopper, "on_hopper", lambda t: True),  # the rest of hopper.supported as it is
        (torch.cuda, "get_device_properties", lambda device=None: properties),
        # The offline driver compiles launches on CPU tensors, which the ops' check (a CUDA
        # device or Triton's interpreter) would refuse.
        (_checks, "check_triton_runs", lambda device: None),
    )


# ptxas's advisory when it makes every wgmma of a kernel wait for the previous one
WGMMA_SERIALIZED = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.*?) in the function"
)


def ptxas_usage(kernel) -> dict:
    """Registers, spill bytes (stores, loads), shared bytes and why its wgmmas were serialized
    (None if they were not) of one compiled kernel."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    text = report.stdout + report.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    serialized = WGMMA_SERIALIZED.search(text)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "shared": kernel.metadata.shared,
        "wgmma_serialized": serialized.group(1).strip() if serialized else None,
    }


def _jagged_batch(lengths, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    return q, k, v, offsets


def _attention(call):
    """A run of ``call(q, k, v, offsets)`` forward and backward on a J1-like bf16 batch."""

    def run():
        q, k, v, offsets = _jagged_batch([700, 300, 1500, 64], 4, 128, torch.bfloat16)
        q.requires_grad_()
        call(q, k, v, offsets).sum().backward()

    return run


def _jfa_config(q, k, offsets, *, rel_bias: bool, gluon: bool = False):
    """The sm_90 config of these inputs (the launchers are handed it, as a model on an H200
    gets it); ``gluon``: every kernel asks for its Gluon twin."""
    from gem_jagged.ops.jagged_flash_attention.config import KernelImpl, config_for, regime_for

    config = config_for(
        arch="sm90", dtype=q.dtype, head_dim=q.shape[2],
        regime=regime_for(total_kv=k.shape[0], num_seqs=offsets.numel() - 1), rel_bias=rel_bias,
    )  # fmt: skip
    if gluon:
        impl = KernelImpl.GLUON_HOPPER
        config = dataclasses.replace(config, forward_impl=impl, dkdv_impl=impl, dq_impl=impl)
    return config


def _jfa(q, k, v, offsets, *, rel_bias: bool, gluon: bool = False):
    from gem_jagged import jagged_flash_attention

    bias = torch.randn(4, 65, requires_grad=True) if rel_bias else None
    config = _jfa_config(q, k, offsets, rel_bias=rel_bias, gluon=gluon)
    return jagged_flash_attention(
        q, k, v, offsets, causal=True, rel_bias=bias, backend="triton", config=config
    )


def _jfa_cross(q, k, v, offsets):
    """J3-like: the batch's queries over 64 candidate keys per sequence (the short-keys table,
    whose dK/dV kernel also writes dQ)."""
    from gem_jagged import jagged_flash_attention

    batch = offsets.numel() - 1
    k, v = k[: 64 * batch], v[: 64 * batch]
    kv_offsets = torch.arange(batch + 1, dtype=offsets.dtype) * 64
    config = _jfa_config(q, k, offsets, rel_bias=False)
    return jagged_flash_attention(q, k, v, offsets, kv_offsets, backend="triton", config=config)


def _jfa_hopper():
    """The plain path with configs asking for the Gluon kernels, over long keys (the long
    regime's dK/dV tiles) and short ones (64-key tiles)."""
    from gem_jagged import jagged_flash_attention

    def run():
        for head_dim in (64, 128):
            q, k, v, offsets = _jagged_batch([700, 300, 1500, 64], 4, head_dim, torch.bfloat16)
            q.requires_grad_()
            _jfa(q, k, v, offsets, rel_bias=False, gluon=True).sum().backward()
        k, v = k[:256], v[:256]
        kv_offsets = torch.arange(5, dtype=offsets.dtype) * 64
        config = _jfa_config(q, k, offsets, rel_bias=False, gluon=True)
        jagged_flash_attention(
            q, k, v, offsets, kv_offsets, backend="triton", config=config
        ).sum().backward()

    return run


def _gdpa_tiles(q, rel_bias):
    """The GPU's GDPA tiles (and sigmoid form) for q, asked for explicitly."""
    from gem_jagged.ops.gdpa import regime_for, tiles_for

    regime = regime_for(rel_bias_NB=rel_bias)
    return tiles_for(arch="cuda", dtype=q.dtype, head_dim=q.shape[2], regime=regime)


def _gdpa(q, k, v, offsets, *, rel_bias: bool):
    from gem_jagged import gdpa

    bias = torch.randn(4, 65, requires_grad=True) if rel_bias else None
    return gdpa(
        q, k, v, offsets, activation="silu", causal=True, rel_bias=bias, backend="triton",
        tiles=_gdpa_tiles(q, bias),
    )  # fmt: skip


def _gdpa_cross(q, k, v, offsets):
    """J3-like: the batch's queries over 64 candidate keys per sequence (k, v cut to fit)."""
    from gem_jagged import gdpa

    batch = offsets.numel() - 1
    kv_offsets = torch.arange(batch + 1, dtype=offsets.dtype) * 64
    return gdpa(
        q, k[: 64 * batch], v[: 64 * batch], offsets, kv_offsets, backend="triton",
        tiles=_gdpa_tiles(q, None),
    )  # fmt: skip


def _block_attention(q, k, v, offsets):
    from gem_jagged import block_attention

    return block_attention(q, k, v, offsets, rope_theta=10000.0, backend="triton")


def _swiglu():
    from gem_lowprec.ops.swiglu.triton import swiglu_backward_triton, swiglu_forward_triton

    def run():
        u = torch.randn(4100, 2 * 2816, dtype=torch.bfloat16)
        swiglu_backward_triton(u, swiglu_forward_triton(u))

    return run


def _lowprec():
    """The low-precision launchers with the GPU's launch shapes, hardware fp8 cast and SM count
    asked for explicitly (``Launch``), on CPU tensors."""
    from gem_lowprec.codec import E4M3, E5M2
    from gem_lowprec.ops.fp8_cast import triton as fp8_cast
    from gem_lowprec.ops.fp8_cast import triton_columns as fp8_columns
    from gem_lowprec.ops.launch import Launch
    from gem_lowprec.ops.mx_quantize import triton as mx
    from gem_lowprec.ops.mx_quantize import triton_k128 as mx_k128
    from gem_lowprec.ops.rmsnorm_mx.triton import rmsnorm_mx

    gpu = Launch(shapes="gpu", encoder="hardware", sm_count=SM_COUNT)
    layouts = (dict(rows=True, cols=True, tile_2d=False), dict(rows=True, cols=False, tile_2d=True))

    def run():
        x = torch.randn(4096, 1024, dtype=torch.bfloat16)
        mult = torch.rand(4096)
        for fmt in (E4M3, E5M2):
            fp8_cast.cast_rows(x, fmt, transposed=True, col_amax_row_mult=None, launch=gpu)
            fp8_cast.cast_rows(x, fmt, transposed=False, col_amax_row_mult=mult, launch=gpu)
            fp8_columns.cast_both(x, fmt, launch=gpu)
            amax = fp8_columns.column_amax(x, mult, launch=gpu)
            fp8_columns.cast_columns(x, fmt, row_mult=mult, col_amax=amax, launch=gpu)
            mx_k128.mx_rowcol_k128(x, fmt, scale_mode="rceil", launch=gpu)
            mx_k128.mx_quantize_merged_k128(x, fmt, scale_mode="rceil", launch=gpu)
            for layout in layouts:
                mx.mx_quantize(x, fmt, **layout, scale_mode="rceil", seed=None, launch=gpu)
            mx.mx_quantize(
                x, fmt, rows=True, cols=False, tile_2d=False, scale_mode="floor", seed=3, launch=gpu
            )
            rmsnorm_mx(x, torch.ones(1024), 1e-6, fmt, "rceil", launch=gpu)
        for cols in (4096, 8192):  # the rows cast's wide launch and whole-row column amax
            wide = torch.randn(512, cols, dtype=torch.bfloat16)
            fp8_cast.cast_rows(wide, E4M3, transposed=False, col_amax_row_mult=None, launch=gpu)
            fp8_cast.cast_rows(
                wide, E4M3, transposed=False, col_amax_row_mult=mult[:512], launch=gpu
            )

    return run


OPS = {
    "jfa": _attention(functools.partial(_jfa, rel_bias=False)),
    "jfa_bias": _attention(functools.partial(_jfa, rel_bias=True)),
    "jfa_cross": _attention(_jfa_cross),
    "jfa_hopper": _jfa_hopper(),
    "gdpa": _attention(functools.partial(_gdpa, rel_bias=False)),
    "gdpa_bias": _attention(functools.partial(_gdpa, rel_bias=True)),
    "gdpa_cross": _attention(_gdpa_cross),
    "block_attention": _attention(_block_attention),
    "swiglu": _swiglu(),
    "lowprec": _lowprec(),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=sorted(OPS), default=sorted(OPS))
    args = parser.parse_args(argv)
    rows, failed = [], []
    for name in args.ops:
        print(f"compiling {name} for sm_90 ...", flush=True)
        try:
            with compile_only() as compiled, gpu_configs():
                OPS[name]()
        except Exception:  # a compile failure is the result here, not a crash
            failed.append(name)
            trace = traceback.format_exc().strip().splitlines()
            print("  FAILED:\n    " + "\n    ".join(trace[-25:]), flush=True)
            continue
        for kernel_name, kernel in compiled:
            rows.append((name, kernel_name, ptxas_usage(kernel)))
    print(f"\ntriton {triton.__version__}, target sm_90a")
    print(
        "| op | kernel | registers | spill stores / loads (bytes) | shared (bytes) "
        "| wgmma serialized |"
    )
    print("|---|---|---|---|---|---|")
    for op, kernel_name, use in rows:
        spills = f"{use['spill_stores']} / {use['spill_loads']}"
        serialized = "yes" if use["wgmma_serialized"] else "no"
        print(
            f"| {op} | {kernel_name} | {use['registers']} | {spills} | {use['shared']} "
            f"| {serialized} |"
        )
    for op, kernel_name, use in rows:
        if use["wgmma_serialized"]:
            print(f"{op} {kernel_name}: wgmma serialized ({use['wgmma_serialized']})")
    if failed:
        print(f"\nfailed to compile: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
