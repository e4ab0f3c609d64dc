#!/usr/bin/env bash
# Every GPU check, one script: the GPU tests (pytest -m gpu) and every benchmark, as steps (a device call
# runs at most 10 minutes: pick steps with ONLY, see below). Results (markdown, JSON, PNG) under $OUT (default
# ./gpu_out); each step's log under $OUT/logs/, packed at the end into one
# $OUT/logs.tar.gz (a device run returns at most 8 files: MAX_FILES); a short table last, after the failure
# summary of any failing pytest step; exits with the first failing step's code. Usage: bash scripts/gpu_check.sh
# GIT_COMMIT names the commit in the bench header where the copy has no .git.
# QUICK=1: only the kernel GPU tests and the quick benchmark (decode rows, a prefill row, the decode sweep),
# then the decode kernel variants side by side (bench_variants, ~100 s).
# Each step has a time cap so one slow step cannot eat the others' time; add new steps with `step`.
# SKIP="name ..." leaves steps out; ONLY="name ..." runs only those; GPU_TESTS="files" narrows gpu_tests (and
# then gpu_tests_stack does not run). One device call runs at most 10 minutes: run the steps in a few calls
# (e.g. ONLY="gpu_tests", then ONLY="gpu_tests_b", then ONLY="gpu_tests_stack bench_planner", then
# ONLY="bench_kernels bench_variants bench_prefill"; keep the sum of a call's step caps under 600 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
# a fresh device machine has the image's packages but not this project: install it (no registry there)
if ! "$PY" -c "import pooled_runner.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . || { echo "pip install -e . failed"; exit 1; }
fi
# Triton's compile cache (scripts/triton_cache.py). Compiling the kernels' variants was most of the kernel tests'
# time on a fresh machine (2026-12-07, H100: 204 of 217 kernel tests in two steps of 420 + 360 s, one test over
# 45 s compiling 72 variants). A cache carried in (run's carry: ".triton_cache", holding the parts that
# SAVE_TRITON_CACHE=1 wrote under $OUT) is unpacked first; Triton keys each entry by the kernel's source, options,
# its own version and the target (sm_90 for the H100 and H200 alike), so a changed kernel compiles afresh.
# Entries of kernels since changed stay in the cache until its parts reach 48 MiB; then the least recently used
# are left out of the packed parts
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
"$PY" scripts/triton_cache.py unpack .triton_cache "$TRITON_CACHE_DIR"
save_cache() {  # SAVE_TRITON_CACHE=1: after each GPU test step and at the end (a killed call keeps the last)
  if [ "${SAVE_TRITON_CACHE:-0}" = 1 ]; then "$PY" scripts/triton_cache.py pack "$TRITON_CACHE_DIR" "$OUT"; fi
}
# the GPU tests run through scripts/gpu_pytest.sh: GPU_WORKERS pytest-xdist workers (default 6, of the device
# machine's 16 cores) compiling side by side, the real-shape layers' tests in one process beside them
gpu_test_step() {  # gpu_test_step STEP CAP FILES_OR_PYTEST_ARGS...: one step of GPU tests
  local name="$1" cap="$2"
  shift 2
  step "$name" "$cap" env LAYERS_LOG="$LOGS/$name.layers.log" PYTHON="$PY" bash scripts/gpu_pytest.sh "$@"
  if [ "$STEP_RAN" = 1 ]; then save_cache; fi
}
SUMMARY=()
FAILED_TESTS=()  # logs of pytest steps that failed
WORST=0  # the first failing step's exit code: the script's own (a red step must not look green to the caller)

