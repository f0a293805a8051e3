"""The batch every data source produces and the model consumes.

A batch of B samples holds one jagged user history per sample (``T`` tokens in all, torchrec's
``values`` + ``offsets`` layout: sample b owns tokens ``offsets[b]:offsets[b+1]``, oldest first),
four sequence features per token, pooled user and candidate-ad features per sample, and two labels.

| field | shape | meaning |
|---|---|---|
| ``offsets`` | [B+1] int64 | history boundaries |
| ``item``, ``action``, ``category``, ``time_bucket`` | [T] int64 | the history events |
| ``user`` | [B] int64 | user id |
| ``segments``, ``segment_offsets`` | [S], [B+1] int64 | the user's segments (a bag) |
| ``ad``, ``ad_category``, ``advertiser`` | [B] int64 | the candidate ad |
| ``click``, ``conversion`` | [B] float32 | labels (CTR and CVR tasks) |

A batch moved to a device also carries ``layout``, the ``gem_jagged.JaggedBatch`` of its history
offsets, checked on the host as they move: every attention layer shares its checks and work
lists, and no step reads offsets back from the GPU.
"""

from dataclasses import dataclass, field, fields

import numpy as np
import torch
from gem_jagged import JaggedBatch

SEQUENCE_FEATURES = ("item", "action", "category", "time_bucket")
CANDIDATE_FEATURES = ("ad", "ad_category", "advertiser")


def time_bucket_of(age_seconds: np.ndarray, buckets: int) -> np.ndarray:
    """Event age → ``min(floor(log2(1 + age)), buckets - 1)``: recent events get fine buckets."""
    age = np.maximum(np.asarray(age_seconds, dtype=np.int64), 0)
    return np.minimum(np.floor(np.log2(1.0 + age)).astype(np.int64), buckets - 1)


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


@dataclass
class Batch:
    offsets: torch.Tensor
    item: torch.Tensor
    action: torch.Tensor
    category: torch.Tensor
    time_bucket: torch.Tensor
    user: torch.Tensor
    segments: torch.Tensor
    segment_offsets: torch.Tensor
    ad: torch.Tensor
    ad_category: torch.Tensor
    advertiser: torch.Tensor
    click: torch.Tensor
    conversion: torch.Tensor
    layout: JaggedBatch | None = field(default=None, repr=False, compare=False)

    @property
    def num_samples(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (``layout`` is derived, not a field of the data)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layout"}

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """The batch on ``device``, with its ``layout``. History offsets built on the host are
        checked there as they move (``JaggedBatch.from_host``), so the attention ops need not
        read them back from the GPU (a synchronisation per step)."""
        moved = {
            name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors().items()
        }
        if self.offsets.device.type == "cpu":
            layout = JaggedBatch.from_host(self.offsets, device=device, non_blocking=non_blocking)
        else:
            layout = JaggedBatch(moved["offsets"])
        moved["offsets"] = layout.offsets
        return Batch(**moved, layout=layout)

    def padded(self, *, token_multiple: int, sample_multiple: int = 16) -> "Batch":
        """This batch followed by dummy samples (ids 0, labels 0, no segments) so that the token
        count is a multiple of ``token_multiple`` and the sample count of ``sample_multiple``.

        Low-precision GEMMs need aligned row counts, and a bounded set of shapes lets a library
        cache per-shape decisions. The real samples come first; callers keep their count and drop
        the rest from the loss and the metrics.
        """
        n, tokens = self.num_samples, self.num_tokens
        extra_tokens = -tokens % token_multiple
        extra_samples = -n % sample_multiple
        if extra_tokens and not extra_samples:
            extra_samples = sample_multiple
        if not extra_samples:
            return self
        lengths = torch.full((extra_samples,), extra_tokens // extra_samples, dtype=torch.int64)
        lengths[: extra_tokens % extra_samples] += 1
        zeros_T = torch.zeros(extra_tokens, dtype=torch.int64)
        zeros_B = torch.zeros(extra_samples, dtype=torch.int64)
        dummy = Batch(
            offsets=_offsets(lengths), item=zeros_T, action=zeros_T, category=zeros_T,
            time_bucket=zeros_T, user=zeros_B, segments=torch.zeros(0, dtype=torch.int64),
            segment_offsets=torch.zeros(extra_samples + 1, dtype=torch.int64), ad=zeros_B,
            ad_category=zeros_B, advertiser=zeros_B, click=torch.zeros(extra_samples),
            conversion=torch.zeros(extra_samples),
        )  # fmt: skip
        return Batch.cat([self, dummy])

    def select(self, index) -> "Batch":
        """The samples ``index`` (in that order) as a new batch."""
        index = torch.as_tensor(index, dtype=torch.int64)
        lengths = self.lengths[index]
        token_index = _ranges(self.offsets[index], lengths)
        seg_lengths = (self.segment_offsets[1:] - self.segment_offsets[:-1])[index]
        seg_index = _ranges(self.segment_offsets[index], seg_lengths)
        per_token = {n: getattr(self, n)[token_index] for n in SEQUENCE_FEATURES}
        per_sample = {
            n: getattr(self, n)[index] for n in ("user", *CANDIDATE_FEATURES, "click", "conversion")
        }
        return Batch(
            offsets=_offsets(lengths),
            segments=self.segments[seg_index],
            segment_offsets=_offsets(seg_lengths),
            **per_token,
            **per_sample,
        )

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        """Concatenate batches sample-wise."""
        lengths = torch.cat([b.lengths for b in batches])
        seg_lengths = torch.cat([b.segment_offsets[1:] - b.segment_offsets[:-1] for b in batches])
        data = {
            f.name: torch.cat([getattr(b, f.name) for b in batches])
            for f in fields(Batch)
            if f.name not in ("offsets", "segment_offsets", "layout")
        }
        return Batch(offsets=_offsets(lengths), segment_offsets=_offsets(seg_lengths), **data)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(start, start + length)`` for each pair."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    out_offsets = _offsets(lengths)
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return starts[owner] + torch.arange(total) - out_offsets[:-1][owner]
