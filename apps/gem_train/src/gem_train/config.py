"""Training configuration: one dataclass per concern, composed into ``TrainConfig``.

Every field of every section is a command-line flag named ``--<section>.<field>`` (``--model.d_model
256``, ``--optim.lr=3e-3``); a few common ones also have a short form (``--steps``, ``--seed``,
``--device``, ``--summary-json``). A run starts from a named config (``tiny``, the CPU default;
``gem-small``, one H200; ``gem-large``, plan only), then flags override single fields. Values are
converted by the field's type and every section checks itself in ``validate``; a bad value raises
``ConfigError`` whose message names the field (``model.d_model``) and says what was expected.
"""

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from gem_loadbalance.workloads import WORKLOADS

FLEX_BACKENDS = ("auto", "compiled", "eager", "dense")  # see gem_train.model.flex


class ConfigError(ValueError):
    """A configuration value is malformed or inconsistent; the message names the field."""


def opt(default, help: str):
    """A dataclass field with a help text (shown by ``gem-train --help``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _require(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _choice(name: str, value: Any, choices: tuple) -> None:
    _require(value in choices, name, f"one of {choices}", value)


@dataclass
class ModelConfig:
    d_model: int = opt(64, "width of the sequence tower")
    n_layers: int = opt(2, "number of history self-attention blocks")
    n_heads: int = opt(2, "attention heads (head dim = d_model / n_heads)")
    attention: str = opt(
        "jagged",
        "history self-attention: jagged (gem_jagged, relative bias), block (gem_jagged "
        "BlockAttention with RoPE, for long histories), flex (PyTorch FlexAttention on the packed "
        "batch, document + causal mask, the bias as a score_mod) or padded (PyTorch SDPA on a "
        "padded batch)",
    )
    pooling_attention: str = opt(
        "jagged",
        "PMA and candidate cross-attention: jagged (gem_jagged.gdpa), flex (PyTorch FlexAttention, "
        "document mask; softmax in place of GDPA's SiLU) or padded (PyTorch GDPA)",
    )
    flex_backend: str = opt(
        "auto",
        "how the flex attentions run: compiled (torch.compile'd flex_attention), eager (no "
        "backward on the CPU), dense (the same masks on the full score matrix, plain PyTorch) or "
        "auto (compiled on CUDA, dense elsewhere)",
    )
    block_size: int = opt(64, "BlockAttention block length in tokens")
    rope_theta: float = opt(10000.0, "BlockAttention RoPE base")
    rel_bias_radius: int = opt(32, "relative-position bias buckets on each side (R)")
    ffn: str = opt("swiglu", "feed-forward of each block: swiglu or moe")
    ffn_hidden: int = opt(128, "SwiGLU hidden width (per expert for moe)")
    fused_swiglu: bool = opt(
        True, "the SwiGLU gate in one Triton pass each way on CUDA (false: PyTorch's silu and ⊙)"
    )
    n_experts: int = opt(4, "experts per MoE layer")
    top_k: int = opt(2, "experts each token is routed to")
    moe_capacity_factor: float = opt(
        0.0, "MoE slots per expert as a multiple of an even share (0: never drop a token)"
    )
    pma_seeds: int = opt(2, "PMA pooling seeds (pooled vectors per sample)")
    interaction_layers: int = opt(2, "DCN-v2 cross layers over the concatenated features")
    mlp_hidden: int = opt(128, "hidden width of the top MLP")
    emb_dim: int = opt(16, "embedding dimension of every sparse feature")
    item_vocab: int = opt(500, "items (history tokens and candidate ads share this table)")
    category_vocab: int = opt(32, "item categories")
    action_vocab: int = opt(4, "action types of history events")
    time_buckets: int = opt(16, "log2 buckets of event age")
    user_vocab: int = opt(200, "user ids")
    segment_vocab: int = opt(64, "user segments (a multi-hot pooled feature)")
    advertiser_vocab: int = opt(100, "advertisers")
    embeddings: str = opt(
        "auto", "embedding modules: auto (torchrec when importable), torchrec or native"
    )

    def validate(self) -> None:
        for name in (
            "d_model n_heads block_size ffn_hidden n_experts top_k pma_seeds mlp_hidden "
            "emb_dim item_vocab category_vocab action_vocab time_buckets user_vocab segment_vocab "
            "advertiser_vocab"
        ).split():
            value = getattr(self, name)
            _require(value >= 1, f"model.{name}", "a positive integer", value)
        _require(self.n_layers >= 0, "model.n_layers", "≥ 0", self.n_layers)
        _require(
            self.interaction_layers >= 0, "model.interaction_layers", "≥ 0", self.interaction_layers
        )
        _require(self.rel_bias_radius >= 0, "model.rel_bias_radius", "≥ 0", self.rel_bias_radius)
        _require(
            self.moe_capacity_factor >= 0,
            "model.moe_capacity_factor",
            "≥ 0",
            self.moe_capacity_factor,
        )
        _require(self.rope_theta > 0, "model.rope_theta", "positive", self.rope_theta)
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"divisible by model.n_heads={self.n_heads}",
            self.d_model,
        )
        _choice("model.attention", self.attention, ("jagged", "block", "flex", "padded"))
        if "jagged" in (self.attention, self.pooling_attention) or self.attention == "block":
            _require(
                self.head_dim in (32, 64, 128),
                "model.d_model / model.n_heads",
                "a head dim of 32, 64 or 128 for the gem_jagged kernels",
                f"{self.d_model} / {self.n_heads} = {self.d_model / self.n_heads:g}",
            )
        _choice("model.pooling_attention", self.pooling_attention, ("jagged", "flex", "padded"))
        _choice("model.flex_backend", self.flex_backend, FLEX_BACKENDS)
        _choice("model.ffn", self.ffn, ("swiglu", "moe"))
        _choice("model.embeddings", self.embeddings, ("auto", "torchrec", "native"))
        _require(
            self.top_k <= self.n_experts,
            "model.top_k",
            f"≤ model.n_experts={self.n_experts}",
            self.top_k,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# The default history lengths are workload J1's (docs/workloads).
_J1 = WORKLOADS["J1"].lengths


@dataclass
class DataConfig:
    source: str = opt("synthetic", "synthetic (planted teacher) or parquet")
    path: str = opt("", "Parquet file or folder (source=parquet)")
    batch_size: int = opt(64, "samples per step on each rank")
    sub_batch_size: int = opt(16, "samples per sub-batch, the unit the shuffler moves")
    median_len: int = opt(_J1.median, f"median history length (workload J1: {_J1.median})")
    sigma: float = opt(_J1.sigma, f"log-normal sigma of history lengths (J1: {_J1.sigma})")
    min_len: int = opt(_J1.lo, f"shortest history (J1: {_J1.lo})")
    max_len: int = opt(_J1.hi, f"longest history (J1: {_J1.hi}); never truncated below this")
    teacher_strength: float = opt(5.0, "scale of the planted teacher's logits (signal strength)")
    seed: int = opt(0, "seed of the data stream (the teacher has its own fixed seed)")
    shuffle: bool = opt(True, "balance batches with gem_loadbalance's Base Batch Shuffling")
    eval_batches: int = opt(16, "held-out batches for the final NE / AUC")
    prefetch: int = opt(2, "batches assembled ahead by a background thread (0: none)")

    def validate(self) -> None:
        _choice("data.source", self.source, ("synthetic", "parquet"))
        if self.source == "parquet":
            _require(
                bool(self.path),
                "data.path",
                "a Parquet file or folder when data.source=parquet",
                self.path,
            )
        _require(self.min_len >= 0, "data.min_len", "≥ 0 (empty histories are legal)", self.min_len)
        for name in ("batch_size", "sub_batch_size", "median_len", "max_len"):
            _require(
                getattr(self, name) >= 1, f"data.{name}", "a positive integer", getattr(self, name)
            )
        _require(self.eval_batches >= 0, "data.eval_batches", "≥ 0", self.eval_batches)
        _require(self.prefetch >= 0, "data.prefetch", "≥ 0", self.prefetch)
        _require(self.sigma >= 0, "data.sigma", "≥ 0", self.sigma)
        _require(
            self.min_len <= self.max_len,
            "data.min_len",
            f"≤ data.max_len={self.max_len}",
            self.min_len,
        )
        _require(
            self.batch_size % self.sub_batch_size == 0,
            "data.batch_size",
            f"a multiple of data.sub_batch_size={self.sub_batch_size}",
            self.batch_size,
        )


EMBEDDING_OPTIMIZERS = ("adamw", "rowwise_adagrad")


@dataclass
class OptimConfig:
    lr: float = opt(3e-3, "peak learning rate of AdamW for the dense parameters")
    embedding_optimizer: str = opt(
        "adamw",
        "adamw: the tables join the dense AdamW (dense table gradients) | rowwise_adagrad: row-wise "
        "Adagrad fused into the lookup's backward, touched rows only (native embeddings, one process)",
    )
    embedding_lr: float = opt(0.0, "peak learning rate of the embedding tables (0: optim.lr)")
    weight_decay: float = opt(0.0, "AdamW weight decay (never applied to embeddings or norms)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.98, "AdamW beta2")
    warmup_steps: int = opt(20, "linear warm-up steps, then cosine decay")
    final_lr_fraction: float = opt(0.1, "the cosine decay ends at this fraction of the peak")
    grad_clip: float = opt(1.0, "clip the dense tower's global gradient norm to this (0: off)")

    def validate(self) -> None:
        _require(self.lr > 0, "optim.lr", "positive", self.lr)
        _choice("optim.embedding_optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)
        _require(self.embedding_lr >= 0, "optim.embedding_lr", "≥ 0", self.embedding_lr)
        _require(self.weight_decay >= 0, "optim.weight_decay", "≥ 0", self.weight_decay)
        _require(0 <= self.beta1 < 1, "optim.beta1", "in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, "optim.beta2", "in [0, 1)", self.beta2)
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "≥ 0", self.warmup_steps)
        _require(
            0 <= self.final_lr_fraction <= 1,
            "optim.final_lr_fraction",
            "in [0, 1]",
            self.final_lr_fraction,
        )
        _require(self.grad_clip >= 0, "optim.grad_clip", "≥ 0", self.grad_clip)


@dataclass
class ParallelConfig:
    dense: str = opt(
        "auto",
        "dense parallelism under torchrun: auto (fsdp with several processes, none alone), "
        "fsdp (gem_parallel FSDP2/HSDP), none",
    )
    embeddings: str = opt(
        "auto", "embedding sharding under torchrun: auto, native or torchrec (gem_parallel)"
    )
    backend: str = opt(
        "auto", "process-group backend: auto (nccl on CUDA, gloo on CPU), gloo, nccl"
    )
    dp_replicate: int = opt(1, "HSDP replicas of the dense tower (1: plain FSDP over all ranks)")
    ep: int = opt(1, "expert-parallel group size for model.ffn=moe (divides the shard group)")
    ep_max_tokens: int = opt(
        0,
        "history tokens any rank may hold in one batch with ep > 1: sizes every MoE's all-to-all "
        "buffers, the same on all ranks (0: data.batch_size × data.max_len, rounded up to "
        "lowprec.token_multiple; a tighter bound saves memory and expert FLOPs)",
    )

    def validate(self) -> None:
        _choice("parallel.dense", self.dense, ("auto", "fsdp", "none"))
        _choice("parallel.embeddings", self.embeddings, ("auto", "native", "torchrec"))
        _choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _require(
            self.dp_replicate >= 1, "parallel.dp_replicate", "a positive integer", self.dp_replicate
        )
        _require(self.ep >= 1, "parallel.ep", "a positive integer", self.ep)
        _require(self.ep_max_tokens >= 0, "parallel.ep_max_tokens", "≥ 0", self.ep_max_tokens)


@dataclass
class LowPrecConfig:
    recipe: str = opt(
        "none",
        "gem_lowprec recipe for the dense linears: none, bf16, mxfp8 or fp8_rowwise",
    )
    autocast_bf16: bool = opt(False, "run the model under bf16 autocast (CUDA)")
    token_multiple: int = opt(
        0,
        "append dummy samples (out of loss and metrics) so that each batch's token count is a "
        "multiple of this and its sample count of 16: aligned fp8 GEMMs, few distinct shapes (0: off)",
    )

    def validate(self) -> None:
        _choice("lowprec.recipe", self.recipe, ("none", "bf16", "mxfp8", "fp8_rowwise"))
        _require(self.token_multiple >= 0, "lowprec.token_multiple", "≥ 0", self.token_multiple)


@dataclass
class MemoryConfig:
    autoac: bool = opt(False, "plan activation checkpointing with gem_memory's AutoAC")
    budget_gib: float = opt(0.0, "activation memory budget for AutoAC in GiB (0: 60% of free)")

    def validate(self) -> None:
        _require(self.budget_gib >= 0, "memory.budget_gib", "≥ 0", self.budget_gib)


@dataclass
class CheckpointConfig:
    folder: str = opt("", "checkpoint folder (empty: no checkpoints)")
    every: int = opt(0, "save every this many steps (0: only at the end)")
    keep: int = opt(3, "keep the newest this many checkpoints")
    resume: bool = opt(True, "resume from the newest checkpoint in folder if there is one")

    def validate(self) -> None:
        _require(self.every >= 0, "checkpoint.every", "≥ 0", self.every)
        _require(self.keep >= 1, "checkpoint.keep", "≥ 1", self.keep)


@dataclass
class MetricsConfig:
    log_every: int = opt(10, "steps between logged windows of loss / NE / AUC / QPS")
    tensorboard: str = opt("", "TensorBoard log folder (empty: none)")
    summary_json: str = opt("", "write a JSON summary of the run here (empty: none)")
    progress: bool = opt(True, "show a rich progress bar on rank 0")
    peak_tflops: float = opt(0.0, "peak dense BF16 TFLOP/s for MFU (0: from the device name)")

    def validate(self) -> None:
        _require(self.log_every >= 1, "metrics.log_every", "a positive integer", self.log_every)
        _require(self.peak_tflops >= 0, "metrics.peak_tflops", "≥ 0", self.peak_tflops)


@dataclass
class TrainConfig:
    name: str = opt("tiny", "the named config this run started from")
    steps: int = opt(300, "optimizer steps")
    seed: int = opt(0, "seed of the model initialisation")
    device: str = opt("auto", "auto (cuda when present), cpu or cuda")
    compile: bool = opt(False, "torch.compile the dense blocks")
    cpu_threads: int = opt(
        1,
        "intra-op threads on the CPU (0: torch's default); the model's many small jagged ops "
        "gain nothing from more, and spinning threads collapse on a shared machine",
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lowprec: LowPrecConfig = field(default_factory=LowPrecConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> "TrainConfig":
        _require(self.steps >= 1, "steps", "a positive integer", self.steps)
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _require(self.cpu_threads >= 0, "cpu_threads", "≥ 0", self.cpu_threads)
        for section in SECTIONS:
            getattr(self, section).validate()
        _require(
            self.optim.embedding_optimizer != "rowwise_adagrad"
            or self.model.embeddings != "torchrec",
            "optim.embedding_optimizer",
            "adamw with model.embeddings=torchrec (the fused row-wise Adagrad serves the native "
            "tables; set model.embeddings=native)",
            self.optim.embedding_optimizer,
        )
        return self


SECTIONS = ("model", "data", "optim", "parallel", "lowprec", "memory", "checkpoint", "metrics")
SHORT_FLAGS = {"summary-json": "metrics.summary_json", "tensorboard": "metrics.tensorboard"}


def _tiny() -> TrainConfig:
    cfg = TrainConfig(name="tiny", steps=150)
    # The J1 length shape with the median scaled down 16×, so that 2 CPU cores train in seconds.
    cfg.data = DataConfig(
        batch_size=32, sub_batch_size=16, median_len=32, min_len=2, max_len=1024, eval_batches=32
    )
    return cfg


def _gem_small() -> TrainConfig:
    cfg = TrainConfig(name="gem-small", steps=200, device="cuda")
    cfg.model = ModelConfig(
        d_model=1024, n_layers=4, n_heads=8, ffn_hidden=2816, pma_seeds=4, interaction_layers=3,
        mlp_hidden=1024, emb_dim=128, item_vocab=1_000_000, category_vocab=4096,
        action_vocab=16, time_buckets=32, user_vocab=1_000_000, segment_vocab=10_000,
        advertiser_vocab=100_000, embeddings="native",
    )  # fmt: skip
    cfg.data = DataConfig(batch_size=64, sub_batch_size=16)  # J1 lengths
    # 2.1M rows of 128: a dense AdamW step reads and writes them all (about 7 ms of an 80 ms
    # step on the H200); the fused row-wise Adagrad touches a batch's rows only. Its rate is the
    # best of 0.003 / 0.02 / 0.1 on tiny (docs/history/performance.md has the sweep).
    cfg.optim = OptimConfig(
        lr=1e-3, warmup_steps=50, embedding_optimizer="rowwise_adagrad", embedding_lr=0.1
    )
    cfg.lowprec = LowPrecConfig(recipe="mxfp8", autocast_bf16=True, token_multiple=4096)
    cfg.memory = MemoryConfig(autoac=True)
    cfg.metrics = MetricsConfig(log_every=20)
    return cfg


def _gem_large() -> TrainConfig:
    cfg = _gem_small()
    cfg.name = "gem-large"
    cfg.model = ModelConfig(
        d_model=4096, n_layers=24, n_heads=32, attention="block", ffn="moe", ffn_hidden=8192,
        n_experts=64, top_k=2, pma_seeds=32, interaction_layers=4, mlp_hidden=4096, emb_dim=256,
        item_vocab=2_000_000_000, category_vocab=100_000, action_vocab=64, time_buckets=64,
        user_vocab=3_000_000_000, segment_vocab=1_000_000, advertiser_vocab=10_000_000,
    )  # fmt: skip
    cfg.data = DataConfig(
        batch_size=512, sub_batch_size=64, median_len=2048, min_len=256, max_len=20000, sigma=1.0
    )
    return cfg


NAMED_CONFIGS = {
    "tiny": (
        "the CPU default: 2 blocks of d_model 64, batch 32, 150 steps; under a minute on 2 cores",
        _tiny,
    ),
    "gem-small": ("one H200, d_model 1024, J1 lengths, every optimisation on", _gem_small),
    "gem-large": (
        "plan only (gem-train plan): 24 layers of d_model 4096 with 64-expert MoE",
        _gem_large,
    ),
}
PLAN_ONLY = ("gem-large",)


def named_config(name: str) -> TrainConfig:
    if name not in NAMED_CONFIGS:
        raise ConfigError(f"config must be one of {tuple(NAMED_CONFIGS)}, got {name!r}")
    return NAMED_CONFIGS[name][1]()


def fields_of(cfg) -> dict[str, tuple[Any, type, str]]:
    """``{"model.d_model": (owner, type, help), "steps": (...), ...}`` for every scalar field."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in SECTIONS:
            section = getattr(cfg, f.name)
            hints = get_type_hints(type(section))
            for g in dataclasses.fields(section):
                out[f"{f.name}.{g.name}"] = (section, hints[g.name], g.metadata.get("help", ""))
        else:
            out[f.name] = (cfg, get_type_hints(type(cfg))[f.name], f.metadata.get("help", ""))
    return out


def _convert(name: str, kind: type, text: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be a boolean (true/false), got {text!r}")
    try:
        return kind(text.replace("_", "")) if kind is int else kind(text)
    except ValueError:
        raise ConfigError(
            f"{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def apply_overrides(cfg: TrainConfig, overrides: dict[str, str]) -> TrainConfig:
    """Set ``{"model.d_model": "256", ...}`` on ``cfg`` (converted by type), then validate."""
    known = fields_of(cfg)
    for name, text in overrides.items():
        name = SHORT_FLAGS.get(name, name)
        if name not in known:
            raise ConfigError(f"unknown field {name!r}; `gem-train --help` lists every field")
        owner, kind, _ = known[name]
        setattr(owner, name.split(".")[-1], _convert(name, kind, text))
    return cfg.validate()


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
