"""Host cost of a GDPA / BlockAttention call: CPU wall per call without a sync vs device time.

An eager call is host-bound when Python takes longer to issue the kernels than the GPU takes to
run them; its time is then the host's, whatever the kernels do. For J1 (self, SiLU, causal), J3
(cross, 64 keys per sample), J4 (PMA, 32 seeds) and J5 (64-token blocks with RoPE), forward and
forward + backward, this script reports per step:

- ``host us``: wall time of back-to-back steps without synchronising, divided by their count
  (what issuing the step costs the CPU);
- ``device us``: the CUDA kernels' time per step, summed from ``torch.profiler`` (CPU + CUDA);
- ``wall us``: the same steps including the final synchronisation (about max(host, device));

for the public op (input checks, custom-op dispatch, autograd, launchers) and for the launchers
called directly (``launcher``: what remains without checks and dispatch). Then the CPU ops
that cost the most in the public forward + backward step and the kernels that ran. As a check
that fast is also right on these shapes, ``rel err`` is the worst of ``‖x − ref‖ / ‖ref‖`` over
the output and the three gradients, against the PyTorch reference run in fp32 on the same
inputs. ``--smoke`` runs tiny sizes on the CPU (Triton interpreter; the numbers mean nothing).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jagged"))
import attention_bench as ab  # noqa: E402
import bench_gdpa  # noqa: E402
import common  # noqa: E402
import numpy as np  # noqa: E402
from gem_jagged import block_attention, gdpa  # noqa: E402
from gem_jagged.batch import JaggedBatch  # noqa: E402
from gem_jagged.ops.block_attention import config_for  # noqa: E402
from gem_jagged.ops.block_attention import triton as block_kernels  # noqa: E402
from gem_jagged.ops.gdpa import Regime, arch_of, tiles_for  # noqa: E402
from gem_jagged.ops.gdpa import triton as gdpa_kernels  # noqa: E402

THETA, BLOCK = 10000.0, 64


def profile(step, calls: int):
    """(device us per step, profiler averages) over ``calls`` steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        common.sync()
    averages = prof.key_averages()
    device = sum(
        e.self_device_time_total
        for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return device / calls, averages


def gdpa_steps(w, q, k, v, do, device):
    """Public op and launcher-only (forward, forward + backward) steps of a GDPA workload."""
    q_off = None if w.pma else common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)
    kv_arg = None if w.name == "J1" else kv_off
    scale = q.shape[-1] ** -0.5
    q_launch = kv_off if q_off is None else q_off
    tiles = tiles_for(
        arch=arch_of(q.device), dtype=q.dtype, head_dim=q.shape[-1], regime=Regime.PLAIN
    )
    launch = dict(
        activation="silu", causal=w.causal, scale=scale, out_scale=1.0, broadcast_q=w.pma,
        rel_bias_NB=None, is_cross=kv_arg is not None and not w.pma, tiles=tiles,
        batch=JaggedBatch.of_owned(q_launch, kv_off, max_len=None),
    )  # fmt: skip

    def public(q, k, v, backend="triton"):
        return gdpa(q, k, v, q_off, kv_arg, causal=w.causal, broadcast_q=w.pma, backend=backend)

    def launcher_fwd():
        return gdpa_kernels.gdpa_forward(q, k, v, q_launch, kv_off, **launch)

    def launcher_both():
        launcher_fwd()
        return gdpa_kernels.gdpa_backward(do, q, k, v, q_launch, kv_off, **launch)

    return public, launcher_fwd, launcher_both


