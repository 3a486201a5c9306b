#!/usr/bin/env bash
# Install what the demo needs (scripts/setup.sh demo) and run the main job on the embedded CPU
# default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
xtoken demo "$@"
