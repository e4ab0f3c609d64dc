#!/usr/bin/env bash
# The main job. Installs into .venv on first use, then runs the core demo (the SGLang launcher replaces it
# once it exists). Usage: bash scripts/run.sh [demo flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh ""
python -m pooled_runner.demo "$@"
