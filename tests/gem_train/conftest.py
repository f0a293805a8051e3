"""Small configurations shared by the trainer's tests (seconds on a 2-core CPU)."""

import pytest
from gem_train.config import apply_overrides, named_config

SMALL = {
    "steps": "6",
    "model.d_model": "32",
    "model.n_heads": "1",
    "model.n_layers": "1",
    "model.ffn_hidden": "32",
    "model.mlp_hidden": "32",
    "model.emb_dim": "8",
    "model.item_vocab": "200",
    "model.user_vocab": "100",
    "model.embeddings": "native",
    "data.batch_size": "8",
    "data.sub_batch_size": "4",
    "data.median_len": "8",
    "data.max_len": "64",
    "data.eval_batches": "2",
    "metrics.progress": "false",
    "metrics.log_every": "2",
}


def small_config(**overrides):
    """The tiny config shrunk further; ``overrides`` use ``section__field`` for ``section.field``."""
    flags = dict(SMALL)
    flags.update({k.replace("__", "."): str(v) for k, v in overrides.items()})
    return apply_overrides(named_config("tiny"), flags)


@pytest.fixture
def small():
    return small_config


def small_flags(**overrides) -> list[str]:
    """The same shrunken config as command-line flags."""
    flags = dict(SMALL)
    flags.update({k.replace("__", "."): str(v) for k, v in overrides.items()})
    return [arg for name, value in flags.items() for arg in (f"--{name}", value)]


@pytest.fixture
def flags():
    return small_flags
