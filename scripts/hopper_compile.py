"""Compile the attention and SwiGLU kernels for Hopper (sm_90) on a machine without a GPU.

Triton compiles ahead of time for any target it knows, and its wheel ships ``ptxas``. This script
swaps in a driver that reports an sm_90 device, turns every launch into a compile-only warm-up,
runs the ops' launchers on CPU tensors (with the GPU tile configs, not the interpreter's), and
prints each kernel's registers per thread, spilled bytes and shared memory as ``ptxas -v``
reports them. A kernel that does not compile for sm_90 fails here, without device time.

The numbers are this machine's Triton's: the GPU image may run another version, whose code
generation differs. They are a guide to register pressure (spills), not a measurement of speed.

    python scripts/hopper_compile.py              # every op
    python scripts/hopper_compile.py --ops jfa    # some of them

Exits 1 when a kernel fails to compile.
"""

import argparse
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
FAKE_CUDA = torch.device("cuda", 0)


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


@contextmanager
def gpu_configs():
    """The ops pick tiles by device type; have them pick the GPU's for CPU tensors."""
    from gem_jagged.ops.gdpa import triton as gdpa
    from gem_jagged.ops.jagged_flash_attention import triton as jfa

    saved = (jfa.config_for, jfa._sm_count, gdpa.default_tiles, gdpa.activation_code)
    jfa.config_for = lambda head_dim, device, dtype, **kw: saved[0](
        head_dim, FAKE_CUDA, dtype, **kw
    )
    jfa._sm_count = lambda device: SM_COUNT
    gdpa.default_tiles = lambda device, head_dim, dtype: saved[2](FAKE_CUDA, head_dim, dtype)
    gdpa.activation_code = lambda activation, dtype, device: saved[3](activation, dtype, FAKE_CUDA)
    try:
        yield
    finally:
        jfa.config_for, jfa._sm_count, gdpa.default_tiles, gdpa.activation_code = saved


def ptxas_usage(kernel) -> dict:
    """Registers, spill bytes (stores, loads) and shared bytes of one compiled kernel."""
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
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "shared": kernel.metadata.shared,
    }


def _jagged_batch(lengths, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    return q, k, v, offsets


def _jfa(rel_bias: bool):
    from gem_jagged import jagged_flash_attention

    def run():
        q, k, v, offsets = _jagged_batch([700, 300, 1500, 64], 4, 128, torch.bfloat16)
        bias = torch.randn(4, 65, requires_grad=True) if rel_bias else None
        q.requires_grad_()
        out = jagged_flash_attention(q, k, v, offsets, causal=True, rel_bias=bias, backend="triton")
        out.sum().backward()

    return run


def _gdpa():
    from gem_jagged import gdpa

    def run():
        q, k, v, offsets = _jagged_batch([700, 300, 1500, 64], 4, 128, torch.bfloat16)
        q.requires_grad_()
        out = gdpa(q, k, v, offsets, activation="silu", causal=True, backend="triton")
        out.sum().backward()

    return run


def _block_attention():
    from gem_jagged import block_attention

    def run():
        q, k, v, offsets = _jagged_batch([700, 300, 1500, 64], 4, 128, torch.bfloat16)
        q.requires_grad_()
        out = block_attention(q, k, v, offsets, rope_theta=10000.0, backend="triton")
        out.sum().backward()

    return run


def _swiglu():
    from gem_train.model.swiglu import swiglu_backward_triton, swiglu_forward_triton

    def run():
        u = torch.randn(4100, 2 * 2816, dtype=torch.bfloat16)
        swiglu_backward_triton(u, swiglu_forward_triton(u))

    return run


OPS = {
    "jfa": _jfa(rel_bias=False),
    "jfa_bias": _jfa(rel_bias=True),
    "gdpa": _gdpa(),
    "block_attention": _block_attention(),
    "swiglu": _swiglu(),
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
    print("| op | kernel | registers | spill stores / loads (bytes) | shared (bytes) |")
    print("|---|---|---|---|---|")
    for op, kernel_name, use in rows:
        spills = f"{use['spill_stores']} / {use['spill_loads']}"
        print(f"| {op} | {kernel_name} | {use['registers']} | {spills} | {use['shared']} |")
    if failed:
        print(f"\nfailed to compile: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
