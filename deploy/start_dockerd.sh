#!/usr/bin/env bash
# Start a private Docker engine for the deployment test: its own data root, exec root, socket and
# pid file, no bridge, no iptables rules (containers use host networking). Needs root.
#
#   deploy/start_dockerd.sh DIR      starts dockerd under DIR (waits until it answers)
#   deploy/start_dockerd.sh DIR stop stops the engine that DIR's pid file names
#
# Prints the DOCKER_HOST to use (unix://DIR/dockerd.sock). The data root (images) stays in DIR,
# so a second start reuses the images built before.
set -euo pipefail
DIR=${1:?usage: deploy/start_dockerd.sh DIR [stop]}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SOCK="$DIR/dockerd.sock"
PIDFILE="$DIR/dockerd.pid"
if [ "${2:-}" = stop ]; then
  if [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    pid=$(cat "$PIDFILE")
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    echo "[deploy] dockerd $pid stopped" >&2
  fi
  # what the engine leaves mounted under its roots (the netns of its host-network containers)
  awk -v d="$DIR/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
  exit 0
fi
command -v dockerd >/dev/null || { echo "[deploy] dockerd missing: apt-get install -y docker.io" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "[deploy] dockerd needs root" >&2; exit 2; }
if [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null \
   && DOCKER_HOST="unix://$SOCK" docker version >/dev/null 2>&1; then
  echo "unix://$SOCK"
  exit 0
fi
mkdir -p "$DIR/data" "$DIR/exec"
# --bridge=none and no iptables/forwarding/masquerade: the engine creates no network on a private
# address range; every container of the compose file uses network_mode: host
setsid dockerd \
  --data-root "$DIR/data" --exec-root "$DIR/exec" -H "unix://$SOCK" --pidfile "$PIDFILE" \
  --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
  >"$DIR/dockerd.log" 2>&1 < /dev/null &
for _ in $(seq 1 120); do
  if DOCKER_HOST="unix://$SOCK" docker version >/dev/null 2>&1; then
    echo "unix://$SOCK"
    exit 0
  fi
  sleep 0.5
done
echo "[deploy] dockerd did not answer within 60 s; its log: $DIR/dockerd.log" >&2
tail -20 "$DIR/dockerd.log" >&2
exit 1
