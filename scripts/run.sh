#!/usr/bin/env bash
# The main job: an SGLang server with pooled MoE experts. Installs into .venv on first use (the serve extra:
# sglang==0.5.23, torch==2.14.1). With no --model it serves the embedded tiny Qwen3-MoE (random weights).
# Usage: bash scripts/run.sh [launcher and SGLang flags]   e.g. --model /path/to/ckpt --moe-expert-pool-rows 96
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh serve
exec python -m pooled_runner.launch "$@"
