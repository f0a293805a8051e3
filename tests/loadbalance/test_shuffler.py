"""BaseBatchShuffler: every sample exactly once, bounded delay, determinism and exact resume."""

import json

import numpy as np
import pytest
from gem_loadbalance import BaseBatchShuffler
from hypothesis import given
from hypothesis import strategies as st


def make_source(sub_batch_sizes, seed):
    """Sub-batches of (stream position, cost) samples with heavy-tailed costs."""
    rng = np.random.default_rng(seed)
    total = sum(sub_batch_sizes)
    costs = np.exp(rng.normal(0.0, 1.5, size=total)).round(3).tolist()
    source, position = [], 0
    for size in sub_batch_sizes:
        source.append([(position + i, costs[position + i]) for i in range(size)])
        position += size
    return source


def sample_cost(sample):
    return sample[1]


settings_strategy = st.fixed_dictionaries(
    {
        "sub_batch_sizes": st.lists(st.integers(1, 12), min_size=0, max_size=25),
        "local_batch_size": st.integers(1, 16),
        "lookahead": st.integers(0, 3),
        "max_delay": st.integers(0, 3),
        "headroom": st.sampled_from([0.0, 0.01, 0.2]),
        "seed": st.integers(0, 2**16),
        "with_prior": st.booleans(),
    }
)


def build(source, s, **extra):
    return BaseBatchShuffler(
        source,
        cost=sample_cost,
        local_batch_size=s["local_batch_size"],
        lookahead=s["lookahead"],
        max_delay=s["max_delay"],
        headroom=s["headroom"],
        seed=s["seed"],
        expected_cost=1.5 if s["with_prior"] else None,
        **extra,
    )


@given(settings_strategy)
def test_every_sample_exactly_once_with_bounded_delay(s):
    source = make_source(s["sub_batch_sizes"], s["seed"])
    shuffler = build(source, s)
    batches = list(shuffler)
    size, total = s["local_batch_size"], sum(s["sub_batch_sizes"])
    emitted = [sample for batch in batches for sample in batch]
    assert sorted(p for p, _ in emitted) == list(range(total))
    assert len(batches) == -(-total // size)
    assert all(len(b) == size for b in batches[:-1])
    if batches:
        assert 0 < len(batches[-1]) <= size
    for step, batch in enumerate(batches):
        for position, _ in batch:
            delay = step - position // size
            assert -s["lookahead"] <= delay <= s["max_delay"]
    stats = shuffler.stats()
    assert stats.batches == len(batches) and stats.samples == total
    assert sum(stats.delay_counts.values()) == total
    assert stats.max_delay_seen <= s["max_delay"]


@given(settings_strategy)
def test_drop_last_drops_only_the_short_final_batch(s):
    source = make_source(s["sub_batch_sizes"], s["seed"])
    kept = list(build(source, s, drop_last=True))
    full = list(build(source, s))
    size = s["local_batch_size"]
    expected = full if not full or len(full[-1]) == size else full[:-1]
    assert kept == expected


@given(settings_strategy, st.integers(0, 40), st.booleans())
def test_resume_continues_with_the_uninterrupted_batches(s, resume_at, through_json):
    source = make_source(s["sub_batch_sizes"], s["seed"])
    uninterrupted = list(build(source, s))
    first = build(source, s)
    iterator = iter(first)
    resume_at = min(resume_at, len(uninterrupted))
    head = [next(iterator) for _ in range(resume_at)]
    state = first.state_dict()
    if through_json:
        state = json.loads(json.dumps(state))
    second = build(source, s)
    second.load_state_dict(state)
    tail = list(second)
    assert head + tail == uninterrupted
    reference = build(source, s)
    list(reference)
    assert second.stats() == reference.stats()


@given(settings_strategy)
def test_same_seed_same_batches_and_seed_only_permutes_within_batches(s):
    source = make_source(s["sub_batch_sizes"], s["seed"])
    first, second = list(build(source, s)), list(build(source, s))
    assert first == second
    other = list(build(source, {**s, "seed": s["seed"] + 1}))
    assert [sorted(b) for b in other] == [sorted(b) for b in first]


def test_batches_land_on_a_shared_target():
    """Heavy-tailed costs: every full batch's cost stays within the headroom of the target."""
    rng = np.random.default_rng(0)
    costs = np.exp(rng.normal(0.0, 1.0, size=64 * 40))
    source = [[(i, float(costs[i])) for i in range(s, s + 64)] for s in range(0, costs.size, 64)]
    shuffler = BaseBatchShuffler(
        source, cost=sample_cost, local_batch_size=256, expected_cost=float(np.exp(0.5))
    )
    loads = []
    for batch in shuffler:
        stats = shuffler.stats()
        assert stats.last_cost == pytest.approx(sum(c for _, c in batch))
        loads.append(stats.last_cost)
    natural = costs.reshape(-1, 256).sum(axis=1)
    # Spread of batch costs over a rank's run, without and with shuffling.
    assert np.std(loads[2:-3]) < 0.1 * np.std(natural)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="exactly one of cost"):
        BaseBatchShuffler([], local_batch_size=4)
    with pytest.raises(ValueError, match="local_batch_size"):
        BaseBatchShuffler([], cost=float, local_batch_size=0)
    with pytest.raises(ValueError, match="max_delay"):
        BaseBatchShuffler([], cost=float, local_batch_size=4, max_delay=-1)
    with pytest.raises(ValueError, match="seed"):
        BaseBatchShuffler([], cost=float, local_batch_size=4, seed=-1)
    with pytest.raises(ValueError, match="expected_cost"):
        BaseBatchShuffler([], cost=float, local_batch_size=4, expected_cost=0.0)
    with pytest.raises(TypeError, match="sub_batches"):
        BaseBatchShuffler(5, cost=float, local_batch_size=4)
    with pytest.raises(ValueError, match="costs must be finite"):
        list(BaseBatchShuffler([[1.0, -2.0]], cost=float, local_batch_size=4))
    with pytest.raises(ValueError, match="returned 1 costs"):
        list(BaseBatchShuffler([[1, 2]], sub_batch_cost=lambda b: [1.0], local_batch_size=4))


def test_state_from_another_configuration_or_source_is_refused():
    source = make_source([5] * 6, 0)
    shuffler = BaseBatchShuffler(source, cost=sample_cost, local_batch_size=4)
    iterator = iter(shuffler)
    next(iterator), next(iterator)
    state = shuffler.state_dict()
    other = BaseBatchShuffler(source, cost=sample_cost, local_batch_size=8)
    with pytest.raises(ValueError, match="config"):
        other.load_state_dict(state)
    shorter = BaseBatchShuffler(source[:1], cost=sample_cost, local_batch_size=4)
    shorter.load_state_dict(state)
    with pytest.raises(ValueError, match="not the same source"):
        list(shorter)
    with pytest.raises(ValueError, match="state_dict"):
        shuffler.load_state_dict({"version": 99})
