"""The optimisations, applied to a built model from outside, each switched by one flag.

In the order they must happen (torchtitan's order: numerics, then memory, then compile, then
sharding, since each later step wraps what the earlier ones produced):

1. **Low precision** (``lowprec.recipe``): ``gem_lowprec.convert`` swaps the dense tower's linear
   layers for low-precision ones (MXFP8, FP8 row-wise, or BF16). Embeddings, the task heads and
   the interaction's first projection stay in full precision (the first and last layers are the
   most sensitive, as in every FP8 recipe).
2. **AutoAC** (``memory.autoac``): ``gem_memory.plan_checkpointing`` profiles the blocks and
   pooling layers on a real batch and picks a checkpointing policy per region under the budget
   (under several ranks: the smallest rank's budget, rank 0's plan broadcast).
3. **torch.compile** (``compile``): each block is compiled on its own.
4. **Parallelism** (under torchrun with several processes): embeddings are sharded by
   ``gem_parallel.shard_embeddings`` over all ranks (``shard_model_embeddings`` says with what),
   the dense tower by
   ``gem_parallel.apply_dense_parallel`` (FSDP2, every block and pooling layer its own unit).
   With ``parallel.ep > 1`` each MoE's experts are split over the expert-parallel group; ranks
   hold jagged batches with different token counts, so every MoE first gets a token bound all
   ranks share (``parallel.ep_max_tokens``), which sizes its all-to-all buffers.

A flag asking for a package that is not installed fails here with a message naming the flag and
the missing piece; nothing falls back silently.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from gem_train.config import ConfigError, TrainConfig
from gem_train.model import loss_of

KEEP_FULL_PRECISION = ("interaction.project", "interaction.heads.*")  # names inside model.dense


def _missing(flag: str, what: str, exc: Exception) -> RuntimeError:
    return RuntimeError(f"{flag} needs {what}, which is not available here ({exc}); switch it off")


def apply_lowprec(
    model: nn.Module, cfg: TrainConfig, device: torch.device, sample_source, *, world: int = 1
) -> str:
    """Convert the dense tower's linears, then decide fp8 or BF16 per shape once, before
    training, identically on every rank (``gem_lowprec.plan_fp8``: rank 0 builds the table,
    every rank receives it): measured at the token counts a sample batch gives each linear
    (``lowprec.fp8_plan=measure``; the shape rule on the CPU, whose timings say nothing of a
    GPU's), or by the shape rule alone (``rule``). No linear times itself during training."""
    recipe = cfg.lowprec.recipe
    try:
        from gem_lowprec import LowPrecisionLinear, convert
        from gem_lowprec.fp8_plan import plan_fp8
    except (ImportError, AttributeError) as exc:
        raise _missing(f"lowprec.recipe={recipe}", "gem_lowprec.convert", exc) from exc
    convert(model.dense, recipe, skip=KEEP_FULL_PRECISION)
    report = model.dense.lowprec_conversion
    note = f"low precision {recipe}: {len(report.converted)} linears converted, {len(report.skipped)} kept"
    linears = [m for m in model.dense.modules() if isinstance(m, LowPrecisionLinear)]
    if not linears:
        return note
    tokens = _tokens_per_linear(model, cfg, device, sample_source, linears)
    autocast = cfg.lowprec.autocast_bf16 and device.type == "cuda"
    x_dtype = torch.bfloat16 if autocast else linears[0].weight.dtype
    # the shape rule: a measure that keeps fp8 wherever the kernels take the shape
    rule = (
        (lambda *args: (True, "shape rule: lowprec.fp8_plan=rule"))
        if cfg.lowprec.fp8_plan == "rule"
        else None
    )
    decisions = plan_fp8(model.dense, device=device, m_values=tokens, x_dtype=x_dtype, measure=rule)
    if not decisions.table.entries:  # no fp8 recipe (bf16): nothing to choose
        return note
    fp8 = sum(choice.keep_fp8 for choice in decisions.table.entries.values())
    return f"{note}; fp8 for {fp8} of {len(decisions.table.entries)} (shape, tokens) keys ({cfg.lowprec.fp8_plan}, the same on all {world} ranks)"


def _tokens_per_linear(model, cfg, device, sample_source, linears) -> list[int]:
    """The token counts (M of each GEMM) the linears see in one forward of a sample batch."""
    seen: set[int] = set()

    def record(module, args):
        seen.add(args[0].numel() // module.in_features)

    hooks = [linear.register_forward_pre_hook(record) for linear in linears]
    batch, max_len = sample_batch(cfg, sample_source, device)
    try:
        with torch.no_grad(), _autocast(cfg, device):
            model(batch, max_len)
    finally:
        for hook in hooks:
            hook.remove()
    return sorted(m for m in seen if m > 0)


def sample_batch(cfg: TrainConfig, sample_source, device: torch.device):
    """``(batch, longest history)``: one local batch of the source's first sub-batches on
    ``device``, padded as the loader pads training batches (``lowprec.token_multiple``)."""
    per_batch = cfg.data.batch_size // cfg.data.sub_batch_size
    batch = type(sample_source.sub_batch(0)).cat(
        [sample_source.sub_batch(k) for k in range(per_batch)]
    )
    if cfg.lowprec.token_multiple:
        batch = batch.padded(token_multiple=cfg.lowprec.token_multiple)
    batch = batch.to(device)
    return batch, int(batch.lengths.max())


def region_names(model: nn.Module) -> list[str]:
    """AutoAC regions: every block and both pooling attentions."""
    return [f"dense.blocks.{i}" for i in range(len(model.dense.blocks))] + [
        "dense.pma",
        "dense.cross",
    ]


def apply_autoac(
    model: nn.Module, cfg: TrainConfig, device: torch.device, sample_source, *, world: int = 1
) -> str:
    """Plan and set a checkpointing policy per region. Under several ranks the plan is one
    plan: the budget is the smallest of the ranks' (free memory differs), and rank 0's
    policies, chosen from its own recompute timings, are broadcast and applied everywhere."""
    try:
        from gem_memory import plan_checkpointing
    except (ImportError, AttributeError) as exc:
        raise _missing("memory.autoac=true", "gem_memory.plan_checkpointing", exc) from exc
    batch, max_len = sample_batch(cfg, sample_source, device)
    if cfg.memory.budget_gib > 0:
        budget = int(cfg.memory.budget_gib * 2**30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(0.6 * free) + torch.cuda.memory_allocated(device)
    else:
        raise RuntimeError("memory.autoac=true on the CPU needs an explicit memory.budget_gib")
    if world > 1:
        smallest = [None] * world
        dist.all_gather_object(smallest, budget)
        budget = min(smallest)
    with _autocast(cfg, device):
        plan = plan_checkpointing(
            model, (batch, max_len), budget_bytes=budget, regions=region_names(model),
            loss_fn=lambda logits: loss_of(logits, batch)[0],
        )  # fmt: skip
    if world > 1:
        chosen = [dict(plan.policies)]
        dist.broadcast_object_list(chosen, src=0)
        plan = dataclasses.replace(plan, policies=chosen[0])
    plan.apply(model)
    chosen = ", ".join(f"{name.removeprefix('dense.')}={p}" for name, p in plan.policies.items())
    return f"AutoAC under {budget / 2**30:.1f} GiB: {chosen}"


def _autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.lowprec.autocast_bf16)


def apply_parallel(model: nn.Module, cfg: TrainConfig, device: torch.device) -> list[str]:
    try:
        from gem_parallel import (
            DenseParallelConfig,
            MeshLayout,
            apply_dense_parallel,
            build_meshes,
        )
    except (ImportError, AttributeError) as exc:
        raise _missing(
            "running under torchrun with parallel.dense=fsdp", "gem_parallel", exc
        ) from exc
    world, p = dist.get_world_size(), cfg.parallel
    ep_note = ""
    if p.ep > 1:
        ep_note = f", {bound_moe_tokens(model, cfg)} tokens per rank at most"
    if world % p.dp_replicate:
        raise RuntimeError(
            f"parallel.dp_replicate={p.dp_replicate} does not divide the {world} processes"
        )
    layout = MeshLayout(
        world=world, dp_replicate=p.dp_replicate, dp_shard=world // p.dp_replicate, ep=p.ep
    )
    meshes = build_meshes(layout, device_type=device.type)
    embedding_notes = shard_model_embeddings(model, cfg, device, meshes.sparse)
    dense = model.dense
    param_dtype = torch.bfloat16 if cfg.lowprec.autocast_bf16 else None
    apply_dense_parallel(
        dense, meshes, blocks=[*dense.blocks, dense.pma, dense.cross],
        config=DenseParallelConfig(param_dtype=param_dtype),
    )  # fmt: skip
    return [
        f"parallel: {world} ranks, dense tower FSDP2 (dp_replicate={p.dp_replicate}, "
        f"ep={p.ep}{ep_note})",
        *embedding_notes,
    ]


def shard_model_embeddings(
    model: nn.Module, cfg: TrainConfig, device: torch.device, mesh
) -> list[str]:
    """Shard both embedding collections over ``mesh``; returns the notes that say how.

    ``parallel.embeddings``: ``native`` takes gem_parallel's row-wise tables, ``torchrec``
    torchrec's own sharding (``DMPCollection`` on CUDA, ``DistributedModelParallel`` table-wise
    over gloo on the CPU), ``auto`` torchrec's where the model's collections are torchrec's. On
    the CPU torchrec shards the sequence collection (unpooled) only with FBGEMM's fused row-wise
    Adagrad, so with ``optim.embedding_optimizer=adamw`` that collection falls back to the native
    tables, and a note names the reason; with ``rowwise_adagrad`` both collections share one
    ``RowwiseAdagrad``, whose rate the schedule sets (``components.fuse_embedding_optimizer``
    collects it). Checkpoints save gem_parallel's native shards only (neither torchrec's sharded
    tables nor its fused optimizer's state), so with ``checkpoint.folder`` ``auto`` takes the
    native tables and ``torchrec`` is refused.
    """
    from gem_parallel.embeddings import RowwiseAdagrad, shard_embeddings

    choice = cfg.parallel.embeddings
    notes = []
    if choice == "torchrec" and cfg.checkpoint.folder:
        raise ConfigError(
            "parallel.embeddings=torchrec cannot be checkpointed: checkpoints save gem_parallel's "
            "native shards, not torchrec's sharded tables and fused optimizer state; use "
            "parallel.embeddings=native (or auto) with checkpoint.folder"
        )
    if choice == "auto":
        choice = "torchrec" if model.embedding_backend == "torchrec" else "native"
        if choice == "torchrec" and cfg.checkpoint.folder:
            choice = "native"
            notes.append(
                "embeddings: checkpoint.folder is set, and checkpoints save gem_parallel's native "
                "shards only, so parallel.embeddings=auto shards torchrec's tables natively"
            )
    on_cpu = device.type == "cpu"
    fused = None
    if choice == "torchrec" and on_cpu and cfg.optim.embedding_optimizer == "rowwise_adagrad":
        fused = RowwiseAdagrad(lr=cfg.optim.embedding_lr or cfg.optim.lr)
    backends = {"sequence": choice, "pooled": choice}
    if choice == "torchrec" and on_cpu and fused is None:
        backends["sequence"] = "native"
        notes.append(
            "embeddings: torchrec cannot shard the sequence EmbeddingCollection on the CPU with "
            "optim.embedding_optimizer=adamw (FBGEMM's CPU dense lookup returns one summed row "
            "per sequence instead of one row per id), so it uses gem_parallel's native tables; "
            "optim.embedding_optimizer=rowwise_adagrad shards it with torchrec's fused kernel"
        )
    for name in backends:
        attribute = f"{name}_embeddings"
        setattr(
            model, attribute, shard_embeddings(
                getattr(model, attribute), backend=backends[name], mesh=mesh, device=device,
                fused_optimizer=fused if backends[name] == "torchrec" else None,
            ),
        )  # fmt: skip
    if set(backends.values()) == {"native"}:
        model.embedding_backend = "native"  # the sharded tables take gem_parallel's KeyedJagged
    if on_cpu:
        kernel = "fused kernel, row-wise Adagrad" if fused else "dense kernel"
        torchrec_how = f"torchrec DistributedModelParallel (table-wise, {kernel})"
    else:
        torchrec_how = "torchrec DMPCollection (row-wise, fully sharded)"
    how = {"native": "gem_parallel native tables (row-wise)", "torchrec": torchrec_how}
    return [
        f"embeddings sharded: sequence by {how[backends['sequence']]}; pooled by "
        f"{how[backends['pooled']]}",
        *notes,
    ]


def bound_moe_tokens(model: nn.Module, cfg: TrainConfig) -> int:
    """Give every MoE the per-rank token bound ``parallel.ep_max_tokens`` (or the largest batch the
    data config allows) and a host-side check naming that flag; returns the bound.

    Expert parallelism exchanges fixed-size buffers, so all ranks must size them alike although
    their jagged batches differ; the bound is a config value, hence the same everywhere."""
    from gem_parallel import MoE

    d, multiple = cfg.data, max(1, cfg.lowprec.token_multiple)
    bound = cfg.parallel.ep_max_tokens or -(-d.batch_size * d.max_len // multiple) * multiple

    def check(module, args):
        tokens = args[0].reshape(-1, module.config.d_model).shape[0]
        if tokens > bound:
            raise ValueError(
                f"a batch holds {tokens} history tokens on this rank but "
                f"parallel.ep_max_tokens={bound} (expert parallelism sizes its buffers from it); "
                "raise parallel.ep_max_tokens"
            )

    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.config = dataclasses.replace(moe.config, max_tokens_per_rank=bound)
        moe.register_forward_pre_hook(check)
    return bound


def apply_optimizations(
    model: nn.Module, cfg: TrainConfig, *, device: torch.device, world: int, sample_source
):
    """Apply what ``cfg`` switches on; returns the model and one line per optimisation applied."""
    notes = []
    if cfg.lowprec.recipe != "none":
        notes.append(apply_lowprec(model, cfg, device, sample_source, world=world))
    if cfg.memory.autoac:
        notes.append(apply_autoac(model, cfg, device, sample_source, world=world))
    if cfg.compile:
        for block in model.dense.blocks:
            block.compile()
        notes.append("torch.compile: every block")
    dense = cfg.parallel.dense
    if world > 1 and dense in ("auto", "fsdp"):
        notes.extend(apply_parallel(model, cfg, device))
    elif world > 1:
        raise RuntimeError(
            f"parallel.dense=none with {world} processes would train {world} diverging copies; "
            "use parallel.dense=fsdp (or auto) under torchrun"
        )
    return model, notes
