"""Launch plans of eager jagged flash attention (``_plan``) and the direct launches they make
(``gem_jagged._direct_launch``): a repeated call skips to its kernel, with the same bits, and
anything that could make the recorded launch wrong sends the call down the ordinary path."""

import contextlib
import dataclasses
import gc
import types

import pytest
import torch
from gem_jagged import jagged_flash_attention
from gem_jagged._direct_launch import DirectLaunch, Launch
from gem_jagged.ops.jagged_flash_attention import _op, _plan
from gem_jagged.ops.jagged_flash_attention import triton as jfa_triton
from gem_jagged.testing import offsets_from_lengths


class _RecordingCompiled:
    """Stands in for a compiled kernel: ``run`` records what the C launcher would get."""

    def __init__(self):
        self.calls = []
        self.function = 1234
        self.packed_metadata = (4, 1, 0)

    def run(self, *args):
        self.calls.append(args)


def test_direct_launch_passes_every_argument_in_signature_order():
    kernel = jfa_triton._jfa_fwd_kernel
    names = kernel.arg_names
    tensors = {n: torch.empty(4) for n in names[:11]}  # the pointer arguments
    scalars = list(range(100, 100 + 8))  # num_heads ... stride_kv
    args = (*tensors.values(), *scalars)
    constexprs = {n: f"const-{n}" for n in names[len(args) :]}
    compiled = _RecordingCompiled()
    launch = DirectLaunch(
        Launch(kernel, compiled, (7,), args, constexprs), per_call=_plan.PER_CALL_ARGS
    )
    launch(99, *range(1, 9))
    (call,) = compiled.calls
    assert call[:9] == (7, 1, 1, 99, 1234, (4, 1, 0), None, None, None)
    sent = dict(zip(names, call[9:], strict=True))
    for i, name in enumerate(_plan.PER_CALL_ARGS):
        assert sent[name] == i + 1
    for name, t in tensors.items():
        if name not in _plan.PER_CALL_ARGS:
            assert sent[name] == t.data_ptr()  # fixed pointers travel as integers
    assert [sent[n] for n in names[11 : len(args)]] == scalars
    assert all(sent[n] == v for n, v in constexprs.items())
    assert launch._keep == tuple(t for n, t in tensors.items() if n not in _plan.PER_CALL_ARGS)
    with pytest.raises(ValueError, match="do not match"):
        DirectLaunch(Launch(kernel, compiled, (7,), args, {}), per_call=_plan.PER_CALL_ARGS)


def test_direct_launch_is_not_recorded_under_the_interpreter_or_a_launch_hook(monkeypatch):
    kernel = jfa_triton._jfa_fwd_kernel
    record = DirectLaunch.record
    assert record(Launch(kernel, None, (1,), (), {}), per_call=()) is None  # the interpreter
    monkeypatch.setattr("gem_jagged._direct_launch.KNOWN_TRITON", ("0.",))
    assert record(Launch(kernel, _RecordingCompiled(), (1,), (), {}), per_call=()) is None
    hooks = types.SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None)
    monkeypatch.setattr("gem_jagged._direct_launch.knobs", types.SimpleNamespace(runtime=hooks))
    assert not DirectLaunch.available()


@contextlib.contextmanager
def launch_plans_off(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_plan, "key_of", lambda *args, **kwargs: None)
        yield


def _key_args(**overrides):
    q = torch.randn(6, 2, 32)
    offsets = offsets_from_lengths([2, 4])
    call = dict(
        q=q, k=q, v=q, q_offsets=offsets, kv_offsets=None, causal=False, scale=None,
        rel_bias=None, hints=(None, None), backend="auto",
    )  # fmt: skip
    return call | overrides


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # CPU tensors: the reference runs, no plan
        {"q": [[1.0]]},  # not a tensor: the checks name it, key_of must not raise first
        {"q_offsets": "0,2,6"},
        {"rel_bias": torch.zeros(2, 3)},
        {"hints": (True, None)},
    ],
)
def test_key_of_declines_where_plans_do_not_apply(overrides):
    args = _key_args(**overrides)
    q, k, v, q_offsets, kv_offsets = (
        args.pop(n) for n in ("q", "k", "v", "q_offsets", "kv_offsets")
    )
    assert _plan.key_of(q, k, v, q_offsets, kv_offsets, **args) is None


