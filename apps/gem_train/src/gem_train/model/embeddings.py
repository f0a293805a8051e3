"""Sparse features → dense vectors, through torchrec or through gem_parallel's native tables.

Two collections, each a torchrec module when torchrec is importable and asked for
(``model.embeddings``: ``auto`` / ``torchrec``) or else gem_parallel's ``EmbeddingTables`` (plain
PyTorch, same layout and outputs; the GPU image has no torchrec):

- the *sequence* collection (torchrec's ``EmbeddingCollection``, tables with ``pooling="none"``):
  one vector per token. It embeds the history events (item, action, category, time bucket) and the
  candidate ad's tokens (ad, ad category, advertiser); the candidate shares the item table with
  history items and the category table with history categories, as a real catalogue would;
- the *pooled* collection (``EmbeddingBagCollection``, ``pooling="sum"``): one summed vector per
  sample of a bag feature (user id, user segments).

Both take a keyed jagged tensor (torchrec's ``KeyedJaggedTensor`` or gem_parallel's stand-in
``KeyedJagged``) and are sharded from outside by ``gem_parallel.shard_embeddings``, which returns a
module with the same forward; nothing here knows about processes. ``lookup`` hides the two
libraries' output types.
"""

import importlib.util

import torch
from torch import nn

from gem_train.config import ModelConfig


def sequence_tables(m: ModelConfig) -> dict[str, tuple[int, tuple[str, ...]]]:
    """``{table: (rows, features)}`` of the per-token embeddings."""
    return {
        "item": (m.item_vocab, ("item", "ad")),
        "category": (m.category_vocab, ("category", "ad_category")),
        "action": (m.action_vocab, ("action",)),
        "time_bucket": (m.time_buckets, ("time_bucket",)),
        "advertiser": (m.advertiser_vocab, ("advertiser",)),
    }


def pooled_tables(m: ModelConfig) -> dict[str, tuple[int, tuple[str, ...]]]:
    return {"user": (m.user_vocab, ("user",)), "segment": (m.segment_vocab, ("segments",))}


def torchrec_available() -> bool:
    """Whether torchrec can be imported: torchrec itself and FBGEMM (``fbgemm_gpu``, from
    ``fbgemm-gpu`` or ``fbgemm-gpu-cpu``), which torchrec imports and cannot work without."""
    return all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))


def resolve_backend(choice: str) -> str:
    if choice == "auto":
        return "torchrec" if torchrec_available() else "native"
    if choice == "torchrec" and not torchrec_available():
        raise RuntimeError(
            "model.embeddings=torchrec but torchrec cannot be imported (it needs torchrec and "
            "FBGEMM's fbgemm_gpu); install the `torchrec` extra of gem-train (in the gemkit "
            "workspace: `--extra cpu`, or `--extra cuda` on a CUDA machine) or use "
            "model.embeddings=native"
        )
    return choice


def _torchrec_collection(tables, dim: int, *, pooled: bool) -> nn.Module:
    import torchrec

    if pooled:
        configs = [
            torchrec.EmbeddingBagConfig(
                name=t,
                embedding_dim=dim,
                num_embeddings=rows,
                feature_names=list(feats),
                pooling=torchrec.PoolingType.SUM,
            )  # fmt: skip
            for t, (rows, feats) in tables.items()
        ]
        return torchrec.EmbeddingBagCollection(tables=configs)
    configs = [
        torchrec.EmbeddingConfig(
            name=t, embedding_dim=dim, num_embeddings=rows, feature_names=list(feats)
        )
        for t, (rows, feats) in tables.items()
    ]
    return torchrec.EmbeddingCollection(tables=configs)


def _native_collection(tables, dim: int, *, pooled: bool) -> nn.Module:
    from gem_parallel.embeddings import EmbeddingTables, TableConfig

    configs = [TableConfig(t, rows, dim, feats) for t, (rows, feats) in tables.items()]
    # the readers check every id on the host (parquet.py; synthetic ids are drawn in range), so
    # the tables skip their per-table device check and its host sync
    return EmbeddingTables(configs, pooling="sum" if pooled else "none", validate_ids=False)


def build_embeddings(m: ModelConfig) -> tuple[nn.Module, nn.Module, str]:
    """``(sequence, pooled, backend)`` collections for ``m.embeddings``, rows drawn N(0, 0.02²)."""
    backend = resolve_backend(m.embeddings)
    make = _torchrec_collection if backend == "torchrec" else _native_collection
    sequence = make(sequence_tables(m), m.emb_dim, pooled=False)
    pooled = make(pooled_tables(m), m.emb_dim, pooled=True)
    for weight in [*sequence.parameters(), *pooled.parameters()]:
        nn.init.normal_(weight, std=0.02)
    return sequence, pooled, backend


def keyed_jagged(backend: str, features: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """``{feature: (ids [T], offsets [B+1])}`` → a keyed jagged tensor for ``backend``."""
    keys = list(features)
    values = torch.cat([features[k][0] for k in keys])
    lengths = torch.cat([features[k][1][1:] - features[k][1][:-1] for k in keys])
    # ids per key, known on the host: the tables need not sum the lengths on the device and
    # read them back (a synchronisation per lookup)
    per_key = [int(features[k][0].numel()) for k in keys]
    if backend == "torchrec":
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, length_per_key=per_key)
    from gem_parallel.embeddings import KeyedJagged

    return KeyedJagged(keys, values, lengths, length_per_key=per_key)


def lookup(module: nn.Module, backend: str, features, *, pooled: bool) -> dict[str, torch.Tensor]:
    """``{feature: [T, E]}`` (sequence) or ``{feature: [B, E]}`` (pooled), whichever library."""
    out = module(keyed_jagged(backend, features))
    if pooled:
        return out.to_dict()
    return {f: out[f].values() if callable(out[f].values) else out[f].values for f in features}
