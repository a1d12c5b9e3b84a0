#!/usr/bin/env bash
# Makes a Debian 13 (trixie) root holding RabbitMQ 4.x and its Erlang, for the tests
# that run a private 4.x node next to the system's 3.x (scripts/test-rabbitmq4.sh):
# Debian 12 ships only RabbitMQ 3.10. The node runs from this root with chroot, on
# ports of its own; nothing is installed into the host but debootstrap.
# Idempotent: prints the root's path (LAPSE_RABBITMQ4_ROOT, default below).
set -euo pipefail
ROOT=${LAPSE_RABBITMQ4_ROOT:-/var/cache/lapse/trixie-rabbitmq4}
MIRROR=${LAPSE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
log() { echo "[rabbitmq4] $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ -x "$ROOT/usr/lib/rabbitmq/bin/rabbitmq-server" ]; then
  echo "$ROOT"
  exit 0
fi
if ! command -v debootstrap >/dev/null && [ ! -x /usr/sbin/debootstrap ]; then
  log "installing debootstrap from Debian's packages"
  as_root apt-get update -q >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2
fi
log "making a trixie root with rabbitmq-server in $ROOT (a few minutes, once)"
as_root rm -rf "$ROOT.partial"
as_root mkdir -p "$(dirname "$ROOT")"
as_root /usr/sbin/debootstrap --variant=minbase --include=rabbitmq-server \
  trixie "$ROOT.partial" "$MIRROR" >&2
as_root mv "$ROOT.partial" "$ROOT"
echo "$ROOT"
