#!/usr/bin/env bash
# Nsight Compute on the decode kernels (GPU, a machine whose runtime exposes the counters): for each case
# "shape format M variant" in CASES, the steady-state launches of `python -m bench.profile_decode` under ncu
# (speed of light, occupancy, warp stalls, instruction mix, top stall sites), then the SASS of every Triton
# kernel compiled in the run. Everything under $OUT (default ./gpu_out): ncu_<case>.txt, sass.tar.gz.
# Usage: CASES="deepseek int4-g128 1 inline;qwen3 bf16 1 inline" bash scripts/ncu_decode.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT/sass"
PY="${PYTHON:-python3}"
NCU="${NCU:-ncu}"
WARMUP=3
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
  --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
IFS=';' read -ra CASE_LIST <<< "${CASES:-deepseek int4-g128 1 inline}"
for c in "${CASE_LIST[@]}"; do
  read -r shape fmt m variant <<< "$c"
  name="${shape}_${fmt}_m${m}_${variant}"
  echo "=== $name ==="
  # two kernels per decode call on every variant profiled here: skip the warm-up calls' launches
  # shellcheck disable=SC2086
  timeout "${NCU_CAP:-120}" "$NCU" --clock-control none -k 'regex:_gemm|_gate_up|_down|_fused' \
    --launch-skip $((2 * WARMUP)) --launch-count 2 $SECTIONS \
    "$PY" -m bench.profile_decode --shape "$shape" --format "$fmt" --m "$m" --variant "$variant" \
    --warmup "$WARMUP" --iters 1 > "$OUT/ncu_$name.txt" 2>&1
  echo "rc $?"
  grep -E "^  _|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Theoretical Occupancy|Block Limit" "$OUT/ncu_$name.txt" | head -60
done
for f in $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' 2>/dev/null); do
  n="$(basename "$f" .cubin)_$(basename "$(dirname "$f")" | cut -c1-8)"
  cuobjdump -sass "$f" > "$OUT/sass/$n.sass" 2>&1
done
tar -czf "$OUT/sass.tar.gz" -C "$OUT" sass && rm -rf "$OUT/sass"
ls -la "$OUT"
