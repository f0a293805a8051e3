"""Two gloo processes on the CPU: each rank's own measurement answers differently, yet after the
table is built on rank 0 and broadcast (``plan_fp8``) both ranks hold the same table and their
``LowPrecisionLinear`` calls make the same choices, without timing anything.

The file is also the worker (``python test_fp8_table_gloo.py RANK INIT_FILE OUT_DIR``): the test
starts two of them with a ``file://`` rendezvous and compares what each wrote.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

WORLD = 2
M_TABLE = [256, 1024]  # the buckets the table is built for
M_CALLS = [256, 1024, 512, 4096, 64]  # 512, 4096 and 64 are missing: the nearest bucket's entry


def worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from gem_lowprec import convert
    from gem_lowprec.fp8_plan import build_table, linear_shapes, plan_fp8
    from torch import nn

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same model on both ranks
    model = nn.Sequential(
        nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1)
    )
    convert(model, "mxfp8")
    calls = []

    def measure(rec, m, k, n, x_dtype, w_dtype, out_dtype, device):
        """A timing that disagrees between the ranks, as two processes' timings can."""
        calls.append((m, k, n))
        return (m // 256 + k // 128 + rank) % 2 == 0, f"rank {rank}'s timing at M={m}"

    shapes = linear_shapes(model)
    local = build_table(shapes, device="cpu", m_values=M_TABLE, x_dtype=torch.float32,
                        measure=measure)  # fmt: skip
    calls.clear()
    decisions = plan_fp8(model, device="cpu", m_values=M_TABLE, x_dtype=torch.float32,
                         measure=measure)  # fmt: skip

    def never(*args, **kwargs):
        raise AssertionError("a call timed in table mode")

    decisions.measure = decisions.timing_allowed = never
    outputs = []
    for m in M_CALLS:
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        with torch.no_grad():
            outputs.append(model(x).double().sum().item())
    result = {
        "local": local.to_dict(),
        "table": decisions.table.to_dict(),
        "used": decisions.used_table().to_dict(),
        "plan_measured": len(calls),
        "outputs": outputs,
        "same_object": all(model[i].decisions is decisions for i in (0, 2)),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_with_disagreeing_timings_choose_the_same(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    init_file = tmp_path / "rendezvous"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(init_file), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in range(WORLD)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert r0["local"] != r1["local"]  # measured on their own, the ranks disagree
    assert r0["table"] == r1["table"] == r0["local"]  # rank 0's table, on both
    assert r0["plan_measured"] == 4 and r1["plan_measured"] == 0  # only rank 0 measured
    assert r0["used"] == r1["used"] and r0["outputs"] == r1["outputs"]
    assert r0["same_object"] and r1["same_object"]
    used = {(e["k"], e["m_bucket"]): e for e in r0["used"]["entries"]}
    assert used[(256, 512)]["why"].startswith("nearest M bucket 256: rank 0's timing")
    assert used[(128, 4096)]["why"].startswith("nearest M bucket 1024: rank 0's timing")
    assert {e["keep_fp8"] for e in used.values()} == {True, False}  # both paths were taken


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
