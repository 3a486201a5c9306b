#!/usr/bin/env bash
# Build the xtoken image for the CPU or the GPU profile of docker-compose.yml.
#
#   deploy/build_image.sh cpu [TAG]     torch 2.13.0+cpu; default tag xtoken:cpu
#   deploy/build_image.sh gpu [TAG]     torch 2.14.1 from PyPI (CUDA build, Triton 3.8: see
#                                       deploy/Dockerfile); default tag xtoken:gpu
#
# Env: XTOKEN_BASE_IMAGE (FROM; default python:3.11-slim, or the debootstrap image of
# deploy/build_base_image.sh where no registry is reachable), XTOKEN_EXTRAS (optional dependency
# groups: default control; control,ray for the Ray launcher), DOCKER_HOST, PIP_INDEX_URL.
# The host's pip set-up is carried into the build stage only (deploy/build-extras/, ignored by
# git): its CA bundle (PIP_CERT, SSL_CERT_FILE or pip's global.cert) and, for the CPU image, a
# torch CPU wheel found in pip's find-links folders; without one the build stage asks torch's CPU
# index. Uses the classic builder (DOCKER_BUILDKIT=0) unless DOCKER_BUILDKIT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:?usage: deploy/build_image.sh cpu|gpu [TAG]}
TAG=${2:-xtoken:$KIND}
PIP=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip" )}
case "$KIND" in
  cpu) TORCH_VERSION=2.13.0; TORCH_SPEC="torch==$TORCH_VERSION+cpu"
       TORCH_INDEX=https://download.pytorch.org/whl/cpu; RUNTIME_APT= ;;
  # Triton (a dependency of the CUDA build: 3.8 with torch 2.14.1) compiles its launcher with a
  # C compiler at run time
  gpu) TORCH_VERSION=2.14.1; TORCH_SPEC="torch==$TORCH_VERSION"; TORCH_INDEX=
       RUNTIME_APT="gcc libc6-dev" ;;
  *) echo "[deploy] unknown kind '$KIND': use cpu or gpu" >&2; exit 2 ;;
esac
X=deploy/build-extras
clean() { find "$X" -mindepth 1 ! -name README.md -exec rm -rf {} +; }
clean
trap clean EXIT
# the CA bundle that pip on this host trusts (a proxy's CA where PyPI is reached through one)
CA=${PIP_CERT:-${SSL_CERT_FILE:-$($PIP config get global.cert 2>/dev/null || true)}}
if [ -n "$CA" ] && [ -s "$CA" ]; then
  cp "$CA" "$X/ca.crt"
  echo "[deploy] build stage trusts $CA"
fi
if [ "$KIND" = cpu ]; then
  # a local CPU wheel of torch (pip's find-links on this host), else torch's CPU index
  LINKS=${PIP_FIND_LINKS:-$($PIP config get global.find-links 2>/dev/null || true)}
  for dir in $LINKS; do
    dir=${dir#file://}
    wheel=$(ls "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*x86_64.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ]; then
      mkdir -p "$X/wheels"
      cp "$wheel" "$X/wheels/"
      TORCH_INDEX=
      echo "[deploy] torch from $wheel"
      break
    fi
  done
fi
BASE=${XTOKEN_BASE_IMAGE:-python:3.11-slim}
INDEX=${PIP_INDEX_URL:-}
case "$INDEX" in file://*) INDEX= ;; esac   # a host folder means nothing inside the build
echo "[deploy] building $TAG ($KIND) FROM $BASE"
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build --network host -f deploy/Dockerfile -t "$TAG" \
  --build-arg BASE="$BASE" --build-arg TORCH_SPEC="$TORCH_SPEC" \
  --build-arg TORCH_INDEX="$TORCH_INDEX" --build-arg PIP_INDEX_URL="$INDEX" \
  --build-arg RUNTIME_APT="$RUNTIME_APT" --build-arg EXTRAS="${XTOKEN_EXTRAS:-control}" .
echo "[deploy] built $TAG"
