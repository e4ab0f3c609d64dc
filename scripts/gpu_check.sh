#!/usr/bin/env bash
# Every GPU check in one call: the GPU tests (pytest -m gpu) and every benchmark. Logs under $OUT
# (default ./gpu_out); a short table last. Usage: bash scripts/gpu_check.sh
# GIT_COMMIT names the commit in the bench header where the copy has no .git.
# Each step has a time cap so one slow step cannot eat the others' time; add new steps with `step`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SUMMARY=()

step() {  # step NAME CAP_SECONDS COMMAND...
  local name="$1" cap="$2"
  shift 2
  local t0=$SECONDS
  echo "=== $name (cap ${cap}s) ==="
  timeout "$cap" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("| $name | $rc | $((SECONDS - t0)) s | $OUT/$name.log |")
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
step gpu_tests "${GPU_TESTS_CAP:-240}" "$PY" -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  step bench_tp "${BENCH_TP_CAP:-300}" "$PY" bench/tp.py --out "$OUT/bench_tp.md"
fi
step bench_kernels "${BENCH_KERNELS_CAP:-200}" "$PY" bench/kernels.py --out "$OUT/bench_kernels.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}

echo
cat "$OUT/bench_kernels.md" "$OUT/bench_tp.md" 2>/dev/null || true
echo
echo "| step | rc | time | log |"
echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
