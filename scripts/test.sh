#!/usr/bin/env bash
# Every CPU check: lint, format, types, then the test suite. Installs into .venv on first use.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh test,serve
ruff check .
ruff format --check .
mypy
# Two pytest runs, extra arguments to both: every test but the engine tests in POOLED_RUNNER_TEST_WORKERS
# processes (pytest-xdist, default 2; 0: this process, e.g. for --pdb), then the engine tests (real SGLang
# servers, one at a time: tests/engine/server.py) in this process. (xdist's loadgroup cannot keep them on one
# worker under pytest 9: it renames node ids through an attribute pytest 9 no longer reads.)
# pytest exits 5 when it collected nothing: a failure, unless the arguments narrowed one run to no tests.
first_failure=0
empty_runs=0
for selection in "not engine" "engine"; do
  rc=0
  if [ "$selection" = engine ]; then
    python -m pytest -m engine "$@" || rc=$?
  else
    # worksteal: an idle worker takes queued tests from a busy one (with the default "load" one worker ran
    # the slow GEMV interpreter tests alone at the end: 1939 s against 1246 s on the 2-core machine)
    # --durations: the slowest tests in CI's log, to keep the run well inside CI's 90 minutes
    python -m pytest -n "${POOLED_RUNNER_TEST_WORKERS:-2}" --dist worksteal --durations=30 -m "not engine" "$@" \
      || rc=$?
  fi
  if [ "$rc" = 5 ]; then
    empty_runs=$((empty_runs + 1))
  elif [ "$rc" != 0 ] && [ "$first_failure" = 0 ]; then
    first_failure=$rc
  fi
done
if [ "$first_failure" != 0 ]; then exit "$first_failure"; fi
if [ "$empty_runs" = 2 ] || { [ "$empty_runs" = 1 ] && [ $# = 0 ]; }; then
  echo "pytest collected no tests ($empty_runs of 2 runs)" >&2
  exit 5
fi
