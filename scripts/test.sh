#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ruff check .
python -m pytest -q "$@"
