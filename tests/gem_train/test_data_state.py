"""The training stream's saved state is checked: a key missing or a state over other data is named."""

import pytest
from gem_train.data.loader import TrainBatches
from gem_train.data.synthetic import EVAL_STREAM, SyntheticStream


def _stream(cfg, **source):
    return TrainBatches(SyntheticStream(cfg.data, cfg.model, **source), cfg.data, cfg.model)


def _state_after(cfg, batches=2):
    stream = _stream(cfg)
    for _ in range(batches):
        next(stream)
    return stream.state_dict()


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_missing_key_is_named(small, shuffle):
    cfg = small(data__shuffle=shuffle)
    state = _state_after(cfg)
    del state["produced"]
    with pytest.raises(ValueError, match="'produced'"):
        _stream(cfg).load_state_dict(state)


@pytest.mark.parametrize("produced", [-1, "3", 1.5])
def test_a_corrupt_position_is_named(small, produced):
    cfg = small(data__shuffle=False)
    state = _state_after(cfg) | {"produced": produced}
    with pytest.raises(ValueError, match="produced"):
        _stream(cfg).load_state_dict(state)


def test_a_state_over_another_source_is_refused(small):
    """Same shapes and configuration, other samples: the shuffler's source digest differs."""
    cfg = small(data__shuffle=True)
    state = _state_after(cfg)
    resumed = _stream(cfg, stream=EVAL_STREAM)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="source_digest"):
        next(resumed)
