# Sourced by scripts/run.sh and scripts/test.sh: create .venv on first use and install the project into it.
# Usage: source scripts/env.sh EXTRAS   (EXTRAS like "test" or "test,serve")
set -euo pipefail
_extras=${1:-}
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv (first run)"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
_stamp=".venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${_extras}"
if [ ! -f "$_stamp" ]; then
  echo "installing pooled-runner[${_extras}] into .venv (first run takes a few minutes)"
  # torch 2.14.1 with SGLang 0.5.23 take about 11 GB here; pip's own "No space left on device" does not say
  # how much is needed, so say it up front.
  _free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "${_free_gb:-0}" -lt 12 ]; then
    echo "warning: ${_free_gb} GB free on the filesystem of $PWD; the install needs about 11 GB" \
      "(free space there or clone elsewhere)" >&2
  fi
  .venv/bin/python -m pip install -q "torch==2.14.1" -e ".${_extras:+[$_extras]}"
  touch "$_stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