def _remember_a_plan(monkeypatch, key, q_off, kv_off):
    """A plan recorded as ``eager_forward`` records one, its launch a placeholder."""
    monkeypatch.setattr(DirectLaunch, "record", classmethod(lambda cls, *a, **kw: "launch"))
    chosen_by = (32, torch.device("cpu"), torch.float32, 3.0, False)
    recorded = jfa_triton.RecordedForward(
        launch=Launch(jfa_triton._jfa_fwd_kernel, None, (1,), (), {}),
        cfg=jfa_triton.config_chosen_by(chosen_by), chosen_by=chosen_by,
    )  # fmt: skip
    out, lse = torch.empty(6, 2, 32), torch.empty(2, 6)
    work = torch.empty(5, 16, dtype=torch.int32)
    _plan.remember(key, recorded, out, lse, work, q_off, kv_off, causal=True, scale=0.5)


def test_plan_serves_its_offsets_until_they_change_or_die(monkeypatch):
    """A plan answers only for the very offsets it recorded, at their recorded version, while
    the tile tables choose the recorded entry; it is dropped when its offsets die (a key holds
    only their ids, which Python reuses)."""
    _plan.forget_all()
    q_off = offsets_from_lengths([2, 4])
    kv_off = offsets_from_lengths([3, 3])
    key = ("key", 0)
    _remember_a_plan(monkeypatch, key, q_off, kv_off)
    plan = _plan.lookup(key, q_off, kv_off)
    assert plan is not None and (plan.causal, plan.scale, plan.stream) == (True, 0.5, 0)
    assert plan.out_shape == (6, 2, 32) and plan.lse_shape == (2, 6)
    assert _plan.lookup(key, q_off, q_off) is None  # other key offsets
    assert _plan.lookup(key, offsets_from_lengths([2, 4]), kv_off) is None  # equal, not the same
    with monkeypatch.context() as m:  # a tuning sweep replaces a table entry
        m.setattr(jfa_triton, "_INTERPRETER_CONFIG", dataclasses.replace(plan.cfg))
        assert _plan.lookup(key, q_off, kv_off) is None
    assert _plan.lookup(key, q_off, kv_off) is plan
    kv_off.add_(0)  # an in-place change: a new version
    assert _plan.lookup(key, q_off, kv_off) is None
    del q_off
    gc.collect()
    assert key not in _plan._PLANS


def test_plan_forward_launches_with_the_call_pointers():
    """``ForwardPlan.forward`` allocates the outputs and hands the launch q, k, v, out, lse,
    the offsets and q (standing in for the bias tiles), in ``PER_CALL_ARGS`` order; it
    launches nothing for a pointer that is not 16-byte aligned."""
    q_off, kv_off = offsets_from_lengths([2, 4]), offsets_from_lengths([3, 3])
    sent = []
    work = torch.empty(5, 16, dtype=torch.int32)
    plan = _plan.ForwardPlan(
        launch=lambda stream, *pointers: sent.append((stream, pointers)), cfg=None, chosen_by=(),
        descriptors=False,
        work_5W=work, out_shape=(6, 2, 32), lse_shape=(2, 6), stream=5, causal=False, scale=1.0,
        q_offsets=lambda: q_off, kv_offsets=lambda: kv_off, versions=(0, 0),
    )  # fmt: skip
    q, k, v = (torch.randn(6, 2, 32) for _ in range(3))
    out, lse, got_work = plan.forward(q, k, v)
    assert out.shape == (6, 2, 32) and lse.shape == (2, 6) and lse.dtype == torch.float32
    assert got_work is work
    ((stream, pointers),) = sent
    want = (q, k, v, out, lse, q_off, kv_off, q)
    assert len(want) == len(_plan.PER_CALL_ARGS)
    assert stream == 5 and pointers == tuple(t.data_ptr() for t in want)
    misaligned = torch.randn(6 * 64 + 1)[1:].view(6, 2, 32)
    assert plan.forward(misaligned, k, v) is None and len(sent) == 1


