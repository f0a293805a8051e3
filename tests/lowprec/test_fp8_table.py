"""The fp8-or-BF16 decision table: JSON round trip, validation naming the field, the
deterministic rule for missing keys, table mode never timing, building the table before
training, and carrying the decisions through a checkpoint."""

import copy
import json
import types

import pytest
import torch
from gem_lowprec import Fp8Decisions, Fp8Table, LowPrecisionLinear, convert, recipe
from gem_lowprec.fp8_plan import (
    LinearShape,
    build_table,
    fp8_state,
    linear_shapes,
    m_buckets,
    plan_fp8,
    restore_fp8,
)
from gem_lowprec.fp8_table import Fp8Choice, Fp8Key, recipe_id
from gem_lowprec.linear import use_decisions
from torch import nn

MX = recipe_id(recipe("mxfp8"))


def key(m_bucket: int, k: int = 256, n: int = 128, rec: str = MX) -> Fp8Key:
    return Fp8Key(rec, k, n, "float32", "float32", m_bucket)


def sample_table() -> Fp8Table:
    return Fp8Table(
        {
            key(4096): Fp8Choice(True, "measured: faster"),
            key(256): Fp8Choice(False, "measured: not faster"),
            key(256, k=512, rec="fp8_rowwise:wgrad=fp8:e4m3/e4m3:rceil"): Fp8Choice(True, ""),
        }
    )


def never(*args, **kwargs):
    raise AssertionError("table mode must never time or ask whether it may")


def model_with_table(table: Fp8Table) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))
    return convert(
        model, "mxfp8", decisions=Fp8Decisions(table=table, measure=never, timing_allowed=never)
    )


def test_recipe_id_names_what_changes_the_fp8_path():
    assert MX == "mxfp8:wgrad=bf16:e4m3/e4m3:rceil"
    assert recipe_id(recipe("mxfp8", weight_grad="fp8", hadamard_block=64,
                            grad_elem_dtype=torch.float8_e5m2)) == (
        "mxfp8:wgrad=fp8+hadamard64:e4m3/e5m2:rceil"
    )  # fmt: skip


def test_round_trip_through_json_is_exact_and_ordered():
    table = sample_table()
    data = table.to_dict()
    assert data["version"] == 1 and len(data["entries"]) == 3
    assert Fp8Table.from_dict(json.loads(json.dumps(data))) == table
    reversed_order = Fp8Table(dict(reversed(list(table.entries.items()))))
    assert json.dumps(reversed_order.to_dict()) == json.dumps(data)  # same table, same JSON


def _with(path: str, value):
    data = sample_table().to_dict()
    if path.startswith("entries[0]."):
        field = path.removeprefix("entries[0].")
        if value is KeyError:
            del data["entries"][0][field]
        else:
            data["entries"][0][field] = value
    else:
        data[path] = value
    return data


@pytest.mark.parametrize(
    "data, named",
    [
        ([], "mapping"),
        (_with("version", 2), "version"),
        (_with("extra", 1), "'version' and 'entries'"),
        (_with("entries", {}), "entries must be a list"),
        (_with("entries[0].why", KeyError), r"entries\[0\] .*missing \['why'\]"),
        (_with("entries[0].speed", 1.5), r"unknown \['speed'\]"),
        (_with("entries[0].recipe", ""), r"entries\[0\]\.recipe must be a non-empty string"),
        (_with("entries[0].k", 0), r"entries\[0\]\.k must be a positive int"),
        (_with("entries[0].n", True), r"entries\[0\]\.n must be a positive int"),
        (_with("entries[0].x_dtype", "float64"), r"entries\[0\]\.x_dtype must be one of"),
        (_with("entries[0].out_dtype", ["bfloat16"]), r"entries\[0\]\.out_dtype must be one of"),
        (_with("entries[0].m_bucket", 48), r"entries\[0\]\.m_bucket must be a power of two"),
        (_with("entries[0].m_bucket", 0), r"entries\[0\]\.m_bucket must be a power of two"),
        (_with("entries[0].keep_fp8", "yes"), r"entries\[0\]\.keep_fp8 must be a bool"),
        (_with("entries[0].why", 3), r"entries\[0\]\.why must be a string"),
    ],
)  # fmt: skip
def test_validation_names_the_field(data, named):
    with pytest.raises(ValueError, match=named):
        Fp8Table.from_dict(data)