step() {  # step NAME CAP_SECONDS COMMAND...   (SKIP="name ..." leaves steps out)
  local name="$1" cap="$2"
  shift 2
  STEP_RAN=0
  case " ${SKIP:-} " in *" $name "*) echo "=== $name skipped ==="; return ;; esac
  if [ -n "${ONLY:-}" ]; then case " $ONLY " in *" $name "*) ;; *) return ;; esac; fi
  local t0=$SECONDS
  STEP_RAN=1
  echo "=== $name (cap ${cap}s) ==="
  timeout -k 15 "$cap" "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("| $name | $rc | $((SECONDS - t0)) s | logs/$name.log |")
  if [ "$rc" != 0 ] && [ "$WORST" = 0 ]; then WORST=$rc; fi
  case " $* " in *" pytest "* | *"gpu_pytest.sh"*) [ "$rc" = 0 ] || FAILED_TESTS+=("$name") ;; esac
}

# the kernel-level GPU tests (step gpu_tests); the others (planner, staging, transformers, TP) are gpu_tests_stack.
# faulthandler_timeout: a test still running after 45 s (the longest took 34 s on the H200) prints every thread's
# Python stack into the log, before the step's cap stops it (one gpu_tests_stack run stopped at its cap on
# 2026-12-02, after 36 tests, with no way to tell where it stood; hence also its cap of 360 s for ~270 s of tests)
# The kernel files in two steps (gpu_tests, gpu_tests_b): on 2026-12-07 an H100 ran 191 of them in 450 s, so
# one step no longer fits a 10-minute call with room to spare; run them as ONLY=gpu_tests, then ONLY=gpu_tests_b
KERNEL_TESTS_A="tests/test_kernels_gpu.py tests/test_decode_variants_gpu.py tests/test_stock_sglang_gpu.py"
KERNEL_TESTS_B="tests/test_kernels_swap_gpu.py tests/test_pdl_gpu.py tests/test_splitk_gpu.py tests/test_gemv_words_gpu.py tests/test_gemv_half_gpu.py tests/test_gemv_schedule_gpu.py"
KERNEL_TESTS="$KERNEL_TESTS_A $KERNEL_TESTS_B"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
if [ "${QUICK:-0}" = 1 ]; then
  # ~330 + ~90 + ~130 s measured (2026-12-01): the caps leave the call's 10 minutes little room, and on
  # 2026-12-02 a fresh machine needed over 400 s for the kernel tests alone: there, run the steps in two calls
  gpu_test_step gpu_tests "${GPU_TESTS_CAP:-360}" $KERNEL_TESTS
  step bench_kernels "${BENCH_KERNELS_CAP:-130}" "$PY" -m bench.kernels --quick --out "$OUT/bench_kernels.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_variants "${BENCH_VARIANTS_CAP:-130}" "$PY" -m bench.kernels --variants --budget 100 --out "$OUT/bench_variants.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
