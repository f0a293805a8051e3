"""``gem-train mfu`` (Local MFU, layer by layer) and ``gem-train plan`` (sizes, no run).

Local MFU, as GEM decomposes it: run the model once on a real batch to capture every layer's
inputs, then time each layer *alone* (forward + backward, on one device, no recompute, no
communication, optimisations that change numerics such as low precision kept), and average the
layers' MFUs weighted by their share of the model's FLOPs. E2E MFU comes from training steps
(``gem-train --summary-json``); Scaling Ratio = E2E / Local says how much of the single-layer
efficiency survives the whole step (data, embeddings, optimizer, communication, recompute).

Layers: the input projections, each block, PMA, the candidate cross-attention, the interaction
and heads. FLOPs are counted by ``metrics.layer_flops`` from real tokens only.
"""

import contextlib
import statistics
import time

import numpy as np
import torch
from gem_loadbalance.workloads import lognormal_lengths
from torch import nn

from gem_train.components import make_source, resolve_device
from gem_train.config import TrainConfig
from gem_train.data.batch import Batch
from gem_train.metrics import batch_flops, layer_flops, peak_flops
from gem_train.model import GemModel


def layers_of(model: GemModel) -> dict[str, nn.Module]:
    dense = model.dense
    out = {"inputs": dense.inputs}
    out.update({f"block{i}": block for i, block in enumerate(dense.blocks)})
    out.update({"pma": dense.pma, "cross": dense.cross, "interaction": dense.interaction})
    return out


def flops_by_layer(cfg: TrainConfig, lengths) -> dict[str, float]:
    per = layer_flops(cfg.model, lengths, backward=True)
    out = {
        "inputs": per["token_proj"],
        "pma": per["pma"],
        "cross": per["cross"],
        "interaction": per["interaction"],
    }
    for i in range(cfg.model.n_layers):
        out[f"block{i}"] = sum(v for k, v in per.items() if k.startswith(f"block{i}."))
    return out


def _capture_inputs(
    model: GemModel, layers: dict[str, nn.Module], batch: Batch, max_len: int, autocast
) -> dict:
    captured, handles = {}, []
    for name, layer in layers.items():

        def hook(module, args, name=name):
            captured[name] = args

        handles.append(layer.register_forward_pre_hook(hook))
    with torch.no_grad(), autocast():
        model(batch, max_len)
    for h in handles:
        h.remove()
    return captured


