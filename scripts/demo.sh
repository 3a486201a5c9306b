#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the main job on the embedded CPU default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
xtoken demo "$@"
