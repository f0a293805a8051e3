"""A/B of two versions of the Gluon kernels on J1 and J2, in one process: the package's
``hopper/forward.py`` (or ``backward.py``) against another version of that file, e.g. main's.

    git show main:packages/jagged/src/gem_jagged/ops/jagged_flash_attention/hopper/forward.py \
        > /tmp/forward_base.py
    python benchmarks/diagnostics/ab_hopper_kernels.py /tmp/forward_base.py [--rounds 5] [--sustained 2]
    python benchmarks/diagnostics/ab_hopper_kernels.py /tmp/backward_base.py --module backward

The other file is loaded as a module of the ``hopper`` package (its relative imports resolve
there) and its kernels swapped into the launchers (``hopper/launch.py``) before each call. Each
variant gets its own inputs and offsets, so its launch plans are its own. Prints the outputs' and
gradients' largest difference, five alternating ``do_bench`` rounds (25 / 100 ms) of eager
forward and forward + backward steps with their per-round ratios, and J1's steps back to back
for 1 s a side (ms, mean SM MHz, mJ per step): the power limit makes a short measurement
flatter a kernel that draws more power (docs/history/performance.md, 2026-12-02).
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jagged"))
import attention_bench as ab  # noqa: E402
import bench_jagged_flash_attention as bj  # noqa: E402
import common  # noqa: E402
from gem_jagged.ops.jagged_flash_attention import hopper  # noqa: E402
from gem_jagged.ops.jagged_flash_attention.hopper import backward, forward, launch  # noqa: E402

KERNELS = {
    "forward": ("_jfa_fwd_hopper_kernel",),
    "backward": ("_jfa_dkdv_hopper_kernel", "_jfa_dq_hopper_kernel"),
}


def load_kernels(path: Path, module_name: str) -> dict:
    """The kernels of ``path`` loaded as the module ``hopper._<module>_base`` (Triton reads
    a kernel's source from its file, so the file stays where it is)."""
    name = f"{hopper.__name__}._{module_name}_base"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = hopper.__name__
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return {kernel: getattr(module, kernel) for kernel in KERNELS[module_name]}


def steps(w, kernels: dict):
    """Eager forward and forward + backward steps of ``w`` with ``kernels`` in the launchers."""
    device, dtype = ab.device_and_dtype()
    heads, head_dim = w.heads, w.head_dim
    q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
    fn = bj.project_fn(w, q, k, v, device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def use():
        for name, kernel in kernels.items():
            setattr(launch, name, kernel)  # the launchers read their kernels there

    def fwd():
        use()
        with torch.no_grad():
            return fn(q, k, v)

    def fwd_bwd():
        use()
        return torch.autograd.grad(fn(*leaves), leaves, do)

    return fwd, fwd_bwd


def compare(w, variants: dict, *, rounds: int, sustained: int) -> None:
    built = {name: steps(w, kernels) for name, kernels in variants.items()}
    (base_f, base_fb), (new_f, new_fb) = built.values()
    d_out = (new_f().float() - base_f().float()).abs().max().item()
    d_grads = [
        (a.float() - b.float()).abs().max().item() for a, b in zip(new_fb(), base_fb(), strict=True)
    ]
    print(f"{w.name}: largest |new - base|: out {d_out:.3g}, dq dk dv {d_grads}")
    ms = {name: {"fwd": [], "fwd+bwd": []} for name in built}
    for _ in range(rounds):
        for name, (f, fb) in built.items():
            ms[name]["fwd"].append(common.bench_ms(f))
            ms[name]["fwd+bwd"].append(common.bench_ms(fb))
    rows = []
    for part in ("fwd", "fwd+bwd"):
        ratios = [n / b for n, b in zip(ms["new"][part], ms["base"][part], strict=True)]
        rows.append([
            w.name, part, f"{np.median(ms['base'][part]):.4f}", f"{np.median(ms['new'][part]):.4f}",
            f"{np.median(ratios):.3f}", " ".join(f"{r:.3f}" for r in ratios),
        ])  # fmt: skip
    common.print_table(
        f"{w.name}: eager steps, {rounds} alternating do_bench rounds (new / base time)",
        ["workload", "pass", "base ms", "new ms", "median new/base", "per round"], rows,
    )  # fmt: skip
    if not sustained:
        return
    rows = []
    for r in range(sustained):
        for name, (_, fb) in built.items():
            run = common.sustained(fb, seconds=1.0, window=20)
            rows.append([w.name, r + 1, name, f"{run.ms:.4f}", f"{run.mhz:.0f}", f"{run.mj:.0f}"])
    common.print_table(
        f"{w.name}: forward + backward back to back for 1 s a side",
        ["workload", "round", "variant", "ms", "SM MHz", "mJ per step"], rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the other forward.py (or backward.py)")
    parser.add_argument("--module", choices=sorted(KERNELS), default="forward")
    parser.add_argument("--rounds", type=common.positive_int, default=5)
    parser.add_argument("--sustained", type=int, default=2, help="1 s rounds on J1 (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("ab_hopper_kernels: needs a Hopper GPU (the Gluon kernels are sm_90 only)")
    package = {"forward": forward, "backward": backward}[args.module]
    variants = {
        "base": load_kernels(args.base, args.module),
        "new": {kernel: getattr(package, kernel) for kernel in KERNELS[args.module]},
    }
    for w in bj.workloads(False, ("J1", "J2")):
        compare(w, variants, rounds=args.rounds, sustained=args.sustained if w.name == "J1" else 0)


if __name__ == "__main__":
    main()
