"""The FlexAttention anchor: the flex history attention is the jagged attention's function.

FlexAttention has no backward on the CPU, so the gradients are checked through the ``dense``
backend (the same ``mask_mod`` and ``score_mod`` on the full score matrix) and the forward of
flex itself (``eager``) is checked against both; on a GPU the compiled flex is checked, forward
and gradients, against the jagged reference.
"""

import pytest
import torch
from gem_jagged import jagged_flash_attention
from gem_train.config import ConfigError
from gem_train.data.synthetic import SyntheticStream
from gem_train.model import GemModel, loss_of
from gem_train.model.flex import FlexMasks, dense_flex_attention, relative_bias_score_mod

# The uncompiled flex_attention warns that it is unfused: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Empty sequences, short ones and one longer than a 128-token tile (a partial tile at its end).
LENGTHS = [0, 3, 0, 1, 150, 7, 0, 12]
HEADS, HEAD_DIM, RADIUS = 2, 32, 4


def _inputs(device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=dtype) for _ in range(3))
    rel_bias = torch.randn(HEADS, 2 * RADIUS + 1, generator=gen)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64)
    return [t.to(device) for t in (q, k, v, rel_bias, offsets)]


def _flex(q, k, v, rel_bias, offsets, *, backend, bwd_stages=0):
    masks = FlexMasks(
        offsets, total=q.shape[0], seeds=0, candidates=0, history=True, backend=backend,
        bwd_stages=bwd_stages,
    )  # fmt: skip
    return masks.attend("history", q, k, v, score_mod=relative_bias_score_mod(rel_bias))


def _reference(q, k, v, rel_bias, offsets):
    return jagged_flash_attention(
        q, k, v, offsets, causal=True, rel_bias=rel_bias, backend="reference"
    )


def _forward_and_grads(fn, q, k, v, rel_bias, offsets):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, rel_bias)]
    out = fn(*leaves, offsets)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def test_flex_history_attention_equals_the_jagged_reference_forward_and_gradients():
    inputs = _inputs()
    out_f, grads_f = _forward_and_grads(lambda *a: _flex(*a, backend="dense"), *inputs)
    out_r, grads_r = _forward_and_grads(_reference, *inputs)
    torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-5)
    for name, g_f, g_r in zip(("q", "k", "v", "rel_bias"), grads_f, grads_r, strict=True):
        torch.testing.assert_close(g_f, g_r, rtol=1e-4, atol=1e-5, msg=name)


def test_flex_attention_itself_equals_the_dense_evaluation_and_the_reference():
    """The uncompiled ``flex_attention`` (forward only on the CPU) with the batch's BlockMask."""
    inputs = _inputs()
    with torch.no_grad():
        out_eager = _flex(*inputs, backend="eager")
        out_dense = _flex(*inputs, backend="dense")
        out_ref = _reference(*inputs)
    torch.testing.assert_close(out_eager, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_eager, out_dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["pma", "cross"])
def test_pooling_masks_see_each_sample_s_history_only(which):
    """Query row r belongs to sample r // S; an empty history's rows output zeros."""
    q_all, k, v, _, offsets = _inputs()
    per_sample, batch = 3, len(LENGTHS)
    q = q_all[: batch * per_sample]
    masks = FlexMasks(
        offsets, total=k.shape[0], seeds=per_sample, candidates=per_sample, history=False,
        backend="eager",
    )  # fmt: skip
    with torch.no_grad():
        out_eager = masks.attend(which, q, k, v)
        dense = FlexMasks(
            offsets, total=k.shape[0], seeds=per_sample, candidates=per_sample, history=False,
            backend="dense",
        )  # fmt: skip
        out_dense = dense.attend(which, q, k, v)
    torch.testing.assert_close(out_eager, out_dense, rtol=1e-5, atol=1e-5)
    bounds = offsets.tolist()
    for b in range(batch):
        rows = slice(b * per_sample, (b + 1) * per_sample)
        keys = slice(bounds[b], bounds[b + 1])
        expected = torch.softmax(
            torch.einsum("qnh,knh->nqk", q[rows], k[keys]) / HEAD_DIM**0.5, dim=-1
        )
        expected = torch.einsum("nqk,knh->qnh", expected, v[keys])
        if LENGTHS[b] == 0:
            expected = torch.zeros_like(q[rows])
        torch.testing.assert_close(out_dense[rows], expected, rtol=1e-5, atol=1e-5)


def test_dense_flex_attention_rows_without_keys_are_zero():
    q = torch.randn(1, 1, 4, 8)
    out = dense_flex_attention(q, q, q, mask_mod=lambda b, h, i, j: (i < 2) & (j <= i))
    assert out[0, 0, 2:].eq(0).all() and out[0, 0, :2].abs().sum() > 0


def test_the_model_builds_one_set_of_masks_per_batch_for_every_layer(small):
    cfg = small(model__attention="flex", model__pooling_attention="flex", model__n_layers=2)
    batch = SyntheticStream(cfg.data, cfg.model).batch(0)
    model = GemModel(cfg.model)
    seen = []
    layers = [*model.dense.blocks, model.dense.pma, model.dense.cross]
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[-1]))
    loss, _ = loss_of(model(batch), batch)
    loss.backward()
    assert len(seen) == len(layers) and isinstance(seen[0], FlexMasks)
    assert all(masks is seen[0] for masks in seen)
    assert seen[0].backend == "dense"  # auto on the CPU
    rel_bias = model.dense.blocks[0].attn.rel_bias
    assert rel_bias.grad is not None and rel_bias.grad.abs().sum() > 0


def test_the_backward_stages_reach_flex_and_leave_the_forward_alone(small):
    """``model.flex_bwd_stages`` becomes flex's ``bwd_num_stages`` kernel option (0 leaves
    inductor's choice); a forward is the same with it."""
    cfg = small(model__attention="flex", model__flex_bwd_stages=1)
    batch = SyntheticStream(cfg.data, cfg.model).batch(0)
    model = GemModel(cfg.model)
    seen = []
    model.dense.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[-1]))
    model(batch)
    assert seen[0].kernel_options == {"bwd_num_stages": 1}
    inputs = _inputs()
    with torch.no_grad():
        staged = _flex(*inputs, backend="eager", bwd_stages=2)
        torch.testing.assert_close(staged, _flex(*inputs, backend="eager"), rtol=0, atol=0)
    total = inputs[0].shape[0]
    masks = FlexMasks(inputs[-1], total=total, seeds=0, candidates=0, history=True, backend="dense")
    assert masks.kernel_options is None


def test_an_unknown_flex_backend_names_the_field(small):
    with pytest.raises(ConfigError, match="model.flex_backend"):
        small(model__attention="flex", model__flex_backend="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_flex_equals_the_jagged_reference_on_cuda():
    inputs = _inputs(device="cuda")
    out_r, grads_r = _forward_and_grads(_reference, *inputs)
    for stages in (0, 1):  # inductor's backward, and one with the stages set
        out_f, grads_f = _forward_and_grads(
            lambda *a, s=stages: _flex(*a, backend="compiled", bwd_stages=s), *inputs
        )
        torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=1e-4)
        for name, g_f, g_r in zip(("q", "k", "v", "rel_bias"), grads_f, grads_r, strict=True):
            torch.testing.assert_close(g_f, g_r, rtol=1e-3, atol=1e-3, msg=f"{name} {stages}")
