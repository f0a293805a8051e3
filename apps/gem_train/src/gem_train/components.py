"""Everything a training run is made of, built from a ``TrainConfig``.

``build_run(cfg)`` starts the process group under ``torchrun`` (gloo on the CPU, NCCL on CUDA),
builds the model on every rank from one seed, applies the optimisations from outside the model
(``gem_train.optimizations``: parallelism, low precision, AutoAC), creates the optimizer and the
data streams, and returns them in a ``Run``. The training loop (``gem_train.train``) reads like the
algorithm because all of this lives here.
"""

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from gem_parallel.embeddings import EmbeddingTables, RowwiseAdagrad
from torch.distributed.tensor import DTensor

from gem_train.checkpoint import Checkpointer, state_bytes
from gem_train.config import ConfigError, TrainConfig
from gem_train.data.loader import TrainBatches
from gem_train.data.staging import PinnedStaging
from gem_train.data.synthetic import EVAL_STREAM, SyntheticStream
from gem_train.finite import FiniteGuard
from gem_train.model import GemModel
from gem_train.optimizations import apply_optimizations
from gem_train.run_record import check_ranks_agree, resume_record
from gem_train.supervision import Supervision


@dataclass
class Run:
    cfg: TrainConfig
    device: torch.device
    rank: int
    world: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: TrainBatches
    eval_source: object
    checkpointer: Checkpointer | None
    notes: list[str]
    fused_optimizers: list[RowwiseAdagrad]  # embedding tables that update in their backward
    guard: FiniteGuard  # the non-finite loss and gradient check of every step
    supervision: Supervision  # stops a worker whose torchrun agent died

    def autocast(self):
        if self.cfg.lowprec.autocast_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def set_lr(self, step: int) -> None:
        """Linear warm-up over ``optim.warmup_steps``, then cosine decay to ``optim.final_lr_fraction``
        of the peak at the last step (a function of the step only, so resuming needs no state)."""
        o, total = self.cfg.optim, self.cfg.steps
        if step < o.warmup_steps:
            factor = (step + 1) / o.warmup_steps
        else:
            progress = (step - o.warmup_steps) / max(1, total - 1 - o.warmup_steps)
            cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            factor = o.final_lr_fraction + (1 - o.final_lr_fraction) * cosine
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        for fused in self.fused_optimizers:
            fused.lr = (o.embedding_lr or o.lr) * factor

    def clip_gradients(self) -> None:
        """Clip the dense tower's global gradient norm (embeddings are not clipped).

        Sharded, the norm is assembled per device mesh (experts and dense weights live on
        different meshes, which one stacked norm cannot mix), at the cost of one host sync.
        """
        max_norm = self.cfg.optim.grad_clip
        if max_norm <= 0:
            return
        params = [p for p in self.model.dense.parameters() if p.grad is not None]
        if self.world == 1:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            return
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
        squares = 0.0
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares += float(norm) ** 2
        coefficient = max_norm / (math.sqrt(squares) + 1e-6)
        if coefficient < 1.0:
            for p in params:
                p.grad.mul_(coefficient)


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is available; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(cfg: TrainConfig, device: torch.device) -> tuple[int, int]:
    """``(rank, world)``; starts the process group when launched by torchrun with several ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def make_source(cfg: TrainConfig, *, stream: int = 0):
    """The training source (``stream`` 0) or the held-out evaluation's (``EVAL_STREAM``):
    synthetic streams of their own, or the two sides of ``parquet.held_out_split``."""
    if cfg.data.source == "parquet":
        from gem_train.data.parquet import held_out_split

        train, evaluation = held_out_split(cfg.data, cfg.model)
        return evaluation if stream == EVAL_STREAM else train
    return SyntheticStream(cfg.data, cfg.model, stream=stream)


def fuse_embedding_optimizer(
    cfg: TrainConfig, model: torch.nn.Module, world: int
) -> list[RowwiseAdagrad]:
    """With ``optim.embedding_optimizer=rowwise_adagrad``, every native table collection of the
    model updates its looked-up rows in its own backward (``gem_parallel``'s RowwiseAdagrad);
    returns those optimizers, whose ``lr`` follows the schedule. Otherwise nothing.

    Under several processes the tables were sharded already: torchrec's CPU sharding took the
    optimizer then (``optimizations.shard_model_embeddings``), and it is collected here; other
    sharded tables keep dense gradients, which this optimizer cannot serve."""
    o = cfg.optim
    if o.embedding_optimizer != "rowwise_adagrad":
        return []
    if world > 1:
        sharded = {id(f): f for f in map(_fused_optimizer_of, model.modules()) if f is not None}
        if not sharded:
            raise ConfigError(
                f"optim.embedding_optimizer=rowwise_adagrad with {world} processes the tables "
                "are sharded, and only torchrec's CPU sharding trains them in the backward: set "
                "parallel.embeddings=torchrec on the CPU, or use optim.embedding_optimizer=adamw"
            )
        return list(sharded.values())
    collections = [m for m in model.modules() if isinstance(m, EmbeddingTables)]
    if not collections:
        raise ConfigError(
            "optim.embedding_optimizer=rowwise_adagrad on one process needs the native tables, "
            "but the model's embeddings are torchrec's: set model.embeddings=native (torchrec's "
            "tables take it when torchrun shards them on the CPU)"
        )
    fused = []
    for tables in collections:
        fused.append(RowwiseAdagrad(lr=o.embedding_lr or o.lr))
        tables.fuse_optimizer(fused[-1])
    return fused


def _fused_optimizer_of(module: torch.nn.Module) -> RowwiseAdagrad | None:
    """The row-wise Adagrad that trains ``module``'s tables in their backward (native tables,
    or tables sharded by torchrec), if any."""
    fused = getattr(module, "fused_optimizer", None)
    return fused if isinstance(fused, RowwiseAdagrad) else None


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW in groups: embeddings (``optim.embedding_lr``, no decay), dense matrices (decay),
    other dense parameters (norms, biases, seeds; no decay). Tables with a fused optimizer
    (``fuse_embedding_optimizer``) train themselves and are left out.

    Sharded (DTensor) and plain parameters also go in separate groups: AdamW's fused multi-tensor
    update cannot mix the two.
    """
    o = cfg.optim
    self_training = {
        id(p) for m in model.modules() if _fused_optimizer_of(m) is not None for p in m.parameters()
    }
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in self_training:
            kind = "dense_matrix" if name.startswith("dense.") and p.dim() >= 2 else "other"
            kind = "embedding" if not name.startswith("dense.") else kind
            groups.setdefault((kind, isinstance(p, DTensor)), []).append(p)
    settings = {
        "embedding": (o.embedding_lr or o.lr, 0.0),
        "dense_matrix": (o.lr, o.weight_decay),
        "other": (o.lr, 0.0),
    }
    param_groups = [
        {
            "params": params,
            "lr": settings[kind][0],
            "base_lr": settings[kind][0],
            "weight_decay": settings[kind][1],
        }
        for (kind, _), params in sorted(groups.items())
    ]
    return torch.optim.AdamW(param_groups, betas=(o.beta1, o.beta2), foreach=True)


