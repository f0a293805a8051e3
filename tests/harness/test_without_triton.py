"""Where triton is missing (macOS, Windows) every package imports and the reference backends run;
``backend="triton"`` where it cannot run fails with gemkit's message, not Triton's.

Each check runs in a fresh interpreter: triton is imported lazily (the kernels on first use), and
this process has imported it already. The child blocks triton with ``sys.modules["triton"] =
None``, which makes every ``import triton`` raise ImportError, as on a machine without it.
"""

import os
import subprocess
import sys
import textwrap

BLOCK_TRITON = 'import sys\nsys.modules["triton"] = None\n'

# Every package's public names, each op forward and backward on the reference backend and on
# backend="auto" (the reference for CPU tensors), and the trainer's model for one step.
RUN_EVERY_OP = """
import importlib

import torch

packages = ["gem_jagged", "gem_lowprec", "gem_parallel", "gem_loadbalance", "gem_memory"]
for name in packages:
    module = importlib.import_module(name)
    for public in module.__all__:
        getattr(module, public)
    assert module.__version__

import gem_jagged
import gem_lowprec
from gem_lowprec.ops.fp8_cast import cast_both, cast_columns, cast_rows

gen = torch.Generator().manual_seed(0)
offsets = torch.tensor([0, 3, 3, 40])


def qkv(tokens):
    return [torch.randn(tokens, 2, 32, generator=gen, requires_grad=True) for _ in range(3)]


for backend in ("reference", "auto"):
    q, k, v = qkv(40)
    out = gem_jagged.jagged_flash_attention(q, k, v, offsets, causal=True, backend=backend)
    out.sum().backward()
    out = gem_jagged.gdpa(q, k, v, offsets, backend=backend)
    out.sum().backward()
    out = gem_jagged.block_attention(q, k, v, offsets, block_size=16, backend=backend)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()

    x = torch.randn(128, 128, generator=gen)
    for fn in (gem_lowprec.to_mx, gem_lowprec.to_mx_2d, gem_lowprec.to_mx_rowcol):
        fn(x, backend=backend)
    gem_lowprec.quantize_mx_k128(x, backend=backend)
    gem_lowprec.quantize_mx_k128_rowcol(x, backend=backend)
    gem_lowprec.rmsnorm_to_mx(x, torch.ones(128), backend=backend)
    u = torch.randn(8, 64, generator=gen, requires_grad=True)
    gem_lowprec.swiglu(u, backend=backend).sum().backward()
    cast_rows(x, backend=backend)
    cast_columns(x, backend=backend)
    cast_both(x, backend=backend)

for name in ("mxfp8", "fp8_rowwise"):
    linear = gem_lowprec.LowPrecisionLinear(128, 64, recipe=gem_lowprec.recipe(name))
    linear(torch.randn(32, 128, generator=gen)).sum().backward()

from gem_train import cli

flags = ["--steps", "2", "--data.eval_batches", "1", "--metrics.progress", "false"]
assert cli.main([*flags, "--device", "cpu"]) == 0
print("ran without triton")
"""


def _run(code: str, *, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )


def _without_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_every_package_and_reference_backend_runs_without_triton():
    done = _run(BLOCK_TRITON + textwrap.dedent(RUN_EVERY_OP))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "ran without triton" in done.stdout


TRITON_ON_CPU = """
import torch

import gem_jagged
import gem_lowprec

q = torch.randn(8, 2, 32)
offsets = torch.tensor([0, 8])
calls = {
    "jagged_flash_attention": lambda: gem_jagged.jagged_flash_attention(
        q, q, q, offsets, backend="triton"
    ),
    "gdpa": lambda: gem_jagged.gdpa(q, q, q, offsets, backend="triton"),
    "block_attention": lambda: gem_jagged.block_attention(q, q, q, offsets, backend="triton"),
    "to_mx": lambda: gem_lowprec.to_mx(torch.randn(4, 32), backend="triton"),
    "swiglu": lambda: gem_lowprec.swiglu(torch.randn(4, 64), backend="triton"),
}
for name, call in calls.items():
    try:
        call()
    except (ValueError, RuntimeError) as err:
        print(f"{name}: {type(err).__name__}: {err}")
    else:
        print(f"{name}: no error")
"""


def _errors(stdout: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


def test_triton_backend_on_cpu_without_the_interpreter_says_what_to_do():
    done = _run(TRITON_ON_CPU, env=_without_interpreter())
    assert done.returncode == 0, done.stderr[-4000:]
    errors = _errors(done.stdout)
    assert len(errors) == 5, done.stdout
    for name, message in errors.items():
        assert message.startswith("ValueError: backend='triton'"), (name, message)
        for hint in ("cpu", "CUDA", "TRITON_INTERPRET=1", "backend='reference'"):
            assert hint in message, (name, hint, message)


def test_triton_backend_without_triton_says_what_to_do():
    done = _run(BLOCK_TRITON + TRITON_ON_CPU, env=_without_interpreter())
    assert done.returncode == 0, done.stderr[-4000:]
    errors = _errors(done.stdout)
    assert len(errors) == 5, done.stdout
    for name, message in errors.items():
        assert message.startswith("RuntimeError: backend 'triton'"), (name, message)
        for hint in ("cannot be imported", "Linux", "backend='reference'"):
            assert hint in message, (name, hint, message)
