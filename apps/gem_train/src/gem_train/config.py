"""Training configuration: one dataclass per concern, composed into ``TrainConfig``.

Every field of every section is a command-line flag named ``--<section>.<field>`` (``--model.d_model
256``, ``--optim.lr=3e-3``); a few common ones also have a short form (``--steps``, ``--seed``,
``--device``, ``--summary-json``). A run starts from a named config (``tiny``, the CPU default;
``gem-small``, one H200; ``gem-large``, plan only), then flags override single fields. Values are
converted by the field's type and every section checks itself in ``validate``, on construction
(``__post_init__``) and again when flags are applied; a bad value raises ``ConfigError`` whose
message names the field (``model.d_model``) and says what was expected.

Every numeric field declares its range where it is defined (``opt(..., at_least=1)``) and one
generic check enforces it: the value has the field's type (an ``int`` field holds an integer, a
``float`` field a number), a float is finite (NaN and infinities are refused everywhere: none of
these fields has a meaning for them), and the value lies in the declared range. Checks that relate
several fields (``model.d_model`` divisible by ``model.n_heads``) and choices stay in ``validate``.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from gem_loadbalance.workloads import WORKLOADS

from gem_train.config_fields import ConfigError, check_numbers, opt, require, require_choice

FLEX_BACKENDS = ("auto", "compiled", "eager", "dense")  # see gem_train.model.flex


@dataclass
class ModelConfig:
    d_model: int = opt(64, "width of the sequence tower", at_least=1)
    n_layers: int = opt(2, "number of history self-attention blocks", at_least=0)
    n_heads: int = opt(2, "attention heads (head dim = d_model / n_heads)", at_least=1)
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
    flex_bwd_stages: int = opt(
        0,
        "software-pipeline stages of the compiled FlexAttention backward (0: inductor's "
        "choice; 1 or 2 where its choice needs more shared memory than the GPU has)",
        at_least=0,
    )
    jagged_schedule: str = opt(
        "per_sequence",
        "how model.attention=jagged cuts the queries into tiles: per_sequence (a tile holds one "
        "sequence: the kernels' default) or token_tiles (consecutive tokens across sequences, "
        "masked per sequence: for batches of many short histories)",
    )
    block_size: int = opt(64, "BlockAttention block length in tokens", at_least=1)
    rope_theta: float = opt(10000.0, "BlockAttention RoPE base", above=0)
    rel_bias_radius: int = opt(
        32,
        "relative-position bias buckets on each side (R); 0: no bias (a one-bucket bias adds one "
        "constant per head to every score, which softmax ignores)",
        at_least=0,
    )
    ffn: str = opt("swiglu", "feed-forward of each block: swiglu or moe")
    ffn_hidden: int = opt(128, "SwiGLU hidden width (per expert for moe)", at_least=1)
    fused_swiglu: bool = opt(
        True, "the SwiGLU gate in one Triton pass each way on CUDA (false: PyTorch's silu and ⊙)"
    )
    n_experts: int = opt(4, "experts per MoE layer", at_least=1)
    top_k: int = opt(2, "experts each token is routed to", at_least=1)
    moe_capacity_factor: float = opt(
        0.0,
        "MoE slots per expert as a multiple of an even share (0: never drop a token)",
        at_least=0,
    )
    pma_seeds: int = opt(2, "PMA pooling seeds (pooled vectors per sample)", at_least=1)
    interaction_layers: int = opt(
        2, "DCN-v2 cross layers over the concatenated features", at_least=0
    )
    mlp_hidden: int = opt(128, "hidden width of the top MLP", at_least=1)
    emb_dim: int = opt(16, "embedding dimension of every sparse feature", at_least=1)
    item_vocab: int = opt(
        500, "items (history tokens and candidate ads share this table)", at_least=1
    )
    category_vocab: int = opt(32, "item categories", at_least=1)
    action_vocab: int = opt(4, "action types of history events", at_least=1)
    time_buckets: int = opt(16, "log2 buckets of event age", at_least=1)
    user_vocab: int = opt(200, "user ids", at_least=1)
    segment_vocab: int = opt(64, "user segments (a multi-hot pooled feature)", at_least=1)
    advertiser_vocab: int = opt(100, "advertisers", at_least=1)
    embeddings: str = opt(
        "auto", "embedding modules: auto (torchrec when importable), torchrec or native"
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field (ranges, choices, head dim)."""
        check_numbers("model", self)
        require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"divisible by model.n_heads={self.n_heads}",
            self.d_model,
        )
        require_choice("model.attention", self.attention, ("jagged", "block", "flex", "padded"))
        if "jagged" in (self.attention, self.pooling_attention) or self.attention == "block":
            require(
                self.head_dim in (32, 64, 128),
                "model.d_model / model.n_heads",
                "a head dim of 32, 64 or 128 for the gem_jagged kernels",
                f"{self.d_model} / {self.n_heads} = {self.d_model / self.n_heads:g}",
            )
        require_choice(
            "model.pooling_attention", self.pooling_attention, ("jagged", "flex", "padded")
        )
        require_choice(
            "model.jagged_schedule", self.jagged_schedule, ("per_sequence", "token_tiles")
        )
        require(
            self.jagged_schedule == "per_sequence" or self.attention == "jagged",
            "model.jagged_schedule",
            "per_sequence unless model.attention=jagged (only the jagged attention has tiles "
            "to choose)",
            self.jagged_schedule,
        )
        require_choice("model.flex_backend", self.flex_backend, FLEX_BACKENDS)
        require_choice("model.ffn", self.ffn, ("swiglu", "moe"))
        require_choice("model.embeddings", self.embeddings, ("auto", "torchrec", "native"))
        require(
            self.top_k <= self.n_experts,
            "model.top_k",
            f"≤ model.n_experts={self.n_experts}",
            self.top_k,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Seeds reach torch.manual_seed and numpy's generators: non-negative and within int64.
MAX_SEED = 2**63 - 1

# The default history lengths are workload J1's (docs/workloads).
_J1 = WORKLOADS["J1"].lengths


@dataclass
class DataConfig:
    source: str = opt("synthetic", "synthetic (planted teacher) or parquet")
    path: str = opt("", "Parquet file or folder (source=parquet)")
    batch_size: int = opt(64, "samples per step on each rank", at_least=1)
    sub_batch_size: int = opt(16, "samples per sub-batch, the unit the shuffler moves", at_least=1)
    median_len: int = opt(
        _J1.median, f"median history length (workload J1: {_J1.median})", at_least=1
    )
    sigma: float = opt(
        _J1.sigma,
        f"log-normal sigma of history lengths (J1: {_J1.sigma}; 0: every history median_len)",
        at_least=0,
    )
    min_len: int = opt(
        _J1.lo, f"shortest history (J1: {_J1.lo}; 0: empty histories are legal)", at_least=0
    )
    max_len: int = opt(
        _J1.hi, f"longest history (J1: {_J1.hi}); never truncated below this", at_least=1
    )
    teacher_strength: float = opt(
        5.0,
        "scale of the planted teacher's logits (signal strength; 0: labels are noise)",
        at_least=0,
    )
    seed: int = opt(
        0,
        "seed of the data stream (the teacher has its own fixed seed)",
        at_least=0,
        at_most=MAX_SEED,
    )
    shuffle: bool = opt(True, "balance batches with gem_loadbalance's Base Batch Shuffling")
    eval_batches: int = opt(16, "held-out batches for the final NE / AUC", at_least=0)
    eval_path: str = opt(
        "",
        "Parquet file or folder of the evaluation's rows (empty: the last data.eval_fraction of "
        "data.path's rows, which training then never reads)",
    )
    eval_fraction: float = opt(
        0.1,
        "the last fraction of data.path's rows held out for the evaluation when data.eval_path "
        "is empty (source=parquet)",
        at_least=0,
        below=1,
    )
    prefetch: int = opt(2, "batches assembled ahead by a background thread (0: none)", at_least=0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field (ranges, choices, length order)."""
        check_numbers("data", self)
        require_choice("data.source", self.source, ("synthetic", "parquet"))
        if self.source == "parquet":
            require(
                bool(self.path),
                "data.path",
                "a Parquet file or folder when data.source=parquet",
                self.path,
            )
        require(
            self.min_len <= self.max_len,
            "data.min_len",
            f"≤ data.max_len={self.max_len}",
            self.min_len,
        )
        require(
            self.batch_size % self.sub_batch_size == 0,
            "data.batch_size",
            f"a multiple of data.sub_batch_size={self.sub_batch_size}",
            self.batch_size,
        )


EMBEDDING_OPTIMIZERS = ("adamw", "rowwise_adagrad")


@dataclass
class OptimConfig:
    lr: float = opt(3e-3, "peak learning rate of AdamW for the dense parameters", above=0)
    embedding_optimizer: str = opt(
        "adamw",
        "adamw: the tables join the dense AdamW (dense table gradients) | rowwise_adagrad: row-wise "
        "Adagrad fused into the lookup's backward, touched rows only (native tables on one process; "
        "torchrec's, sharded on the CPU, under torchrun)",
    )
    embedding_lr: float = opt(
        0.0, "peak learning rate of the embedding tables (0: optim.lr)", at_least=0
    )
    weight_decay: float = opt(
        0.0, "AdamW weight decay (never applied to embeddings or norms)", at_least=0
    )
    beta1: float = opt(0.9, "AdamW beta1", at_least=0, below=1)
    beta2: float = opt(0.98, "AdamW beta2", at_least=0, below=1)
    warmup_steps: int = opt(20, "linear warm-up steps, then cosine decay", at_least=0)
    final_lr_fraction: float = opt(
        0.1, "the cosine decay ends at this fraction of the peak", at_least=0, at_most=1
    )
    grad_clip: float = opt(
        1.0, "clip the dense tower's global gradient norm to this (0: off)", at_least=0
    )
    skip_nonfinite: bool = opt(
        False,
        "skip (and count) a step whose loss or gradients are NaN or infinite, at one host sync "
        "per step (false: stop the run with an error naming the first such step)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field (ranges, choices)."""
        check_numbers("optim", self)
        require_choice("optim.embedding_optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)


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
    dp_replicate: int = opt(
        1, "HSDP replicas of the dense tower (1: plain FSDP over all ranks)", at_least=1
    )
    ep: int = opt(
        1, "expert-parallel group size for model.ffn=moe (divides the shard group)", at_least=1
    )
    ep_max_tokens: int = opt(
        0,
        "history tokens any rank may hold in one batch with ep > 1: sizes every MoE's all-to-all "
        "buffers, the same on all ranks (0: data.batch_size × data.max_len, rounded up to "
        "lowprec.token_multiple; a tighter bound saves memory and expert FLOPs)",
        at_least=0,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field (ranges, choices)."""
        check_numbers("parallel", self)
        require_choice("parallel.dense", self.dense, ("auto", "fsdp", "none"))
        require_choice("parallel.embeddings", self.embeddings, ("auto", "native", "torchrec"))
        require_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))


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
        at_least=0,
    )
    fp8_plan: str = opt(
        "measure",
        "how each linear shape picks fp8 or BF16, once before training and the same on every "
        "rank: measure (rank 0 times both on its GPU at the token counts of a sample batch; the "
        "shape rule on the CPU) or rule (fp8 wherever the kernels take the shape)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field (ranges, choices)."""
        check_numbers("lowprec", self)
        require_choice("lowprec.recipe", self.recipe, ("none", "bf16", "mxfp8", "fp8_rowwise"))
        require_choice("lowprec.fp8_plan", self.fp8_plan, ("measure", "rule"))


@dataclass
class MemoryConfig:
    autoac: bool = opt(False, "plan activation checkpointing with gem_memory's AutoAC")
    budget_gib: float = opt(
        0.0, "activation memory budget for AutoAC in GiB (0: 60% of free)", at_least=0
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field."""
        check_numbers("memory", self)


@dataclass
class CheckpointConfig:
    folder: str = opt("", "checkpoint folder (empty: no checkpoints)")
    every: int = opt(0, "save every this many steps (0: only at the end)", at_least=0)
    keep: int = opt(3, "keep the newest this many checkpoints", at_least=1)
    resume: bool = opt(True, "resume from the newest checkpoint in folder if there is one")
    async_save: bool = opt(
        False,
        "save with DCP's async_save: the state is copied to host memory, then written, hashed and "
        "given its manifest in the background while training goes on; the next save and the end "
        "of the run wait for it (false: training waits for each save)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field."""
        check_numbers("checkpoint", self)


@dataclass
class MetricsConfig:
    log_every: int = opt(10, "steps between logged windows of loss / NE / AUC / QPS", at_least=1)
    tensorboard: str = opt("", "TensorBoard log folder (empty: none)")
    summary_json: str = opt("", "write a JSON summary of the run here (empty: none)")
    progress: bool = opt(True, "show a rich progress bar on rank 0")
    peak_tflops: float = opt(
        0.0, "peak dense BF16 TFLOP/s for MFU (0: from the device name)", at_least=0
    )
    profile_trace: str = opt(
        "",
        "write a torch.profiler Chrome trace of metrics.profile_steps steps from "
        "metrics.profile_first_step into this folder, one file per rank (empty: none)",
    )
    profile_first_step: int = opt(
        5, "the first step the trace records, counted from 1 like the logged steps", at_least=1
    )
    profile_steps: int = opt(2, "how many steps the trace records", at_least=1)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the first bad field."""
        check_numbers("metrics", self)


@dataclass
class TrainConfig:
    name: str = opt("tiny", "the named config this run started from")
    steps: int = opt(300, "optimizer steps", at_least=1)
    seed: int = opt(0, "seed of the model initialisation", at_least=0, at_most=MAX_SEED)
    device: str = opt("auto", "auto (cuda when present), cpu or cuda")
    compile: bool = opt(False, "torch.compile the dense blocks")
    cpu_threads: int = opt(
        1,
        "intra-op threads on the CPU (0: torch's default); the model's many small jagged ops "
        "gain nothing from more, and spinning threads collapse on a shared machine",
        at_least=0,
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lowprec: LowPrecConfig = field(default_factory=LowPrecConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "TrainConfig":
        """Check every field of every section; returns ``self``.

        Raises:
            ConfigError: naming the first bad field and what it must be.
        """
        check_numbers("", self)
        require_choice("device", self.device, ("auto", "cpu", "cuda"))
        for section in SECTIONS:
            getattr(self, section).validate()
        require(
            not (self.optim.skip_nonfinite and self.optim.embedding_optimizer == "rowwise_adagrad"),
            "optim.skip_nonfinite",
            "false with optim.embedding_optimizer=rowwise_adagrad (the fused Adagrad updates the "
            "tables inside the backward, before a step can be skipped)",
            self.optim.skip_nonfinite,
        )
        require(
            not self.metrics.profile_trace or self.metrics.profile_first_step <= self.steps,
            "metrics.profile_first_step",
            f"≤ steps={self.steps} with metrics.profile_trace set (the trace would record nothing)",
            self.metrics.profile_first_step,
        )
        return self


SECTIONS = ("model", "data", "optim", "parallel", "lowprec", "memory", "checkpoint", "metrics")
SHORT_FLAGS = {
    "summary-json": "metrics.summary_json",
    "tensorboard": "metrics.tensorboard",
    "profile-trace": "metrics.profile_trace",
}


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
