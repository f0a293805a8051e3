"""Synthetic click / conversion data with a planted signal.

A fixed random *teacher* (its own seed, the same for every data seed, so train and held-out streams
agree) decides the labels from the features, so a model that learns can push NE well below 1:

- every item belongs to one category and one advertiser; every user prefers three categories and
  carries one to four segments;
- a history draws each event's category from the user's preferences with probability 0.7 (else
  uniformly), an item of that category, an action type and an age (newest last);
- the candidate ad is an item, from a preferred category half of the time;
- the click logit is ``strength · (affinity − 0.35) + Σ segment weights + advertiser weight − 1``,
  where affinity is the recency- and action-weighted share of history events whose category is
  the candidate's. The history must be *read* to recover affinity: this is what the attention
  tower learns. The conversion logit adds a second advertiser weight and lowers the base rate.

History lengths follow the log-normal shape of workload J1 (``clip(exp(Normal(log(median),
sigma)), lo, hi)``, drawn by ``gem_loadbalance.workloads.lognormal_lengths``). Batch ``i`` of
stream ``s`` is a pure function of ``(seed, s, i)``: the stream is deterministic and resuming at
batch ``i`` needs nothing but ``i``.
"""

import numpy as np
import torch
from gem_loadbalance.workloads import lognormal_lengths

from gem_train.config import DataConfig, ModelConfig
from gem_train.data.batch import Batch, offsets_of, time_bucket_of

TEACHER_SEED = 20261129
TRAIN_STREAM, EVAL_STREAM = 0, 1


