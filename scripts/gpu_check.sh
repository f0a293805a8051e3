#!/usr/bin/env bash
# Runs on the GPU machine's fixed image (python3 with torch and triton; no uv, no network):
# puts every package's src/ on PYTHONPATH, runs the gpu-marked tests, then every benchmark, and
# prints one summary table last. Usage: scripts/gpu_check.sh [benchmark-glob ...]
#   e.g. scripts/gpu_check.sh 'benchmarks/jagged/*.py'   (default: every benchmarks/*/*.py)
# GEMKIT_SKIP_TESTS=1 skips the tests; GEMKIT_LOG_DIR keeps the full logs (default: a temp dir).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src "$PWD"/apps/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
log_dir="${GEMKIT_LOG_DIR:-$(mktemp -d)}"
mkdir -p "$log_dir"
export GEMKIT_RESULTS="$log_dir/results.jsonl"
: > "$GEMKIT_RESULTS"

python3 - <<'PY'
import torch, triton
print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
PY

status=0
if [ -z "${GEMKIT_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m "gpu" -n 0 -p no:cacheprovider tests 2>&1 | tee "$log_dir/gpu_tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
  echo "{\"benchmark\": \"gpu tests\", \"result\": \"$(tail -n 1 "$log_dir/gpu_tests.log" | tr -d '=' | xargs)\"}" >> "$GEMKIT_RESULTS"
fi

patterns=("$@")
[ ${#patterns[@]} -gt 0 ] || patterns=('benchmarks/*/*.py')
for pattern in "${patterns[@]}"; do
  for script in $pattern; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    echo; echo "=== $script"
    python3 "$script" 2>&1 | tee "$log_dir/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "{\"benchmark\": \"$name\", \"result\": \"FAILED\"}" >> "$GEMKIT_RESULTS"; }
  done
done

echo; echo "## summary"
python3 - "$GEMKIT_RESULTS" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    name = row.pop("benchmark")
    print(f"{name:28s} " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
PY
exit $status
