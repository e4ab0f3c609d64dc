#!/usr/bin/env bash
# Every CPU check: lint, format, types, then the test suite. Installs into .venv on first use.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh test,serve
ruff check .
ruff format --check .
mypy
# pytest exits 5 when nothing was collected; set -e turns that into a failure.
python -m pytest "$@"
