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
# POOLED_RUNNER_TEST_WORKERS processes (default 2: on the 2-core CI machine, 2.8x faster than one); engine
# modules each stay in one process (their servers are module fixtures: see tests/engine/conftest.py).
python -m pytest -n "${POOLED_RUNNER_TEST_WORKERS:-2}" --dist loadgroup "$@"
