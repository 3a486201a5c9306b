#!/usr/bin/env bash
# The deployment test (pytest marker `docker`): a private Docker engine, the debootstrap base
# image, then tests/deploy (builds xtoken:cpu, docker compose CPU profile up, a run over REST,
# down). Needs root, docker.io and debootstrap (installed here with apt-get when missing).
#
#   ./scripts/docker_test.sh [pytest args]
#
# Env: XTOKEN_DOCKER_DIR (engine state, images kept between runs; default /tmp/xtoken-docker),
# XTOKEN_BASE_IMAGE (FROM of the image: default the debootstrap one; python:3.11-slim where a
# registry is reachable), XTOKEN_DOCKER_KEEP=1 (leave the engine running afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap
fi
DIR=${XTOKEN_DOCKER_DIR:-/tmp/xtoken-docker}
DOCKER_HOST=$(deploy/start_dockerd.sh "$DIR")
export DOCKER_HOST
if [ "${XTOKEN_DOCKER_KEEP:-0}" != 1 ]; then
  trap 'deploy/start_dockerd.sh "$DIR" stop' EXIT
fi
if [ -z "${XTOKEN_BASE_IMAGE:-}" ]; then
  deploy/build_base_image.sh xtoken-base:bookworm
  export XTOKEN_BASE_IMAGE=xtoken-base:bookworm
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m pytest -m docker -s tests/deploy "$@"
