"""Keyed jagged input and the two output forms, without a hard dependency on torchrec.

The input is torchrec's ``KeyedJaggedTensor`` layout: ``F`` feature keys, each with a batch of
``B`` id lists, stored key-major: ``values`` holds every id of key 0 (sample 0, 1, ...), then every id
of key 1, and so on; ``lengths [F * B]`` counts the ids of each (key, sample); optional per-id
``weights`` align with ``values``. Anything with torchrec's accessors (``keys()``, ``values()``,
``lengths()``, ``stride()``, ``weights_or_none()``) is accepted, so a real torchrec KJT works and so
does ``KeyedJagged``, the small stand-in defined here for machines without torchrec.

Outputs match torchrec's two collections: ``PooledEmbeddings`` (one ``[B, D]`` row block per key,
concatenated, as an EmbeddingBagCollection's ``KeyedTensor``) and a dict of ``JaggedEmbeddings``
(``values [T, D]`` plus ``offsets [B+1]`` per key, as an EmbeddingCollection's ``JaggedTensor``).
"""

from dataclasses import dataclass

import torch


class KeyedJagged:
    """A minimal ``KeyedJaggedTensor``: the accessors this package reads, nothing more."""

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        *,
        length_per_key: list[int] | None = None,
    ):
        keys = list(keys)
        if len(keys) == 0:
            raise ValueError("keys must name at least one feature")
        if lengths.dim() != 1 or lengths.numel() % len(keys):
            raise ValueError(
                f"lengths must be 1-D with a multiple of len(keys)={len(keys)} entries "
                f"(key-major [F * B]), got shape {tuple(lengths.shape)}"
            )
        if length_per_key is not None and len(length_per_key) != len(keys):
            raise ValueError(
                f"length_per_key must hold one count per key ({len(keys)}), "
                f"got {len(length_per_key)}"
            )
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights
        self._length_per_key = None if length_per_key is None else [int(n) for n in length_per_key]

    @classmethod
    def from_dict(cls, features: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> "KeyedJagged":
        """From ``{key: (ids, lengths [B])}``; every key must have the same batch size."""
        keys = list(features)
        batches = {k: int(features[k][1].numel()) for k in keys}
        if len(set(batches.values())) > 1:
            raise ValueError(f"every key needs the same batch size, got {batches}")
        values = torch.cat([features[k][0].reshape(-1) for k in keys])
        lengths = torch.cat([features[k][1].reshape(-1) for k in keys])
        return cls(keys, values, lengths)

    def keys(self) -> list[str]:
        """The feature keys, in order."""
        return self._keys

    def values(self) -> torch.Tensor:
        """Every key's ids, key-major: int ``[total]``."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """Ids per (key, sample), key-major: int ``[keys · B]``."""
        return self._lengths

    def weights_or_none(self) -> torch.Tensor | None:
        """Per-id weights (float ``[total]``) or None."""
        return self._weights

    def length_per_key(self) -> list[int]:
        """Ids per key, as torchrec's: given at construction, or summed from ``lengths`` (a
        device-to-host read when they live on a GPU) and remembered."""
        if self._length_per_key is None:
            batch = self.stride()
            self._length_per_key = self._lengths.view(len(self._keys), batch).sum(1).tolist()
        return self._length_per_key

    def stride(self) -> int:
        """The batch size B."""
        return self._lengths.numel() // len(self._keys)

    def variable_stride_per_key(self) -> bool:
        """Always False: every key has the batch size ``stride()``."""
        return False


@dataclass
class FeatureIds:
    """One key's ids: ``ids [T]``, ``lengths [B]`` and optional per-id ``weights [T]``."""

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None


def split_features(kjt, *, expected: list[str]) -> dict[str, FeatureIds]:
    """Slice a KJT into its keys, checking it carries exactly the ``expected`` feature keys."""
    for attr in ("keys", "values", "lengths", "stride"):
        if not callable(getattr(kjt, attr, None)):
            raise TypeError(
                f"features must be a KeyedJaggedTensor (or gem_parallel KeyedJagged) with a "
                f"{attr}() method; got {type(kjt).__name__}"
            )
    if getattr(kjt, "variable_stride_per_key", lambda: False)():
        raise ValueError("features has a variable batch size per key, which is not supported")
    keys = list(kjt.keys())
    missing = [k for k in expected if k not in keys]
    unknown = [k for k in keys if k not in expected]
    if missing or unknown:
        raise ValueError(
            f"features keys {keys} do not match the tables' features {expected}: "
            f"missing {missing}, not in any table {unknown}"
        )
    values, lengths = kjt.values(), kjt.lengths()
    if values.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"features.values() must hold int32 or int64 ids, got {values.dtype}")
    batch = int(kjt.stride())
    if lengths.numel() != batch * len(keys):
        raise ValueError(
            f"features.lengths() has {lengths.numel()} entries, expected stride * keys = "
            f"{batch} * {len(keys)}"
        )
    lengths_FB = lengths.view(len(keys), batch).to(torch.int64)
    if callable(getattr(kjt, "length_per_key", None)):
        per_key = list(kjt.length_per_key())  # torchrec's and ours remember it (no device read)
    else:
        per_key = lengths_FB.sum(1).tolist()
    if sum(per_key) != values.numel():
        raise ValueError(
            f"features.lengths() sums to {sum(per_key)} but features.values() holds "
            f"{values.numel()} ids"
        )
    weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
    ids_per_key = values.to(torch.int64).split(per_key)
    weights_per_key = weights.split(per_key) if weights is not None else [None] * len(keys)
    return {
        k: FeatureIds(ids_per_key[i], lengths_FB[i], weights_per_key[i]) for i, k in enumerate(keys)
    }


@dataclass
class PooledEmbeddings:
    """Pooled output: ``values [B, sum(dims)]``, key i in columns ``sum(dims[:i]) : ... + dims[i]``."""

    keys: list[str]
    dims: list[int]
    values: torch.Tensor

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: values [B, dim]}`` (views)."""
        return dict(zip(self.keys, self.values.split(self.dims, dim=1), strict=True))


@dataclass
class JaggedEmbeddings:
    """Sequence output of one key: ``values [T, D]`` and ``offsets [B+1]``."""

    values: torch.Tensor
    offsets: torch.Tensor

    def lengths(self) -> torch.Tensor:
        """Rows per sample: ``[B]``."""
        return self.offsets[1:] - self.offsets[:-1]


def pool(
    rows_TD: torch.Tensor, lengths_B: torch.Tensor, mode: str, weights_T: torch.Tensor | None
) -> torch.Tensor:
    """Sum or mean of each sample's rows (empty samples give zeros), optionally weighted."""
    batch = lengths_B.numel()
    sample_T = torch.repeat_interleave(  # output_size known: no host sync for the total
        torch.arange(batch, device=rows_TD.device),
        lengths_B.to(rows_TD.device),
        output_size=rows_TD.shape[0],
    )
    if weights_T is not None:
        rows_TD = rows_TD * weights_T.to(rows_TD.dtype).unsqueeze(1)
    pooled_BD = rows_TD.new_zeros(batch, rows_TD.shape[1]).index_add(0, sample_T, rows_TD)
    if mode == "mean":
        pooled_BD = pooled_BD / lengths_B.clamp(min=1).to(pooled_BD.dtype).unsqueeze(1)
    return pooled_BD


def offsets_of(lengths_B: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lengths)]``: ``[B+1]`` of ``lengths``' dtype and device."""
    offsets = lengths_B.new_zeros(lengths_B.numel() + 1)
    offsets[1:] = torch.cumsum(lengths_B, 0)
    return offsets