def block_steps(q, k, v, do, offsets, block):
    options = dict(
        block_size=block, causal=True, rope_theta=THETA, scale=q.shape[-1] ** -0.5,
        config=config_for(block_size=block, head_dim=q.shape[-1]),
    )  # fmt: skip

    def public(q, k, v, backend="triton"):
        return block_attention(
            q, k, v, offsets, block_size=block, causal=True, rope_theta=THETA, backend=backend
        )

    def launcher_fwd():
        return block_kernels.block_attention_forward(q, k, v, offsets, **options)

    def launcher_both():
        launcher_fwd()
        return block_kernels.block_attention_backward(do, q, k, v, offsets, **options)

    return public, launcher_fwd, launcher_both


def public_step(fn, q, k, v, do, backward):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if backward:
        return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

    def forward():
        with torch.no_grad():
            fn(*leaves)

    return forward


def worst_relative_error(public, q, k, v, do) -> float:
    """Worst ``‖x − ref‖ / ‖ref‖`` over out, dq, dk, dv; the reference runs in fp32."""

    def outputs(dtype, backend):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = public(*leaves, backend=backend)
        return [out, *torch.autograd.grad(out, leaves, do.to(dtype))]

    got, ref = outputs(q.dtype, "triton"), outputs(torch.float32, "reference")
    return max(
        float((g.float() - r).norm() / r.norm().clamp_min(1e-30))
        for g, r in zip(got, ref, strict=True)
    )


def run(smoke: bool) -> None:
    device, dtype, heads, head_dim = ab.setup(smoke, 4, 128)
    calls = 1 if smoke else 30
    print(f"# host vs device per call, {common.environment()}, {dtype}, N={heads}, D={head_dim}")
    cases = []
    for w in bench_gdpa.workloads(smoke):
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        cases.append((w.name, gdpa_steps(w, q, k, v, do, device), (q, k, v, do)))
    lengths = np.array([5, 40, 0, 17]) if smoke else common.workload_lengths("J5")
    gen = torch.Generator(device=device).manual_seed(0)
    total = int(lengths.sum())
    q, k, v, do = (
        torch.randn(total, heads, head_dim, device=device, dtype=dtype, generator=gen)
        for _ in range(4)
    )
    offsets = common.offsets_of(lengths, device)
    block = 16 if smoke else BLOCK
    cases.append(("J5", block_steps(q, k, v, do, offsets, block), (q, k, v, do)))
    rows, details = [], []
    for name, (public, launcher_fwd, launcher_both), inputs in cases:
        for backward in (False, True):
            label = "fwd+bwd" if backward else "fwd"
            steps = {
                "public op": public_step(public, *inputs, backward),
                "launcher": launcher_both if backward else launcher_fwd,
            }
            for what, step in steps.items():
                host, wall = common.host_and_wall_us(step, calls)
                device_us, averages = profile(step, calls)
                error = float("nan")
                if backward and what == "public op":
                    error = worst_relative_error(public, *inputs)
                rows.append([name, label, what, host, device_us, wall, error])
                print(
                    f"  {name} {label} {what}: host {host:.0f} us, device {device_us:.0f} us, "
                    f"wall {wall:.0f} us, rel err {error:.2g}",
                    flush=True,
                )
                common.record(
                    "attention_host", workload=f"{name} {label} {what}", host_us=host,
                    device_us=device_us, wall_us=wall,
                )  # fmt: skip
                if backward and what == "public op":
                    details.append((name, averages))
    common.print_table(
        f"host vs device per step (us), {common.environment()}",
        ["workload", "pass", "what", "host us", "device us", "wall us", "rel err"],
        rows,
    )
    for name, averages in details:
        cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        print(f"\n{name} fwd+bwd, public op: top CPU entries (self us per step, calls per step)")
        for e in cpu:
            print(f"  {e.self_cpu_time_total / calls:9.1f}  x{e.count / calls:<5.3g} {e.key[:90]}")
        kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print(f"{name} fwd+bwd kernels (device us per step, launches per step)")
        for e in kernels[:8]:
            print(
                f"  {e.self_device_time_total / calls:9.1f}  x{e.count / calls:<5.3g} {e.key[:90]}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    run(parser.parse_args().smoke)