class Teacher:
    """The fixed random world: item catalogue, user tastes and the label-deciding weights."""

    def __init__(self, model: ModelConfig, *, strength: float):
        rng = np.random.default_rng(TEACHER_SEED)
        m = model
        self.m, self.strength = m, strength
        self.item_category = rng.permutation(np.arange(m.item_vocab) % m.category_vocab)
        self.item_advertiser = rng.integers(m.advertiser_vocab, size=m.item_vocab)
        order = np.argsort(self.item_category, kind="stable")
        counts = np.bincount(self.item_category, minlength=m.category_vocab)
        self.items_by_category, self.category_start = order, offsets_of(counts)[:-1]
        self.category_count = counts
        self.user_preferences = rng.integers(m.category_vocab, size=(m.user_vocab, 3))
        self.user_segment_count = rng.integers(1, 5, size=m.user_vocab)
        self.user_segment_seed = rng.integers(2**31, size=m.user_vocab)
        self.segment_weight = rng.normal(0.0, 0.6, size=m.segment_vocab)
        self.advertiser_weight = rng.normal(0.0, 1.0, size=m.advertiser_vocab)
        self.advertiser_cvr_weight = rng.normal(0.0, 0.6, size=m.advertiser_vocab)
        self.action_weight = np.linspace(0.5, 2.0, m.action_vocab)
        self.recency_weight = 1.0 / (1.0 + 0.15 * np.arange(m.time_buckets))

    def items_of(self, rng, categories: np.ndarray) -> np.ndarray:
        pick = (rng.random(categories.size) * self.category_count[categories]).astype(np.int64)
        return self.items_by_category[self.category_start[categories] + pick]

    def segments_of(self, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = self.user_segment_count[users]
        seeds = np.repeat(self.user_segment_seed[users], counts)
        slot = np.arange(counts.sum()) - np.repeat(offsets_of(counts)[:-1], counts)
        return (seeds * 2654435761 + slot * 40503) % self.m.segment_vocab, counts

    def logits(
        self,
        *,
        offsets,
        category,
        action,
        time_bucket,
        ad_category,
        advertiser,
        segments,
        segment_counts,
    ):
        """Click and conversion logits of each sample (numpy, float64)."""
        lengths = np.diff(offsets)
        owner = np.repeat(np.arange(lengths.size), lengths)
        weight = self.action_weight[action] * self.recency_weight[time_bucket]
        match = (category == ad_category[owner]) * weight
        affinity = np.bincount(owner, match, lengths.size) / np.maximum(
            np.bincount(owner, weight, lengths.size), 1e-9
        )
        seg_owner = np.repeat(np.arange(lengths.size), segment_counts)
        seg = np.bincount(seg_owner, self.segment_weight[segments], lengths.size)
        click = self.strength * (affinity - 0.35) + seg + self.advertiser_weight[advertiser] - 1.0
        conversion = click + self.advertiser_cvr_weight[advertiser] - 1.5
        return click, conversion


class SyntheticStream:
    """Batches of ``batch_size`` samples; ``batch(i)`` is deterministic in ``(seed, stream, i)``."""

    def __init__(self, data: DataConfig, model: ModelConfig, *, stream: int = TRAIN_STREAM):
        self.data, self.model, self.stream = data, model, stream
        self.teacher = Teacher(model, strength=data.teacher_strength)

    def sub_batch(self, index: int) -> Batch:
        """Sub-batch ``index`` of ``data.sub_batch_size`` samples (the stream never ends)."""
        return self.batch(index, batch_size=self.data.sub_batch_size)

    def batch(self, index: int, *, batch_size: int | None = None) -> Batch:
        d, m, t = self.data, self.model, self.teacher
        b = d.batch_size if batch_size is None else batch_size
        rng = np.random.default_rng([d.seed, self.stream, index])
        lengths = lognormal_lengths(
            rng, b, median=d.median_len, sigma=d.sigma, lo=d.min_len, hi=d.max_len
        )
        offsets = offsets_of(lengths)
        users = rng.integers(m.user_vocab, size=b)
        owner = np.repeat(np.arange(b), lengths)
        total = int(offsets[-1])
        preferred = t.user_preferences[users[owner], rng.integers(3, size=total)]
        category = np.where(
            rng.random(total) < 0.7, preferred, rng.integers(m.category_vocab, size=total)
        )
        item = t.items_of(rng, category)
        action = rng.integers(m.action_vocab, size=total)
        # Ages: newest last, exponential gaps of about a minute to a day.
        gaps = rng.exponential(np.exp(rng.uniform(4, 11, size=b))[owner])
        age = _reverse_cumsum(gaps, offsets).astype(np.int64)
        time_bucket = time_bucket_of(age, m.time_buckets)
        ad_pref = t.user_preferences[users, rng.integers(3, size=b)]
        ad_category = np.where(rng.random(b) < 0.5, ad_pref, rng.integers(m.category_vocab, size=b))
        ad = t.items_of(rng, ad_category)
        advertiser = t.item_advertiser[ad]
        segments, segment_counts = t.segments_of(users)
        click_logit, conversion_logit = t.logits(
            offsets=offsets, category=category, action=action, time_bucket=time_bucket,
            ad_category=ad_category, advertiser=advertiser, segments=segments,
            segment_counts=segment_counts,
        )  # fmt: skip
        click = rng.random(b) < _sigmoid(click_logit)
        conversion = rng.random(b) < _sigmoid(conversion_logit)
        return _to_batch(
            offsets=offsets, item=item, action=action, category=category, time_bucket=time_bucket,
            user=users, segments=segments, segment_offsets=offsets_of(segment_counts), ad=ad,
            ad_category=ad_category, advertiser=advertiser, click=click, conversion=conversion,
        )  # fmt: skip


def _reverse_cumsum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per segment, the sum of the values after each position (0 at the segment's end)."""
    running = np.cumsum(values)
    end_of_segment = np.concatenate([[0.0], running])[offsets[1:]]
    owner = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    return end_of_segment[owner] - running


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _to_batch(**arrays) -> Batch:
    out = {}
    for name, value in arrays.items():
        dtype = np.float32 if name in ("click", "conversion") else np.int64
        out[name] = torch.from_numpy(np.array(value, dtype=dtype))  # a writable copy
    return Batch(**out)
