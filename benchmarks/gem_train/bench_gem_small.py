"""A2: gem-small on one GPU, every optimisation on, then each switched off in turn.

Rows (one process, one after another, same data, same steps):

- ``all on``: jagged kernels (gem_jagged), MXFP8 linears (gem_lowprec) under BF16 autocast,
  AutoAC (gem_memory), Base Batch Shuffling (gem_loadbalance);
- ``jagged → padded SDPA``: history attention by ``scaled_dot_product_attention`` on a padded
  batch with the causal + relative-bias mask, PMA / cross-attention by padded PyTorch GDPA;
- ``low precision → BF16``: no gem_lowprec conversion (and no token alignment), BF16 autocast;
- ``AutoAC → none``: every activation kept;
- ``shuffling → none``: sub-batches concatenated in order;
- ``PyTorch-native``: the anchor, the same model from PyTorch pieces: padded SDPA, BF16, no
  checkpointing, no shuffling.

Each row reports QPS (samples/s, steady state after warm-up), E2E MFU (useful FLOPs of the real
tokens per second over the datasheet BF16 peak, 989 TFLOP/s for the H200), Local MFU (each layer
alone, FLOP-weighted; ``gem-train mfu``), Scaling Ratio = E2E / Local, peak memory, and the QPS
ratio over the PyTorch-native anchor. Goals (docs/performance.md): all-on QPS ≥ 1.5× the anchor,
E2E MFU ≥ 0.35.

``--smoke`` runs a shrunken model for a few steps on the CPU (reference kernels) to catch errors.
"""

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
from gem_train.components import build_run  # noqa: E402
from gem_train.config import apply_overrides, named_config  # noqa: E402
from gem_train.metrics import batch_flops, peak_flops  # noqa: E402
from gem_train.mfu import local_mfu_of  # noqa: E402
from gem_train.train import train_step  # noqa: E402

VARIANTS = {
    "all on": {},
    "jagged → padded SDPA": {"model.attention": "padded", "model.pooling_attention": "padded"},
    "low precision → BF16": {"lowprec.recipe": "none", "lowprec.token_multiple": "0"},
    "AutoAC → none": {"memory.autoac": "false"},
    "shuffling → none": {"data.shuffle": "false"},
    "PyTorch-native": {
        "model.attention": "padded", "model.pooling_attention": "padded", "lowprec.recipe": "none",
        "lowprec.token_multiple": "0", "memory.autoac": "false", "data.shuffle": "false",
    },
}  # fmt: skip

SMOKE = {
    "device": "cpu", "model.d_model": "64", "model.n_heads": "2", "model.n_layers": "1",
    "model.ffn_hidden": "128", "model.mlp_hidden": "64", "model.emb_dim": "16",
    "model.item_vocab": "1000", "model.user_vocab": "1000", "model.segment_vocab": "100",
    "model.advertiser_vocab": "100", "model.category_vocab": "32", "data.batch_size": "8",
    "data.sub_batch_size": "4", "data.median_len": "16", "data.min_len": "2", "data.max_len": "128",
    "memory.budget_gib": "2", "lowprec.autocast_bf16": "false", "model.embeddings": "native",
    "lowprec.token_multiple": "128",
}  # fmt: skip


def run_variant(name: str, flags: dict, *, steps: int, warmup: int, smoke: bool) -> dict:
    cfg = named_config("gem-small")
    overrides = {**(SMOKE if smoke else {}), **flags}  # a variant's own flags win
    overrides.update({"steps": str(warmup + steps), "metrics.progress": "false"})
    overrides.setdefault("model.embeddings", "native")  # the GPU image has no torchrec
    cfg = apply_overrides(cfg, overrides)
    run = build_run(cfg)
    device = run.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples = flops = 0.0
    t0 = None
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        batch, lengths, _, logits, loss = train_step(run, next(run.batches), step)
        if step >= warmup:
            samples += batch.num_samples
            flops += batch_flops(cfg.model, lengths)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = peak_flops(device)
    memory = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    )
    last_loss = loss.item()
    del run, logits, loss, batch  # free the training run before timing layers alone
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    local = local_mfu_of(cfg, reps=3 if smoke else 5)["local_mfu"]  # no recompute, by definition
    e2e = flops / seconds / peak if peak else float("nan")
    result = {
        "variant": name, "qps": samples / seconds, "step_ms": seconds / steps * 1e3, "e2e_mfu": e2e,
        "local_mfu": local, "scaling": e2e / local if local and not math.isnan(local) else float("nan"),
        "peak_gib": memory, "loss": last_loss,
    }  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per variant")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: running the smoke sizes on the CPU")
    steps = args.steps or (2 if smoke else 15)
    warmup = args.warmup or (1 if smoke else 3)
    print(
        f"A2 gem-small: {common.environment()}; {warmup} warm-up + {steps} timed steps per variant"
    )
    rows = []
    for name, flags in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        try:
            rows.append(run_variant(name, flags, steps=steps, warmup=warmup, smoke=smoke))
        except Exception as exc:  # one variant failing must not hide the others' numbers
            print(f"  {name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({"variant": name, "qps": float("nan")})
    anchor = next((r["qps"] for r in rows if r["variant"] == "PyTorch-native"), float("nan"))
    header = [
        "variant",
        "QPS",
        "step ms",
        "E2E MFU",
        "Local MFU",
        "scaling",
        "peak GiB",
        "vs native",
    ]
    table = [
        [r["variant"], r["qps"], r.get("step_ms", float("nan")), r.get("e2e_mfu", float("nan")),
         r.get("local_mfu", float("nan")), r.get("scaling", float("nan")), r.get("peak_gib", float("nan")),
         r["qps"] / anchor if anchor else float("nan")]
        for r in rows
    ]  # fmt: skip
    common.print_table(
        "A2: gem-small, one GPU (MFU against the datasheet BF16 peak)", header, table
    )
    all_on = next((r for r in rows if r["variant"] == "all on"), None)
    if all_on is not None:
        common.record(
            "gem_train_a2", qps=all_on["qps"], e2e_mfu=all_on.get("e2e_mfu", float("nan")),
            local_mfu=all_on.get("local_mfu", float("nan")), speedup_vs_native=all_on["qps"] / anchor,
        )  # fmt: skip
    if any(math.isnan(r["qps"]) for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