def build_run(cfg: TrainConfig) -> Run:
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    rank, world = init_distributed(cfg, device)
    check_ranks_agree(cfg, world=world)  # before any collective that differing configs break
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GemModel(cfg.model).to(device)
    # Buffers for the batches queued, the one being packed, and two the GPU may still be
    # copying from while the host runs ahead.
    staging = PinnedStaging(device, slots=cfg.data.prefetch + 3) if device.type == "cuda" else None
    batches = TrainBatches(
        make_source(cfg), cfg.data, cfg.model, rank=rank, world=world, staging=staging,
        token_multiple=cfg.lowprec.token_multiple,
    )  # fmt: skip
    model, notes = apply_optimizations(
        model, cfg, device=device, world=world, sample_source=make_source(cfg)
    )
    fused_optimizers = fuse_embedding_optimizer(cfg, model, world)
    if fused_optimizers:
        notes.append("embeddings: row-wise Adagrad fused into the lookups' backward")
    optimizer = build_optimizer(cfg, model)
    eval_source = make_source(cfg, stream=EVAL_STREAM)
    checkpointer = None
    if cfg.checkpoint.folder:
        record = resume_record(cfg, batches.source)
        checkpointer = Checkpointer(
            cfg.checkpoint.folder, keep=cfg.checkpoint.keep, record=record,
            async_save=cfg.checkpoint.async_save,
        )  # fmt: skip
        # the parameters, and AdamW's two moments of each (created at the first step)
        checkpointer.check_folder(needed_bytes=3 * state_bytes(model.state_dict()))
    torch.manual_seed(cfg.seed + 1 + rank)  # the training stream of random numbers, per rank
    guard = FiniteGuard(cfg, device=device, world=world)
    return Run(
        cfg, device, rank, world, model, optimizer, batches, eval_source, checkpointer, notes,
        fused_optimizers, guard, Supervision(),
    )  # fmt: skip
