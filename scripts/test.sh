#!/usr/bin/env bash
# Install (scripts/setup.sh test) and run the CPU test suite; pytest's arguments pass through.
# A marker expression naming `ray` or `browser` (-m ray, -m browser) installs that extra too.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
prev=
for arg in "$@"; do
  if [ "$prev" = -m ]; then
    case "$arg" in *"not ray"*) ;; *ray*) extras+=(ray) ;; esac
    case "$arg" in *"not browser"*) ;; *browser*) extras+=(browser) ;; esac
  fi
  prev=$arg
done
bash scripts/setup.sh test "${extras[@]}"
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ruff check .
python -m pytest -q "$@"