class _FakeDirectLaunch:
    """Stands in for ``DirectLaunch`` (the interpreter compiles nothing to launch again): it
    keeps the per-call argument names and the values of each launch."""

    def __init__(self, launch, per_call):
        self.per_call, self.calls = per_call, []

    def __call__(self, stream, *values):
        self.calls.append(dict(zip(self.per_call, values, strict=True)))


def _fake_direct_launches(monkeypatch):
    def record(cls, launch, *, per_call):
        return _FakeDirectLaunch(launch, per_call)

    monkeypatch.setattr(DirectLaunch, "record", classmethod(record))


def _backward_tensors(seed, lq, lk, *, head_dim=32):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lq), 2, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lk), 2, head_dim, generator=gen) for _ in range(2))
    return dout, q, k, v


def test_backward_plan_finds_every_argument_and_launches_with_the_new_call_tensors(monkeypatch):
    """Under the interpreter (16-row tiles) these lengths take every backward launch: the dQ
    kernel for the sequences of more than one key tile, the dK/dV kernel writing the dQ of
    the others, the 200-query sequence's key tiles split into a zeroed scratch. The plan
    recorded from one call finds each per-call argument (a call tensor, or inside the
    scratch) and leaves the work lists as recorded; replayed for another call's tensors it
    passes their addresses and makes its own dQ, dK, dV and scratch; it is not handed out once
    the offsets change in place."""
    _plan.forget_all()
    monkeypatch.setattr(_plan, "current_stream", lambda device: 1)  # the key's last entry
    lq, lk = [200, 1, 5, 0, 40], [10, 3, 30, 0, 16]
    q_off, kv_off = offsets_from_lengths(lq), offsets_from_lengths(lk)
    key = ("key", 1)
    _remember_a_plan(monkeypatch, key, q_off, kv_off)
    _fake_direct_launches(monkeypatch)

    def ordinary(dout, q, k, v):
        out, lse, work = jfa_triton.jfa_forward(
            q, k, v, q_off, kv_off, causal=True, scale=0.3, rel_bias=None
        )
        record = jfa_triton.RecordedBackward()
        grads = jfa_triton.jfa_backward(
            dout, q, k, v, out, lse, q_off, kv_off, causal=True, scale=0.3, rel_bias=None,
            forward_work=work, record=record,
        )  # fmt: skip
        return (out, lse), grads, record

    first = _backward_tensors(0, lq, lk)
    (out, lse), _, record = ordinary(*first)
    kernels = [launch.kernel for launch in record.launches]
    assert kernels == [jfa_triton._jfa_dq_kernel, jfa_triton._jfa_dkdv_kernel]
    assert record.plannable and set(record.made) == {"dq", "dk", "dv", "delta", "scratch"}
    assert record.made["scratch"][1]  # zeroed
    _plan.remember_backward(key, record, *first[1:], out, lse, q_off, kv_off)
    plan = _plan.backward_plan(key, q_off, kv_off)
    assert plan is not None
    dq_launch, dkdv_launch = (launch for launch, _ in plan.launches)
    assert set(dkdv_launch.per_call) == {
        "q_TqNH",
        "k_TkNH",
        "v_TkNH",
        "out_TqNH",
        "do_TqNH",
        "lse_NTq",
        "delta_NTq",
        "bias_tiles_NONM",
        "dq_TqNH",
        "dk_TkNH",
        "dv_TkNH",
        "scratch_F",
        "q_offsets_Bp1",
        "kv_offsets_Bp1",
    }  # fmt: skip; not the work list's five rows
    sources = dict(zip(dkdv_launch.per_call, plan.launches[1][1], strict=True))
    dq_launch_sources = dict(zip(dq_launch.per_call, plan.launches[0][1], strict=True))
    assert sources["delta_NTq"] == _plan.Source("lse") and sources["bias_tiles_NONM"].name == "q"

    dout, q, k, v = _backward_tensors(1, lq, lk)
    (out, lse), want, _ = ordinary(dout, q, k, v)
    dq, dk, dv = plan.backward(dout, q, k, v, out, lse, q_off, kv_off)
    for got, ref in zip((dq, dk, dv), want[:3], strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
    (dq_call,), (dkdv_call,) = dq_launch.calls, dkdv_launch.calls
    for name, t in [("q_TqNH", q), ("k_TkNH", k), ("v_TkNH", v), ("out_TqNH", out),
                    ("do_TqNH", dout), ("lse_NTq", lse), ("dq_TqNH", dq), ("dk_TkNH", dk),
                    ("dv_TkNH", dv), ("q_offsets_Bp1", q_off), ("kv_offsets_Bp1", kv_off)]:  # fmt: skip
        assert dkdv_call[name] == t.data_ptr(), name
    assert dq_call["dq_TqNH"] == dq.data_ptr() and dq_call["q_TqNH"] == q.data_ptr()
    assert dq_call["delta_NTq"] not in (lse.data_ptr(), dq_launch_sources["delta_NTq"])
    assert sources["scratch_F"] == _plan.Source("scratch") and dkdv_call["scratch_F"] != 0
    # Offsets changed in place: the work lists the plan keeps are no longer theirs.
    kv_off.add_(0)
    assert _plan.backward_plan(key, q_off, kv_off) is None


def test_backward_plan_is_not_recorded_from_an_unknown_tensor_or_shared_addresses(monkeypatch):
    """A launch argument that is neither a call tensor nor a kept one (a temporary the plan
    would not make again), or two call tensors at one address (q is k: a later call with the
    same key may pass them apart), leaves no plan; an expanded dout (the gradient of
    ``out.sum()``), which the backward reads as a contiguous copy, does not stop one."""
    _plan.forget_all()
    lq = lk = [20, 3]
    q_off = offsets_from_lengths(lq)
    key = ("key", 2)
    _remember_a_plan(monkeypatch, key, q_off, q_off)
    _fake_direct_launches(monkeypatch)
    dout, q, k, v = _backward_tensors(0, lq, lk)
    out, lse, work = jfa_triton.jfa_forward(
        q, k, v, q_off, q_off, causal=False, scale=0.3, rel_bias=None
    )

    def recorded(q, k, v, offsets, dout=dout):
        record = jfa_triton.RecordedBackward()
        jfa_triton.jfa_backward(
            dout, q, k, v, out, lse, offsets, offsets, causal=False, scale=0.3, rel_bias=None,
            forward_work=work, record=record,
        )  # fmt: skip
        return record

    record = recorded(q, k, v, q_off)
    record.kept.clear()  # the work lists are no longer known to outlive the call
    _plan.remember_backward(key, record, q, k, v, out, lse, q_off, q_off)
    assert _plan.backward_plan(key, q_off, q_off) is None
    del record
    record = recorded(q, q, v, q_off)
    _plan.remember_backward(key, record, q, q, v, out, lse, q_off, q_off)
    assert _plan.backward_plan(key, q_off, q_off) is None
    record = recorded(q, k, v, q_off, dout=torch.ones(()).expand(q.shape))
    _plan.remember_backward(key, record, q, k, v, out, lse, q_off, q_off)
    assert _plan.backward_plan(key, q_off, q_off) is not None
    del q_off, record  # the record's launches hold the offsets
    gc.collect()
    assert key not in _plan._BACKWARD_PLANS


# ------------------------------------------------------------------------------------------------
# On the GPU: the recorded launches themselves
# ------------------------------------------------------------------------------------------------


def _cuda_case(lq, lk, *, head_dim, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(t):
        return torch.randn(t, 2, head_dim, device="cuda", dtype=dtype, generator=gen)

    q_off = offsets_from_lengths(lq, device="cuda")
    kv_off = offsets_from_lengths(lk, device="cuda")
    return rand(sum(lq)), rand(sum(lk)), rand(sum(lk)), rand(sum(lq)), q_off, kv_off


def _no_ordinary_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the call went down the ordinary path")

    monkeypatch.setattr(_op, "jfa_forward", fail)
    monkeypatch.setattr(_op, "jfa_backward", fail)


# J3's shape (64 candidate keys, head dim 128) and causal self-attention at head dim 64 take the
# Triton forward by pointers; causal self-attention over longer histories at head dim 128 the
# Gluon forward on Hopper (K and V through descriptors made per call). In the last two the
# longest sequence's key tiles are split (a zeroed scratch, float32 atomics, and after the
# Gluon dK/dV kernel a finishing launch).
GPU_CASES = [
    dict(lq=[1, 70, 0, 33, 64], lk=[64] * 5, head_dim=128, causal=False, gluon=False),
    dict(lq=[90, 0, 1, 200], lk=[90, 0, 1, 200], head_dim=64, causal=True, gluon=False),
    dict(lq=[300, 0, 1, 700, 65], lk=[300, 0, 1, 700, 65], head_dim=128, causal=True, gluon=True),
    dict(lq=[3000, 1, 70, 0], lk=[64] * 4, head_dim=128, causal=False, gluon=False, split=True),
    dict(lq=[4000, 10, 20], lk=[4000, 10, 20], head_dim=128, causal=True, gluon=True, split=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_a_planned_call_equals_the_ordinary_one(monkeypatch, case):
    """A call with new q, k, v and dout, launched from the plans the first call recorded,
    gives what the ordinary path gives for them: the same bits, but where split key tiles
    sum in float32 atomics (in any order) dK and dV to a tolerance."""
    _plan.forget_all()
    shapes = dict(head_dim=case["head_dim"])
    *first, q_off, kv_off = _cuda_case(case["lq"], case["lk"], seed=0, **shapes)
    *second, _, _ = _cuda_case(case["lq"], case["lk"], seed=1, **shapes)

    def step(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = jagged_flash_attention(*leaves, q_off, kv_off, causal=case["causal"])
        grads = torch.autograd.grad(out, leaves, do)
        with torch.no_grad():
            forward_only = jagged_flash_attention(q, k, v, q_off, kv_off, causal=case["causal"])
        return out.detach(), *grads, forward_only

    with launch_plans_off(monkeypatch):
        ordinary = step(*second)
    step(*first)
    (plan,) = _plan._PLANS.values()
    (backward,) = _plan._BACKWARD_PLANS.values()
    on_hopper = torch.cuda.get_device_capability()[0] == 9
    assert plan.descriptors == (case["gluon"] and on_hopper)
    assert ("scratch" in {name for name, *_ in backward.made}) == case.get("split", False)
    with monkeypatch.context() as m:
        _no_ordinary_path(m)
        planned = step(*second)
    for i, (got, want) in enumerate(zip(planned, ordinary, strict=True)):
        if case.get("split") and i in (2, 3):  # dk, dv
            torch.testing.assert_close(got, want)
        else:
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_a_compiled_step_launches_from_the_custom_ops_plans(monkeypatch):
    """A graph compiled by ``torch.compile`` calls the custom ops; after its first step their
    Triton implementations launch from plans recorded under the ops' own keys, and a step with
    new q, k, v and dout gives the ordinary path's bits."""
    _plan.forget_all()
    case = GPU_CASES[2]  # the Gluon kernels on Hopper
    shapes = dict(head_dim=case["head_dim"])
    *first, q_off, kv_off = _cuda_case(case["lq"], case["lk"], seed=0, **shapes)
    *second, _, _ = _cuda_case(case["lq"], case["lk"], seed=1, **shapes)

    def attention(q, k, v):
        return jagged_flash_attention(q, k, v, q_off, kv_off, causal=case["causal"])

    def step(fn, q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return out.detach(), *torch.autograd.grad(out, leaves, do)

    compiled = torch.compile(attention, fullgraph=True)
    with launch_plans_off(monkeypatch):
        ordinary = step(attention, *second)
    step(compiled, *first)
    (key,) = _plan._PLANS
    assert "custom op" in key and key in _plan._BACKWARD_PLANS
    with monkeypatch.context() as m:
        _no_ordinary_path(m)
        planned = step(compiled, *second)
    for got, want in zip(planned, ordinary, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_offsets_changed_in_place_are_checked_and_planned_again(monkeypatch):
    _plan.forget_all()
    q, k, v, _, q_off, kv_off = _cuda_case([5, 60, 0, 30], [64] * 4, head_dim=128)
    with torch.no_grad():
        jagged_flash_attention(q, k, v, q_off, kv_off)
        q_off.copy_(offsets_from_lengths([60, 5, 30, 0], device="cuda"))  # same total
        moved = jagged_flash_attention(q, k, v, q_off, kv_off)
        fresh = jagged_flash_attention(q, k, v, q_off.clone(), kv_off)
        torch.testing.assert_close(moved, fresh, atol=0, rtol=0)
        q_off.copy_(offsets_from_lengths([60, 35, -5, 5], device="cuda"))
        with pytest.raises(ValueError, match="non-decreasing"):
            jagged_flash_attention(q, k, v, q_off, kv_off)


@pytest.mark.gpu
def test_gpu_a_changed_argument_is_checked_not_planned():
    """Each of these differs from a planned call in one argument the checks reject."""
    _plan.forget_all()
    q, k, v, _, q_off, kv_off = _cuda_case([5, 60], [64, 64], head_dim=128)
    with torch.no_grad():
        jagged_flash_attention(q, k, v, q_off, kv_off)
        assert len(_plan._PLANS) == 1
        with pytest.raises(TypeError, match="k has dtype"):
            jagged_flash_attention(q, k.half(), v, q_off, kv_off)
        with pytest.raises(ValueError, match="max_q_len"):
            jagged_flash_attention(q, k, v, q_off, kv_off, max_q_len=-1)
        with pytest.raises(ValueError, match="scale"):
            jagged_flash_attention(q, k, v, q_off, kv_off, scale=float("nan"))
        with pytest.raises(ValueError, match="kv_offsets is on cpu"):
            jagged_flash_attention(q, k, v, q_off, kv_off.cpu())
        with pytest.raises(ValueError, match="head dim"):
            jagged_flash_attention(q[..., :48], k[..., :48], v[..., :48], q_off, kv_off)


@pytest.mark.gpu
def test_gpu_misaligned_views_a_launch_hook_and_another_stream_take_the_ordinary_path():
    """A view of the same shape and strides (the same key) starting 2 bytes in; a profiler's
    launch hook, which must see every launch; another stream, which is another key."""
    from triton import knobs

    _plan.forget_all()
    q, k, v, _, q_off, kv_off = _cuda_case([5, 60, 17], [64] * 3, head_dim=128)
    with torch.no_grad():
        want = jagged_flash_attention(q, k, v, q_off, kv_off)
        storage = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
        shifted = storage[1:].view(q.shape)
        shifted.copy_(q)
        torch.testing.assert_close(jagged_flash_attention(shifted, k, v, q_off, kv_off), want)

        launches = []
        knobs.runtime.launch_enter_hook.add(launches.append)
        try:
            torch.testing.assert_close(jagged_flash_attention(q, k, v, q_off, kv_off), want)
        finally:
            knobs.runtime.launch_enter_hook.remove(launches.append)
        assert launches  # the hook saw the forward's launch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            other = jagged_flash_attention(q, k, v, q_off, kv_off)
        torch.cuda.current_stream().wait_stream(stream)
        torch.testing.assert_close(other, want, atol=0, rtol=0)
    assert len(_plan._PLANS) == 2  # one per stream
