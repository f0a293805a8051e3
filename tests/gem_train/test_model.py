"""The model: jagged, flex and padded attention agree, both embedding libraries agree, every variant trains."""

import pytest
import torch
from gem_train.data.synthetic import SyntheticStream
from gem_train.metrics import layer_flops
from gem_train.model import GemModel, attention, loss_of
from gem_train.model.embeddings import torchrec_available


def _loss_and_grads(cfg, batch, seed=0, *, sdpa_call_elements=None):
    torch.manual_seed(seed)
    model = GemModel(cfg.model)
    if sdpa_call_elements is not None:
        for module in model.modules():
            if isinstance(module, attention.HistorySelfAttention):
                module.sdpa_call_elements = sdpa_call_elements
    loss, _ = loss_of(model(batch), batch)
    loss.backward()
    return (
        model,
        loss.detach(),
        {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
    )


def _batch(cfg):
    return SyntheticStream(cfg.data, cfg.model).batch(0)


@pytest.mark.parametrize("sdpa_call_elements", [2**30, 64], ids=["one-call", "per-sample-head"])
def test_jagged_and_padded_attention_compute_the_same_model(small, sdpa_call_elements):
    """Also with the padded SDPA split into one call per sample and head (as long histories are)."""
    lengths = {
        "data__min_len": 0,
        "data__median_len": 2,
        "data__sigma": 1.5,
        "model__d_model": 64,
        "model__n_heads": 2,
    }
    jagged = small(**lengths)
    padded = small(**lengths, model__attention="padded", model__pooling_attention="padded")
    batch = _batch(jagged)
    assert (batch.lengths == 0).any() and batch.lengths.max() > 4  # empty histories included
    _, loss_j, grads_j = _loss_and_grads(jagged, batch)
    _, loss_p, grads_p = _loss_and_grads(padded, batch, sdpa_call_elements=sdpa_call_elements)
    torch.testing.assert_close(loss_j, loss_p, rtol=1e-5, atol=1e-6)
    assert grads_j.keys() == grads_p.keys()
    for name in grads_j:
        torch.testing.assert_close(grads_j[name], grads_p[name], rtol=1e-4, atol=1e-6, msg=name)


def test_token_tiles_schedule_reaches_the_op_and_computes_the_same_model(small):
    """``model.jagged_schedule=token_tiles``: each history attention passes the op its config with
    ``Schedule.TOKEN_TILES`` (made once per batch, kept in the batch's layout); the model is the
    per-sequence one (on the CPU both run the reference; test_gpu.py compares the kernels)."""
    from gem_jagged.ops.jagged_flash_attention.config import Schedule

    lengths = {"data__min_len": 0, "data__median_len": 2, "data__sigma": 1.5}
    per_sequence = small(**lengths)
    token_tiles = small(**lengths, model__jagged_schedule="token_tiles")
    batch = _batch(per_sequence).to("cpu")
    _, loss_s, grads_s = _loss_and_grads(per_sequence, batch)
    _, loss_t, grads_t = _loss_and_grads(token_tiles, batch)
    torch.testing.assert_close(loss_s, loss_t, rtol=0, atol=0)
    for name in grads_s:
        torch.testing.assert_close(grads_s[name], grads_t[name], rtol=0, atol=0, msg=name)
    configs = [v for key, v in batch.layout._memo.items() if key[0] == "gem_train.token_tiles"]
    assert len(configs) == 1 and configs[0].schedule == Schedule.TOKEN_TILES


def test_flex_history_attention_computes_the_jagged_model(small):
    """``model.attention=flex`` (pooling left jagged) is the jagged model: loss and gradients."""
    lengths = {"data__min_len": 0, "data__median_len": 2, "data__sigma": 1.5}
    jagged, flex = small(**lengths), small(**lengths, model__attention="flex")
    batch = _batch(jagged)
    assert (batch.lengths == 0).any() and batch.lengths.max() > 4  # empty histories included
    _, loss_j, grads_j = _loss_and_grads(jagged, batch)
    _, loss_f, grads_f = _loss_and_grads(flex, batch)
    torch.testing.assert_close(loss_j, loss_f, rtol=1e-5, atol=1e-6)
    assert grads_j.keys() == grads_f.keys()
    for name in grads_j:
        torch.testing.assert_close(grads_j[name], grads_f[name], rtol=1e-4, atol=1e-6, msg=name)


def test_radius_zero_is_no_bias_in_every_attention_kind(small):
    """``model.rel_bias_radius=0`` builds no bias parameter (the kernels' no-bias paths), and the
    model is the one whose bias is zero (as every bias starts): jagged, padded and flex agree."""
    lengths = {"data__min_len": 0, "data__median_len": 2, "data__sigma": 1.5}
    with_bias = small(**lengths)
    batch = _batch(with_bias)
    _, loss_b, _ = _loss_and_grads(with_bias, batch)
    kinds = {
        "jagged": {},
        "padded": {"model__attention": "padded"},
        "flex": {"model__attention": "flex"},
    }
    results = {}
    for kind, flags in kinds.items():
        model, loss, grads = _loss_and_grads(
            small(**lengths, **flags, model__rel_bias_radius=0), batch
        )
        assert not [n for n, _ in model.named_parameters() if "rel_bias" in n], kind
        results[kind] = (loss, grads)
    loss_j, grads_j = results["jagged"]
    torch.testing.assert_close(loss_j, loss_b, rtol=1e-5, atol=1e-6)
    for kind in ("padded", "flex"):
        loss, grads = results[kind]
        torch.testing.assert_close(loss, loss_j, rtol=1e-5, atol=1e-6, msg=kind)
        assert grads.keys() == grads_j.keys()
        for name in grads_j:
            torch.testing.assert_close(grads[name], grads_j[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torchrec_available(), reason="torchrec is not installed")
def test_torchrec_and_native_embeddings_agree(small):
    native, torchrec = small(), small(model__embeddings="torchrec")
    batch = _batch(native)
    torch.manual_seed(0)
    model_n = GemModel(native.model)
    model_t = GemModel(torchrec.model)
    state = model_n.state_dict()
    mapped = {}
    for key in model_t.state_dict():
        table = key.split(".")[-2]
        if key.startswith("sequence_embeddings."):
            mapped[key] = state[f"sequence_embeddings.weights.{table}"]
        elif key.startswith("pooled_embeddings."):
            mapped[key] = state[f"pooled_embeddings.weights.{table}"]
        else:
            mapped[key] = state[key]
    model_t.load_state_dict(mapped)
    out_n, out_t = model_n(batch), model_t(batch)
    for task in out_n:
        torch.testing.assert_close(out_n[task], out_t[task])


@pytest.mark.parametrize(
    "variant",
    [
        {"model__ffn": "moe", "model__n_experts": 4, "model__top_k": 2},
        {"model__attention": "block", "model__block_size": 16},
        {"model__attention": "flex", "model__pooling_attention": "flex"},
    ],
    ids=["moe", "block_attention", "flex_anchor"],
)
def test_variants_run_forward_and_backward(small, variant):
    cfg = small(**variant)
    model, loss, grads = _loss_and_grads(cfg, _batch(cfg))
    assert torch.isfinite(loss)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert {n for n in trainable if n.startswith("dense.blocks.")} <= set(grads)


def test_flop_count_by_hand(small):
    cfg = small(
        model__d_model=4, model__n_heads=1, model__ffn_hidden=8,
        model__attention="padded", model__pooling_attention="padded",
    )  # fmt: skip
    flops = layer_flops(cfg.model, [3, 1], backward=False)
    # causal pairs 3·4/2 + 1 = 7; attention 4·N·H·pairs = 4·1·4·7
    assert flops["block0.attention"] == 4 * 4 * 7
    assert flops["block0.attn_proj"] == 2 * 4 * (4 * 12 + 4 * 4)
    assert flops["block0.ffn"] == 3 * 2 * 4 * 4 * 8
    both = layer_flops(cfg.model, [3, 1], backward=True)
    assert both["block0.attention"] == 3.5 * flops["block0.attention"]
    assert both["block0.ffn"] == 3 * flops["block0.ffn"]