def test_a_repeated_key_is_refused():
    data = sample_table().to_dict()
    data["entries"].append(copy.deepcopy(data["entries"][0]))
    with pytest.raises(ValueError, match=r"entries\[3\] repeats the key"):
        Fp8Table.from_dict(data)


def test_missing_keys_take_the_nearest_m_bucket_then_nothing():
    table = sample_table()
    picked = {m: table.lookup(key(m)) for m in (256, 512, 1024, 2048, 65536, 1)}
    assert {m: found[0].m_bucket for m, found in picked.items()} == {
        256: 256,
        512: 256,
        1024: 256,
        2048: 4096,
        65536: 4096,
        1: 256,
    }  # fmt: skip  (1024 is two binades from both: the tie takes the smaller bucket)
    assert picked[512][1] == Fp8Choice(False, "measured: not faster")
    assert table.lookup(key(256, k=1024)) is None  # no entry of that shape
    assert table.lookup(key(256, rec="fp8_rowwise:wgrad=bf16:e4m3/e4m3:rceil")) is None


def test_table_mode_never_times_and_records_each_choice_with_its_rule():
    """Where the measured mode times (a CUDA input, fallback.measure_on_gpu), table mode looks
    the key up; a missing key takes the nearest bucket, then the shape rule."""
    rec = recipe("mxfp8")
    x = types.SimpleNamespace(is_cuda=True, dtype=torch.float32, device=torch.device("cuda"))
    w = types.SimpleNamespace(dtype=torch.float32)
    timed = []
    measured = Fp8Decisions(measure=lambda *a: timed.append(a) or (True, ""),
                            timing_allowed=lambda x: True)  # fmt: skip
    assert measured.use_fp8(rec, 4096, 256, 128, x, w) and len(timed) == 1
    decisions = Fp8Decisions(table=sample_table(), measure=never, timing_allowed=never)
    with pytest.warns(UserWarning, match="falls back to bf16: nearest M bucket 256"):
        assert not decisions.use_fp8(rec, 496, 256, 128, x, w)
    assert decisions.use_fp8(rec, 3008, 256, 128, x, w)
    assert decisions.use_fp8(rec, 64, 1024, 128, x, w)  # no entry for K=1024: the shape rule
    with pytest.warns(UserWarning, match="must be a multiple of 16"):  # whatever the table says
        assert not decisions.use_fp8(rec, 40, 256, 128, x, w)
    assert {k.m_bucket: c.why.split(":")[0] for k, c in decisions.used.items()} == {
        512: "nearest M bucket 256", 4096: "table", 64: "shape rule",
    }  # fmt: skip
    assert decisions.measure_pending() == 0 and not decisions.unmeasured_keys()


def test_linears_in_table_mode_run_what_the_table_says_without_timing():
    model = model_with_table(Fp8Table({key(256): Fp8Choice(False, "measured: not faster")}))
    x = torch.randn(256, 256)
    with pytest.warns(UserWarning, match="falls back to bf16"):
        y = model(x)
    bf16 = nn.functional.linear(x, model[0].weight, model[0].bias).relu() @ model[2].weight.t()
    torch.testing.assert_close(y, bf16 + model[2].bias, rtol=0, atol=0)  # BF16 path, exactly
    used = model.lowprec_conversion.decisions.used
    assert used == {key(256): Fp8Choice(False, "table: measured: not faster")}