else
  if [ -n "${GPU_TESTS:-}" ]; then
    gpu_test_step gpu_tests "${GPU_TESTS_CAP:-330}" $GPU_TESTS
  else  # two steps: all GPU tests together outgrew one 10-minute device call (H200, 2026-11-30: > 540 s);
    # the kernel files alone took 304-319 s of pytest time (308-324 s per step) on 2026-12-01; on 2026-12-02 a
    # fresh machine ran 104 of the 108 in 400 s (no test over 45 s); since 2026-12-07 they are two steps (above)
    gpu_test_step gpu_tests "${GPU_TESTS_CAP:-420}" $KERNEL_TESTS_A
    gpu_test_step gpu_tests_b "${GPU_TESTS_B_CAP:-360}" $KERNEL_TESTS_B
    # the rest (planner, staging, transformers, TP) through the workers too: in one process a fresh H100 ran 40
    # of its 86 tests in 300 s, compiling (2026-12-07; 146 s with its compile cache warm); its kernels go into
    # the saved cache as well
    gpu_test_step gpu_tests_stack "${GPU_TESTS_STACK_CAP:-360}" tests $(for f in $KERNEL_TESTS; do printf -- '--ignore=%s ' "$f"; done)
  fi
  step bench_kernels "${BENCH_KERNELS_CAP:-200}" "$PY" -m bench.kernels --quick --out "$OUT/bench_kernels.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # issue #4's "never slower than stock SGLang": stock's own kernels and tuned configs (bench/stock_sglang/), timed
  # beside ours on this card, decode widths M = 1-16
  step bench_stock "${BENCH_STOCK_CAP:-180}" "$PY" -m bench.stock_compare --out "$OUT/bench_stock.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the rest of DESIGN.md §4's stock shapes: Qwen3-like wide steps and prefill, the Mixtral-like layer (stock's
  # CUDA align made before capture: bench/stock_sglang/align.py)
  step bench_stock_wide "${BENCH_STOCK_WIDE_CAP:-120}" "$PY" -m bench.stock_compare --shapes qwen3 --ms 64,512,4096 --out "$OUT/bench_stock_wide.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # our align alone at the same widths (stock's CUDA align is not timed in the rows above)
  step bench_align "${BENCH_ALIGN_CAP:-60}" "$PY" -m bench.align_time --out "$OUT/bench_align.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_stock_mixtral "${BENCH_STOCK_MIXTRAL_CAP:-150}" "$PY" -m bench.stock_compare --shapes mixtral --ms 1,4,16,512,4096 --out "$OUT/bench_stock_mixtral.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_variants "${BENCH_VARIANTS_CAP:-200}" "$PY" -m bench.kernels --variants --budget 150 --out "$OUT/bench_variants.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # Qwen3-like bf16 decode: the GEMV against the other paths (the default there is now the split path) (issue #4's 1.2x-stock target at M=1; the
  # general variants step above may run out of budget before the bf16 cases)
  step bench_variants_bf16 "${BENCH_VARIANTS_BF16_CAP:-120}" "$PY" -m bench.kernels --variants --formats bf16 --shapes qwen3 --no-align-sweep --budget 90 --out "$OUT/bench_variants_bf16.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # issue #4's packed decode at one token: the default against each changed GEMV config in turn, alternating
  # (bench.gemv_sweep --set alt; GEMV_ALTS: ";" between configs, GEMV_ALT_CASES: shape:format:M list). Since
  # 2026-12-05 NVFP4's default is the half word dot with K tiles of 512 at 128 registers (H100: DeepSeek-like
  # layer 92.2 -> 83.5 µs at M=1), and int4's at one token on whole 512 tiles (H100: 83.6 -> 81.3 µs); the
  # alternative: the tiles before them (fp32 dot, 256, 96 registers), which int4 keeps at M=8
  # its sweep stops 40 s before the step's cap (BENCH_GEMV_ALTS_CAP), so a smaller cap still writes its table
  step bench_gemv_alts "${BENCH_GEMV_ALTS_CAP:-240}" "$PY" -m bench.gemv_sweep --set alt --rounds 2 --budget $(( ${BENCH_GEMV_ALTS_CAP:-240} - 40 )) --kernels gate_up,down,layer --cases "${GEMV_ALT_CASES:-deepseek:nvfp4:1,8;deepseek:int4-g128:1,8;qwen3:nvfp4:1}" --alt "${GEMV_ALTS:-half_dot=0,block_k1=256,block_k2=256,max_registers=96,down_max_registers=-1,down_peel=0,schedule_width=64}" --out "$OUT/bench_gemv_alts.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # issue #4's host rows >= 85% of the zero-copy read: NVFP4 read 79-84% (H100, 2026-12-07; every other format
  # >= 91%). Its block scales are 1/8 of its bytes, read 32 B per row per K tile of 512: every row on the host,
  # the default against wider K tiles (fewer, longer scale reads)
  step bench_gemv_host "${BENCH_GEMV_HOST_CAP:-150}" "$PY" -m bench.gemv_sweep --host-rows --set alt --rounds 2 --budget $(( ${BENCH_GEMV_HOST_CAP:-150} - 30 )) --kernels gate_up,down --cases "qwen3:nvfp4:1;deepseek:nvfp4:1" --alt "block_k1=1024;block_k1=2048;block_k2=1024" --out "$OUT/bench_gemv_host.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the cell still under 85%: the Qwen3-like NVFP4 layer at one token with one of its eight experts on the host
  # (81-84%, H100, 2026-12-07; its one host expert's gate_up has 48 programs, its down 64, each reading its tiles
  # in turn): the default against the host rows' own tiles, down's twice as tall (host_tall) and gate_up's twice as
  # wide (host_wide). Split K, down's register prefetch and whole-row down tiles were slower there (2026-12-07)
  step bench_gemv_host8 "${BENCH_GEMV_HOST8_CAP:-150}" "$PY" -m bench.gemv_sweep --host-every 8 --set alt --rounds 2 --budget $(( ${BENCH_GEMV_HOST8_CAP:-150} - 30 )) --kernels gate_up,down,layer --cases "${GEMV_HOST8_CASES:-qwen3:nvfp4:1}" --alt "${GEMV_HOST8_ALTS:-host_tall=1;host_wide=1;host_wide=1,host_tall=1}" --out "$OUT/bench_gemv_host8.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the one-launch split path (kernels/splitk.py): its tiles, then against the default decode path per shape and M
  step bench_splitk "${BENCH_SPLITK_CAP:-330}" "$PY" -m bench.splitk_sweep --budget 150 --out "$OUT/bench_splitk.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_pdl "${BENCH_PDL_CAP:-150}" "$PY" -m bench.kernel_pdl --budget 110 --out "$OUT/bench_pdl.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_prefill "${BENCH_PREFILL_CAP:-150}" "$PY" -m bench.prefill --quick --out "$OUT/bench_prefill.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_prefill_int4 "${BENCH_PREFILL_INT4_CAP:-120}" "$PY" -m bench.prefill --quick --shapes qwen3 --formats int4-g128 --fracs 0.25 --out "$OUT/bench_prefill_int4.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_planner "${BENCH_PLANNER_CAP:-120}" "$PY" -m bench.planner --quick --out "$OUT/bench_planner.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the plan + copy's launch forms against each other at 1-64 tokens per step (bench/planner_forms.py)
  step bench_planner_forms "${BENCH_PLANNER_FORMS_CAP:-240}" "$PY" -m bench.planner --quick --forms one,one-coop,one-pdl,one-nc,one-coop-pdl --out "$OUT/bench_planner_forms.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the adaptive plan kernel alone at wider serial passes, each variant checked against the reference first
  step bench_plan_blocks "${BENCH_PLAN_BLOCKS_CAP:-120}" "$PY" -m bench.plan_blocks --out "$OUT/bench_plan_blocks.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  step bench_decode "${BENCH_DECODE_CAP:-360}" "$PY" -m bench.decode --quick --out "$OUT/bench_decode.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # MTP: ours at num_spec 0 and 3, with and without draft-lane pruning (budgets 0 and 8 unpaid routes per step)
  step bench_decode_mtp "${BENCH_DECODE_MTP_CAP:-240}" "$PY" -m bench.decode --quick --mtp per-layer --families per-layer --ours-only --draft-budgets 0,8 --out "$OUT/bench_decode_mtp.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # MTP with the cost-aware depth: ours at fixed depths 0/1/3 and governed, on one pool per fraction
  step bench_spec_governed "${BENCH_SPEC_GOVERNED_CAP:-300}" "$PY" -m bench.spec_governed --quick --out "$OUT/bench_spec_governed.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the cell where drafting wins by 6-12% (pool 25%, bs 16) over enough steps for the governor to prove it: 150
  # are too few (bench.spec_governor_model: depth 3 reached in 6 of 40 replays at 150 steps, 28 at 2000)
  step bench_spec_governed_long "${BENCH_SPEC_GOVERNED_LONG_CAP:-420}" "$PY" -m bench.spec_governed --quick --pools 0.25 --batches 16 --steps 1000 --fixed 0,3 --out "$OUT/bench_spec_governed_long.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # the cell where the governor gave 0.923x depth 0 once and 0.984-0.988x in three earlier runs (pool 50%, bs 16):
  # four rounds in ABBA order, each round's ratio printed, so run-to-run drift shows apart from the governor's
  # cost; the misses/step column tells the pool's part (bench.spec_pool_misses: no re-warm after a probe); and a
  # governor that decided 300 steps before its counted ones (a serving process's, past its first probes)
  step bench_spec_governed_rounds "${BENCH_SPEC_GOVERNED_ROUNDS_CAP:-300}" "$PY" -m bench.spec_governed --quick --pools 0.5 --batches 16 --fixed 0,1 --rounds 4 --governor-warm 300 --out "$OUT/bench_spec_governed_rounds.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # every (pool, bs) cell with a governor restored from a saved state (kept across restarts by default since
  # 2026-12-05): issue #9's "never below depth 0" at each pool size for a configuration that ran before
  step bench_spec_governed_restored "${BENCH_SPEC_GOVERNED_RESTORED_CAP:-450}" "$PY" -m bench.spec_governed --quick --fixed 0 --governor-warm 300 --out "$OUT/bench_spec_governed_restored.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  # PNGs from the decode JSON and the prefill table (needs matplotlib; the step fails alone without it; a
  # plot whose input a skipped or failed step did not write is left out with a note)
  step bench_plot "${BENCH_PLOT_CAP:-60}" "$PY" -m bench.plot --decode "$OUT/bench_decode.json" --prefill "$OUT/bench_prefill.md" --out-dir "$OUT"
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step bench_tp "${BENCH_TP_CAP:-300}" "$PY" -m bench.tp --out "$OUT/bench_tp.md" ${GIT_COMMIT:+--commit "$GIT_COMMIT"}
  else
    echo "note: one GPU: bench_tp and tests/test_tp_gpu.py (skipped above) need two (the 2-GPU device kind)"
  fi
