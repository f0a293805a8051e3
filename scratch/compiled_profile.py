import sys, time, cProfile, pstats
from pathlib import Path
import torch
sys.path[:0] = ["benchmarks", "benchmarks/jagged"]
import attention_bench as ab, common, bench_jagged_flash_attention as b
from gem_jagged import jagged_flash_attention

def host(fn, n=30):
    fn(); torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): fn()
        best.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return min(best)

w = {w.name: w for w in b.workloads(False)}["J1"]
q, k, v, do = ab.make_inputs(w, "cuda", torch.bfloat16, b.HEADS, b.HEAD_DIM)
fn = b.project_fn(w, q, k, v, "cuda")
cfn = torch.compile(fn, fullgraph=True)
leaves = [t.detach().requires_grad_() for t in (q, k, v)]
step = lambda: torch.autograd.grad(cfn(*leaves), leaves, do)
def fwd():
    with torch.no_grad(): cfn(*leaves)
for _ in range(3): step(); fwd()
torch.cuda.synchronize()
print("compiled step host us", host(step), "fwd host us", host(fwd))
print("do_bench step ms", common.bench_ms(step))
prof = cProfile.Profile(); prof.enable()
for _ in range(20): step()
torch.cuda.synchronize(); prof.disable()
rows = sorted(pstats.Stats(prof).stats.items(), key=lambda it: it[1][2], reverse=True)[:30]
for (path, line, name), (_, nc, tt, ct, _) in rows:
    print(f"{tt/20*1e6:8.1f} own {ct/20*1e6:8.1f} cum x{nc/20:<5.3g} {name} ({Path(path).parent.name}/{Path(path).name}:{line})")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(5): step()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