def test_build_table_measures_each_shape_and_bucket_once_before_training():
    torch.manual_seed(0)
    model = convert(
        nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 256), nn.Linear(256, 96),
                      nn.Linear(96, 1)), "mxfp8",
    )  # fmt: skip
    shapes = linear_shapes(model)
    assert [(s.k, s.n) for s in shapes] == [(128, 256), (256, 96), (256, 128)]
    calls = []

    def measure(rec, m, k, n, x_dtype, w_dtype, out_dtype, device):
        calls.append((m, k, n, x_dtype, w_dtype, out_dtype))
        return m >= 1024, f"fake {m}"

    table = build_table(shapes, device="cpu", m_range=(300, 2000), x_dtype=torch.float32,
                        measure=measure)  # fmt: skip
    assert sorted({c[0] for c in calls}) == [512, 1024, 2048] and len(calls) == 6
    assert calls[0][3:] == (torch.float32, torch.float32, torch.float32)
    assert table.entries[key(1024, 128, 256)] == Fp8Choice(True, "fake 1024")
    # N = 96 is no multiple of 128: BF16, not measured
    assert not table.entries[key(512, 256, 96)].keep_fp8
    assert "multiples of 128" in table.entries[key(512, 256, 96)].why
    cpu = build_table(shapes, device="cpu", m_values=[40, 100], x_dtype=torch.float32)
    assert cpu.entries[key(128, 256, 128)].why.startswith("shape rule")
    assert sorted({k.m_bucket for k in cpu.entries}) == [64, 128]


def test_m_buckets_and_their_errors():
    assert m_buckets(m_values=[1000, 1024, 5000]) == [1024, 8192]
    assert m_buckets(m_range=(100, 1000)) == [128, 256, 512, 1024]
    with pytest.raises(ValueError, match="exactly one of m_values"):
        m_buckets()
    with pytest.raises(ValueError, match="m_values must be positive ints"):
        m_buckets(m_values=[0])
    with pytest.raises(ValueError, match="m_range must be"):
        m_buckets(m_range=(10, 5))


def test_decisions_go_through_a_checkpoint_and_resume_without_timing():
    table = build_table([LinearShape(recipe("mxfp8"), 256, 128, torch.float32)], device="cpu",
                        m_values=[256], x_dtype=torch.float32,
                        measure=lambda *a: (False, "slow"))  # fmt: skip
    model = model_with_table(table)
    with pytest.warns(UserWarning):
        model(torch.randn(512, 256))  # bucket 512: the nearest is 256's
    saved = json.loads(json.dumps(fp8_state(model)))  # what a checkpoint or summary holds
    assert Fp8Table.from_dict(saved["table"]) == table
    assert [e["why"] for e in saved["used"]["entries"]] == ["nearest M bucket 256: slow"]
    resumed = model_with_table(Fp8Table())
    decisions = restore_fp8(resumed, saved)
    assert decisions.table == table and decisions.state_dict() == saved
    assert all(mod.decisions is decisions for mod in resumed if isinstance(mod, LowPrecisionLinear))
    assert resumed.lowprec_conversion.decisions is decisions
    with pytest.raises(ValueError, match=r"used: entries\[0\]\.keep_fp8 must be a bool"):
        restore_fp8(resumed, {**saved, "used": _with("entries[0].keep_fp8", 1)})
    with pytest.raises(ValueError, match="fields 'table' and 'used'"):
        Fp8Decisions.from_state_dict({"table": saved["table"]})


def test_measured_decisions_export_as_a_table():
    decisions = Fp8Decisions()
    decisions.measured[(recipe("mxfp8"), 256, 128, torch.bfloat16, torch.bfloat16, 4096)] = (
        True,
        "measured fwd+bwd",
    )
    state = decisions.state_dict()
    assert state["table"]["entries"][0]["x_dtype"] == "bfloat16" and not state["used"]["entries"]
    assert Fp8Decisions.from_state_dict(state).table == decisions.measured_table()


def test_plan_fp8_without_a_process_group_builds_and_installs_one_table():
    model = model_with_table(Fp8Table())
    decisions = plan_fp8(model, device="cpu", m_values=[256], x_dtype=torch.float32,
                         measure=lambda *a: (True, "fast"))  # fmt: skip
    assert model[0].decisions is decisions and decisions.table.entries == {
        key(256): Fp8Choice(True, "fast")
    }
    with pytest.raises(TypeError, match="decisions must be an Fp8Decisions"):
        use_decisions(model, decisions.table)
    with pytest.raises(TypeError, match="table must be an Fp8Table"):
        Fp8Decisions(table=decisions.table.to_dict())
