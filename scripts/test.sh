#!/usr/bin/env bash
# Every CPU check: lint, format, types, then the test suite. Installs into .venv on first use.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh test,serve
ruff check .
ruff format --check .
mypy
# pytest exits 5 when nothing was collected; set -e turns that into a failure. Tests run in
# POOLED_RUNNER_TEST_WORKERS processes (default 2; 0 runs them in this process, e.g. for --pdb); the engine
# tests all run in one of them, one server at a time (see tests/engine/conftest.py).
python -m pytest -n "${POOLED_RUNNER_TEST_WORKERS:-2}" --dist loadgroup "$@"
