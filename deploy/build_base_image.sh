#!/usr/bin/env bash
# Build the Debian bookworm base image (python3.11) with debootstrap + `docker import`, for hosts
# that reach Debian's archive but no container registry. Elsewhere FROM python:3.11-slim does.
#
#   deploy/build_base_image.sh [TAG]        (default xtoken-base:bookworm; needs root)
#
# Env: DOCKER_HOST (the engine), DEBIAN_MIRROR (default: the host's apt source or deb.debian.org),
# XTOKEN_BASE_CACHE (a folder that keeps the rootfs tarball between builds).
set -euo pipefail
TAG=${1:-xtoken-base:bookworm}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "[deploy] base image $TAG exists"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "[deploy] debootstrap missing: apt-get install -y debootstrap" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "[deploy] debootstrap needs root" >&2; exit 2; }
MIRROR=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=${XTOKEN_BASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xtoken/docker}
mkdir -p "$CACHE"
TARBALL="$CACHE/bookworm-rootfs.tar"
if [ ! -s "$TARBALL" ]; then
  ROOTFS=$(mktemp -d /tmp/xtoken-rootfs.XXXXXX)
  trap 'rm -rf "$ROOTFS"' EXIT
  echo "[deploy] debootstrap bookworm from $MIRROR into $ROOTFS"
  # python3-venv brings ensurepip (pip inside the image's venv); procps for ps/pkill in a shell
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,procps \
    bookworm "$ROOTFS" "$MIRROR"
  # a smaller image: apt lists and caches are not needed at run time
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" -c . -f "$TARBALL.tmp"
  mv "$TARBALL.tmp" "$TARBALL"
fi
echo "[deploy] docker import $TARBALL as $TAG"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  "$TARBALL" "$TAG"
