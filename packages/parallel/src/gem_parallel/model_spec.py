"""What the planner needs to know about a model: parameter counts, shapes, bytes, work per step.

A GEM-like recommendation model has two halves. The *sparse* half is embedding tables: up to
trillions of parameters, looked up by the ids of each sample's features and exchanged with an
all-to-all of pooled embeddings (``samples_per_gpu · num_sparse_features · embedding_dim``
values per GPU per step). The *dense* half is a transformer-like stack of ``num_layers`` layers of
width ``d_model`` (``dense_params`` parameters), ``moe_layers`` of which carry a mixture of
``num_experts`` feed-forward experts (two matrices ``d_model x expert_hidden`` each), routed
``top_k`` per token.

Named specs: ``gem-small`` fits one GPU (``d_model`` 1024, as the trainer's ``gem-small``);
``gem-large`` has 1.2·10¹² sparse and ~5.9·10⁹ dense parameters (1.9·10⁹ outside
the experts, 4·10⁹ in 16 experts x 12 MoE layers). A spec also loads from a JSON file
whose keys are this dataclass's fields (``ModelSpec.from_file``), or from a name or a path
(``ModelSpec.load``).
"""

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model: parameter counts, shapes and work per GPU.

    ``dense_params`` (excluding experts), ``num_layers``, ``d_model``; experts: ``num_experts``,
    ``moe_layers``, ``expert_hidden``, ``top_k``; sparse: ``sparse_params`` (embedding values),
    ``embedding_dim``, ``num_sparse_features``; per GPU and step: ``samples_per_gpu``,
    ``tokens_per_gpu``, ``activation_bytes_per_token``; bytes: optimizer state per dense
    parameter, dense weights on the wire, gradient reduction, per sparse value, per activation
    value. ``ValueError`` for a negative, NaN, infinite or non-numeric field, a zero count that must be ≥ 1, or
    inconsistent experts.
    """

    name: str
    dense_params: int
    num_layers: int
    d_model: int
    num_experts: int = 0
    moe_layers: int = 0
    expert_hidden: int = 0
    top_k: int = 1
    sparse_params: int = 0
    embedding_dim: int = 128
    num_sparse_features: int = 0
    samples_per_gpu: int = 1
    tokens_per_gpu: int = 1
    activation_bytes_per_token: float = 0.0
    dense_state_bytes_per_param: float = 16.0  # fp32 master + fp32 grad + Adam's two moments
    dense_compute_bytes: int = 2  # bf16 weights on the wire and in the gathered copy
    grad_reduce_bytes: int = 4  # fp32 gradient reduction
    sparse_bytes_per_param: float = 2.0  # fp16 rows; row-wise optimizer state is ~1/dim of that
    activation_compute_bytes: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"name must be a non-empty string, got {value!r}")
            elif (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                # NaN passes every comparison test as false, so finiteness is checked first: a
                # NaN size would make every plan's memory NaN and none of them fit.
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
        for positive in ("num_layers", "d_model", "top_k", "samples_per_gpu", "tokens_per_gpu"):
            if getattr(self, positive) < 1:
                raise ValueError(f"{positive} must be >= 1, got {getattr(self, positive)}")
        if self.num_experts and not (self.moe_layers and self.expert_hidden):
            raise ValueError("num_experts > 0 needs moe_layers > 0 and expert_hidden > 0")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.moe_layers > self.num_layers:
            raise ValueError(f"moe_layers={self.moe_layers} exceeds num_layers={self.num_layers}")

    # -- derived quantities ------------------------------------------------------------------
    @property
    def params_per_expert(self) -> int:
        """Parameters of one expert in one MoE layer (two ``d_model x expert_hidden`` matrices)."""
        return 2 * self.d_model * self.expert_hidden

    @property
    def expert_params(self) -> int:
        """Parameters of all experts of all MoE layers."""
        return self.moe_layers * self.num_experts * self.params_per_expert

    @property
    def total_dense_params(self) -> int:
        """Dense parameters, experts included."""
        return self.dense_params + self.expert_params

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token runs through (dense plus its ``top_k`` experts per MoE layer)."""
        return self.dense_params + self.moe_layers * self.top_k * self.params_per_expert

    @property
    def train_flops_per_gpu(self) -> float:
        """Forward + backward FLOPs of one step on one GPU (6 per active parameter per token)."""
        return 6.0 * self.active_params_per_token * self.tokens_per_gpu

    def describe(self) -> str:
        """One line: the name and the parameter counts."""
        return (
            f"{self.name}: {self.sparse_params:.3g} sparse, {self.dense_params:.3g} "
            f"dense + {self.expert_params:.3g} in {self.num_experts} experts x "
            f"{self.moe_layers} layers (top-{self.top_k}), d_model {self.d_model}"
        )

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def named(cls, name: str) -> "ModelSpec":
        """A spec of ``NAMED_SPECS`` ("gem-small", "gem-large"); ``ValueError`` otherwise."""
        if name not in NAMED_SPECS:
            raise ValueError(f"unknown model {name!r}; named specs are {sorted(NAMED_SPECS)}")
        return NAMED_SPECS[name]

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """A spec from its fields; ``ValueError`` names unknown fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelSpec fields {unknown}; known fields are {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelSpec":
        """A spec from a JSON object of its fields (``name`` defaults to the file's stem)."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of ModelSpec fields")
        data.setdefault("name", Path(path).stem)
        return cls.from_dict(data)

    @classmethod
    def load(cls, name_or_path: str) -> "ModelSpec":
        """A named spec, or a JSON file when the argument is a path to one."""
        if name_or_path in NAMED_SPECS:
            return NAMED_SPECS[name_or_path]
        if Path(name_or_path).is_file():
            return cls.from_file(name_or_path)
        raise ValueError(
            f"model {name_or_path!r} is neither a named spec {sorted(NAMED_SPECS)} nor a JSON file"
        )

    def to_dict(self) -> dict:
        """The fields as a dict (``from_dict`` inverts it)."""
        return dataclasses.asdict(self)


NAMED_SPECS = {
    "gem-small": ModelSpec(
        name="gem-small",
        dense_params=8 * 12 * 1024 * 1024,
        num_layers=8,
        d_model=1024,
        num_experts=8,
        moe_layers=4,
        expert_hidden=2048,
        top_k=2,
        sparse_params=2_000_000_000,
        embedding_dim=128,
        num_sparse_features=64,
        samples_per_gpu=256,
        tokens_per_gpu=65_536,
        activation_bytes_per_token=8 * 1024 * 16,
    ),
    "gem-large": ModelSpec(
        name="gem-large",
        dense_params=24 * 12 * 2560 * 2560,
        num_layers=24,
        d_model=2560,
        num_experts=16,
        moe_layers=12,
        expert_hidden=4096,
        top_k=2,
        sparse_params=1_200_000_000_000,
        embedding_dim=256,
        num_sparse_features=512,
        samples_per_gpu=512,
        tokens_per_gpu=8_192,
        activation_bytes_per_token=24 * 2560 * 4,
    ),
}