fi

echo
cat "$OUT"/bench_*.md 2>/dev/null || true
for name in ${FAILED_TESTS[@]+"${FAILED_TESTS[@]}"}; do  # near the end: it shows in the output's tail
  echo
  echo "=== $name failed: failures, then the last 60 lines of logs/$name.log ==="
  grep -E "^(FAILED|ERROR)" "$LOGS/$name.log" || echo "(no FAILED/ERROR lines: a crash or the time cap?)"
  echo "---"
  tail -n 60 "$LOGS/$name.log"
done
# SAVE_TRITON_CACHE=1: the compile cache back under $OUT as triton_cache.tgz.NN parts (scripts/triton_cache.py);
# copy them into .triton_cache/ (ignored by git) and carry that folder in the next calls
save_cache
NUM_CACHE_PARTS=$(compgen -G "$OUT/triton_cache.tgz.*" | wc -l)
# A device run returns at most MAX_FILES files from $OUT: results stay at the top level while they fit beside
# logs.tar.gz (markdown, then PNGs, then JSON); the rest goes into the archive, under logs/.
RESULTS=()
for f in "$OUT"/*.md "$OUT"/*.png "$OUT"/*.json; do [ -f "$f" ] && RESULTS+=("$f"); done
KEEP_RESULTS=$((${MAX_FILES:-8} - 1 - NUM_CACHE_PARTS))
[ "$KEEP_RESULTS" -ge 0 ] || KEEP_RESULTS=0
for f in ${RESULTS[@]+"${RESULTS[@]:$KEEP_RESULTS}"}; do
  mv "$f" "$LOGS/" && echo "moved $(basename "$f") into logs.tar.gz (more than ${MAX_FILES:-8} files in $OUT)"
done
if tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs; then
  rm -rf "$LOGS"
else
  echo "could not pack $LOGS into $OUT/logs.tar.gz; the logs stay there"
fi
echo
echo "| step | rc | time | log (in logs.tar.gz) |"
echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
exit "$WORST"
