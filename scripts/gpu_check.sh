#!/usr/bin/env bash
# The GPU runner. On the GPU machine's fixed image (python3 with torch and triton; no uv, no
# network) it puts every package's src/ on PYTHONPATH, runs the gpu-marked tests, then the
# benchmarks, and prints one summary table last.
#
#   scripts/gpu_check.sh                          # gpu tests + every benchmarks/*/*.py
#   scripts/gpu_check.sh "benchmarks/jagged/bench_gdpa.py --quick" benchmarks/lowprec/*.py
#   scripts/gpu_check.sh "benchmarks/diagnostics/bench_energy.py --rounds 3"
#
# The default set leaves out benchmarks/diagnostics/ (profilers and A/B tools): they run only
# when named. benchmarks/README.md describes the suite and how its results are kept.
# Each argument is a benchmark script (a glob is fine) followed by its own arguments, quoted
# inside as on a command line: "benchmarks/gem_train/bench_gem_small.py --only 'all on'".
# Environment: GEMKIT_SKIP_TESTS=1 skips the tests; GEMKIT_TEST_PATHS (default: tests);
# GEMKIT_TEST_MARK (default: gpu; on a host with several GPUs "gpu or multigpu" adds the
# multi-GPU tests); GEMKIT_TEST_WORKERS (default 6 where pytest-xdist is installed and the mark
# leaves out multigpu, else 0: the tests spend most of their time compiling Triton kernels on the
# host, which workers share out; 86 GPU tests took 116 s with 6 on an H200 host, about 4.5
# minutes with none);
# GEMKIT_TEST_TIMEOUT / GEMKIT_BENCH_TIMEOUT bound each step in seconds; GEMKIT_LOG_DIR keeps
# gpu_check.log (everything printed) and results.jsonl (the summary rows); PYTHON (default:
# python3) is the interpreter.
#
# GEMKIT_GPUS=N (a host with several GPUs) runs N streams side by side, stream i on GPU i: the
# test paths and the benchmark arguments are dealt out in turn (path k and argument k to stream
# k mod N), so list several test paths to spread the tests. Each stream writes its own log under
# GEMKIT_LOG_DIR/stream<i>; the combined log and one summary come last. The streams share the
# host's CPU cores.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src "$PWD"/apps/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
log_dir="${GEMKIT_LOG_DIR:-$(mktemp -d)}"
mkdir -p "$log_dir"
log="$log_dir/gpu_check.log"
export GEMKIT_RESULTS="$log_dir/results.jsonl"
: > "$GEMKIT_RESULTS"
: > "$log"

summary() { # summary RESULTS_JSONL: one line per row, after everything else
  echo; echo "## summary"
  "$python" - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    name = row.pop("benchmark")
    if row.get("kind") == "goal":  # common.record_goal: the goal's ratio, target and basis
        target = "no target" if row["target"] is None else f"target {row['target']:g} ({row['target_of']})"
        print(f"{name:28s} goal {row['goal']}, {row['workload']}: {row['ratio']:.3g} x {row['anchor']}, {target}, {row['basis']}")
        continue
    print(f"{name:28s} " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
PY
}

default_benchmarks() { # every benchmarks/<area>/*.py except benchmarks/diagnostics/, one a line
  local f
  for f in benchmarks/*/*.py; do [[ "$f" == benchmarks/diagnostics/* ]] || echo "$f"; done
}

gpus="${GEMKIT_GPUS:-1}"
if [ "$gpus" -gt 1 ]; then
  read -r -a paths <<< "${GEMKIT_TEST_PATHS:-tests}"
  specs=("$@")
  [ ${#specs[@]} -gt 0 ] || mapfile -t specs < <(default_benchmarks)
  for ((i = 0; i < gpus; i++)); do
    mine_paths=() mine_specs=()
    for ((k = i; k < ${#paths[@]}; k += gpus)); do mine_paths+=("${paths[k]}"); done
    for ((k = i; k < ${#specs[@]}; k += gpus)); do mine_specs+=("${specs[k]}"); done
    [ ${#mine_specs[@]} -gt 0 ] || mine_specs=(none)  # a name that is no file: no benchmark
    skip="${GEMKIT_SKIP_TESTS:-}"
    [ ${#mine_paths[@]} -gt 0 ] || skip=1
    CUDA_VISIBLE_DEVICES=$i GEMKIT_GPUS=1 GEMKIT_SKIP_TESTS="$skip" \
      GEMKIT_TEST_PATHS="${mine_paths[*]:-}" GEMKIT_LOG_DIR="$log_dir/stream$i" \
      "$PWD/scripts/gpu_check.sh" "${mine_specs[@]}" > /dev/null 2>&1 &
  done
  status=0
  for job in $(jobs -p); do wait "$job" || status=1; done
  for ((i = 0; i < gpus; i++)); do
    { echo "### stream $i (GPU $i)"; cat "$log_dir/stream$i/gpu_check.log"; } >> "$log"
    cat "$log_dir/stream$i/results.jsonl" >> "$GEMKIT_RESULTS"
  done
  cat "$log"
  summary "$GEMKIT_RESULTS"
  exit $status
fi

bounded() { # bounded SECONDS CMD...: run CMD with a time limit when SECONDS is set
  if [ -n "$1" ]; then local s=$1; shift; timeout --signal=INT --kill-after=10 "$s" "$@"; else shift; "$@"; fi
}

"$python" -c "import torch, triton; print(f'device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}')" 2>&1 | tee -a "$log"

status=0
if [ -z "${GEMKIT_SKIP_TESTS:-}" ]; then
  mark="${GEMKIT_TEST_MARK:-gpu}"
  workers=0  # multi-GPU tests each take every GPU: one at a time
  if [[ "$mark" != *multigpu* ]] && "$python" -c 'import xdist' 2>/dev/null; then workers=6; fi
  workers="${GEMKIT_TEST_WORKERS:-$workers}"
  # shellcheck disable=SC2086
  bounded "${GEMKIT_TEST_TIMEOUT:-}" "$python" -m pytest -q -m "$mark" -n "$workers" -p no:cacheprovider ${GEMKIT_TEST_PATHS:-tests} 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)( |,|$)' "$log" | tail -n 1 | tr -d '=' | xargs)
  echo "{\"benchmark\": \"gpu tests\", \"result\": \"${summary:-no summary (rc $rc)}\"}" >> "$GEMKIT_RESULTS"
fi

specs=("$@")
[ ${#specs[@]} -gt 0 ] || mapfile -t specs < <(default_benchmarks)
for spec in "${specs[@]}"; do
  # The first word is the script (a glob is fine); the rest are its arguments, quoted as on a
  # command line (--only "all on" "AutoAC → none").
  read -r first rest <<< "$spec"
  eval "args=($rest)"
  for script in $first; do
    [ -f "$script" ] || continue
    case "$(basename "$script")" in common.py|_*|*_bench.py) continue ;; esac
    echo; echo "=== $script $rest" | tee -a "$log"
    bounded "${GEMKIT_BENCH_TIMEOUT:-}" "$python" "$script" "${args[@]}" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
      status=1
      echo "{\"benchmark\": \"$(basename "$script" .py)\", \"result\": \"exit $rc\"}" >> "$GEMKIT_RESULTS"
    fi
  done
done

summary "$GEMKIT_RESULTS"
exit $status
