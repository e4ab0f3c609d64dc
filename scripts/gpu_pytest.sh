#!/usr/bin/env bash
# The GPU tests of the given files, side by side (scripts/gpu_check.sh's kernel steps). Compiling the kernels'
# variants is most of these tests' time on a fresh machine, so GPU_WORKERS pytest-xdist workers (default 6)
# run them and compile at once. The tests marked real_shape_layers (bf16 layers of about 45 GB per module) run
# apart, in one process beside the workers, one module's after the other's: two processes holding such layers
# would not fit an H100. (Not xdist's --dist loadgroup: with pytest 9.2 and xdist 3.8 it spread one group's
# tests over every worker, 2026-12-07.) GPU_WORKERS=0, or no pytest-xdist: every test in this process
# (tests/test_gpu_pytest.py checks both). LAYERS_LOG: where the separate process's output goes (printed
# after the workers' output; a killed run leaves it there). Exit: the first failing run's code; pytest's 5
# (nothing collected) only when neither run collected a test.
# Usage: [GPU_WORKERS=N] [LAYERS_LOG=file] bash scripts/gpu_pytest.sh FILE_OR_PYTEST_ARG...
set -uo pipefail
PY="${PYTHON:-python3}"
ARGS=(-q -p no:cacheprovider --durations=8 -o faulthandler_timeout=45)
workers="${GPU_WORKERS:-6}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "GPU_WORKERS=$workers: expected a number of pytest-xdist workers (0: one process)"
  exit 2
fi
workers=$((10#$workers))  # "08": a number of workers, not an octal digit string
if [ "$workers" -gt 0 ] && ! "$PY" -c "import xdist" 2>/dev/null; then
  echo "note: pytest-xdist is not installed: the GPU tests run in one process"
  workers=0
fi
if [ "$workers" = 0 ]; then
  exec "$PY" -m pytest -m gpu "${ARGS[@]}" "$@"
fi
# the cores shared out among the workers and the layers process, unless OMP_NUM_THREADS is given: torch starts a
# thread per core in each process otherwise (6 workers x 16 threads on 16 cores), for the tests' CPU work
# (references, host banks); on an H100 on 2026-12-07 most of the workers' 45 s stack dumps were in such work
cores=$(nproc 2>/dev/null || echo 1)
share=$(( cores / (workers + 1) ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( share > 0 ? share : 1 ))}"
layers_log="${LAYERS_LOG:-$(mktemp)}"
"$PY" -m pytest -m "gpu and real_shape_layers" "${ARGS[@]}" "$@" >"$layers_log" 2>&1 &
layers_pid=$!
"$PY" -m pytest -m "gpu and not real_shape_layers" -n "$workers" "${ARGS[@]}" "$@"
rc_rest=$?
wait "$layers_pid"
rc_layers=$?
echo
echo "=== the real_shape_layers tests (one process beside the workers; exit $rc_layers) ==="
cat "$layers_log"
[ -n "${LAYERS_LOG:-}" ] || rm -f "$layers_log"
if [ "$rc_rest" = 5 ] && [ "$rc_layers" = 5 ]; then exit 5; fi
for rc in "$rc_rest" "$rc_layers"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