def _leaves(args):
    def prep(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().clone().requires_grad_(True)
        if isinstance(a, dict):
            return {k: prep(v) for k, v in a.items()}
        return a

    return tuple(prep(a) for a in args)


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def time_ms(fn, *, device: torch.device, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_local_mfu(
    model: GemModel,
    cfg: TrainConfig,
    batch: Batch,
    *,
    device,
    peak,
    autocast,
    reps: int = 20,
    lengths=None,
) -> dict:
    """Per-layer time, FLOPs, TFLOP/s and MFU, and the FLOP-weighted Local MFU.

    ``lengths``: the real histories when ``batch`` carries padding samples (FLOPs count only them).
    """  # fmt: skip
    real = batch.lengths.cpu().numpy() if lengths is None else np.asarray(lengths)
    max_len = int(batch.lengths.max())
    layers = layers_of(model)
    inputs = _capture_inputs(model, layers, batch, max_len, autocast)
    flops = flops_by_layer(cfg, real)  # real samples only: padding never counts
    rows = []
    for name, layer in layers.items():
        args = _leaves(inputs[name])
        with autocast():
            probe = _outputs(layer(*args))
        grads = [torch.randn_like(t) for t in probe if t.requires_grad]

        def step(layer=layer, args=args, grads=grads):
            with autocast():
                outs = [t for t in _outputs(layer(*args)) if t.requires_grad]
            torch.autograd.backward(outs, grads)

        ms = time_ms(step, device=device, reps=reps)
        tflops = flops[name] / (ms * 1e-3) / 1e12
        rows.append({"layer": name, "gflop": flops[name] / 1e9, "ms": ms, "tflops": tflops,
                     "mfu": tflops * 1e12 / peak if peak else float("nan")})  # fmt: skip
    total = sum(flops.values())
    local = sum(r["mfu"] * flops[r["layer"]] / total for r in rows) if peak else float("nan")
    model.zero_grad(set_to_none=True)
    return {"layers": rows, "local_mfu": local, "flops": total}


def local_mfu_of(cfg: TrainConfig, *, reps: int = 20) -> dict:
    """Local MFU of ``cfg``'s model: built alone on one device with its numerics (low precision,
    autocast) but no AutoAC recompute and no parallelism, timed on the first batch of the stream."""
    from gem_train.optimizations import apply_lowprec

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = GemModel(cfg.model).to(device)
    source = make_source(cfg)
    if cfg.lowprec.recipe != "none":  # the trainer's fp8 choices, made as it makes them
        apply_lowprec(model, cfg, device, source)
    per_batch = cfg.data.batch_size // cfg.data.sub_batch_size
    batch = Batch.cat([source.sub_batch(k) for k in range(per_batch)])
    lengths = batch.lengths.numpy()
    if cfg.lowprec.token_multiple:
        batch = batch.padded(token_multiple=cfg.lowprec.token_multiple)
    batch = batch.to(device)
    peak = peak_flops(device, cfg.metrics.peak_tflops)

    def autocast():
        if cfg.lowprec.autocast_bf16:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    result = measure_local_mfu(
        model, cfg, batch, device=device, peak=peak, autocast=autocast, reps=reps, lengths=lengths
    )
    return {**result, "device": str(device), "peak_flops": peak}


def local_mfu(cfg: TrainConfig) -> dict:
    """``gem-train mfu``: print the per-layer table and the FLOP-weighted Local MFU."""
    result = local_mfu_of(cfg)
    peak = result["peak_flops"]
    print(
        f"Local MFU of {cfg.name} on {result['device']} (peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s)"
    )
    print("| layer | GFLOP fwd+bwd | ms | TFLOP/s | MFU |\n|---|---|---|---|---|")
    for r in result["layers"]:
        print(
            f"| {r['layer']} | {r['gflop']:.3g} | {r['ms']:.3g} | {r['tflops']:.3g} | {r['mfu']:.3f} |"
        )
    print(f"Local MFU (FLOP-weighted): {result['local_mfu']:.3f}"
          + ("" if peak else "  (no datasheet peak for this device: pass --metrics.peak_tflops)"))  # fmt: skip
    return result


def model_spec(cfg: TrainConfig):
    """A ``gem_parallel`` ModelSpec of this config: parameter counts and work per GPU."""
    from gem_parallel.model_spec import ModelSpec

    from gem_train.model.embeddings import pooled_tables, sequence_tables

    m, d = cfg.model, cfg.data
    with torch.device("meta"):
        from gem_train.model.gem import DenseTower

        dense = DenseTower(m)
    expert = sum(p.numel() for n, p in dense.named_parameters() if ".experts." in n)
    rows = sum(r for r, _ in sequence_tables(m).values()) + sum(
        r for r, _ in pooled_tables(m).values()
    )
    lengths = lognormal_lengths(
        np.random.default_rng(0),
        4096,
        median=d.median_len,
        sigma=d.sigma,
        lo=d.min_len,
        hi=d.max_len,
    )
    return ModelSpec(
        name=cfg.name, dense_params=sum(p.numel() for p in dense.parameters()) - expert,
        num_layers=m.n_layers, d_model=m.d_model, num_experts=m.n_experts if m.ffn == "moe" else 0,
        moe_layers=m.n_layers if m.ffn == "moe" else 0, expert_hidden=m.ffn_hidden if m.ffn == "moe" else 0,
        top_k=m.top_k, sparse_params=rows * m.emb_dim, embedding_dim=m.emb_dim, num_sparse_features=9,
        samples_per_gpu=d.batch_size, tokens_per_gpu=int(d.batch_size * lengths.mean()),
    )  # fmt: skip


def print_plan(cfg: TrainConfig, *, gpus: int) -> None:
    import json

    from gem_parallel.planner import plan
    from gem_parallel.topology import Topology

    spec = model_spec(cfg)
    d = cfg.data
    lengths = lognormal_lengths(
        np.random.default_rng(0),
        4096,
        median=d.median_len,
        sigma=d.sigma,
        lo=d.min_len,
        hi=d.max_len,
    )
    per_sample = batch_flops(cfg.model, lengths) / len(lengths)
    print(f"{cfg.name}: {per_sample / 1e9:.3g} GFLOP per sample (forward + backward, mean history "
          f"{lengths.mean():.0f} tokens)")  # fmt: skip
    print(f"{cfg.name}: {spec.total_dense_params / 1e9:.3g}B dense parameters "
          f"({spec.expert_params / 1e9:.3g}B in experts), {spec.sparse_params / 1e9:.3g}B sparse")  # fmt: skip
    topology = Topology(num_gpus=gpus, gpus_per_host=min(8, gpus))
    print(json.dumps(plan(topology, spec).to_dict(), indent=1))
