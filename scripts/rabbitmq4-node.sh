#!/usr/bin/env bash
# A private RabbitMQ 4.x node from the trixie root that scripts/rabbitmq4.sh makes,
# on ports of its own (its own node name, epmd port, data directory and HOME), next
# to whatever broker the machine runs. For tests; never the system's broker. The
# node runs as the root's `rabbitmq` user, listens on loopback only (AMQP,
# management, epmd and distribution) and has a random cookie.
#   rabbitmq4-node.sh start AMQP_PORT MANAGEMENT_PORT   # prints the node's name
#   rabbitmq4-node.sh stop AMQP_PORT
# The node's epmd listens on AMQP_PORT+1000, its distribution on AMQP_PORT+2000, and
# its CLI on AMQP_PORT+3000 to +3010.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

action=${1:?start or stop}
port=${2:?AMQP port}
case $action in
start) ROOT=$(bash "$here/rabbitmq4.sh") ;;
# Stopping never makes the root: there is nothing to stop without it.
*) ROOT=${LAPSE_RABBITMQ4_ROOT:-/var/cache/lapse/trixie-rabbitmq4} ;;
esac
node="lapse-4x-$port@localhost"
data="/var/tmp/lapse-4x-$port"          # inside the root
epmd=$((port + 1000))
env_vars=(HOME="$data/home" ERL_EPMD_PORT="$epmd" ERL_EPMD_ADDRESS=127.0.0.1
  RABBITMQ_NODENAME="$node" RABBITMQ_NODE_PORT="$port" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  RABBITMQ_DIST_PORT=$((port + 2000))
  RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  RABBITMQ_CTL_DIST_PORT_MIN=$((port + 3000)) RABBITMQ_CTL_DIST_PORT_MAX=$((port + 3010))
  RABBITMQ_MNESIA_BASE="$data/mnesia" RABBITMQ_LOG_BASE="$data/log"
  RABBITMQ_PID_FILE="$data/pid" RABBITMQ_CONFIG_FILE="$data/rabbitmq.conf"
  RABBITMQ_ENABLED_PLUGINS_FILE="$data/enabled_plugins")
# Runs a command in the root as USER, with /proc and /dev, in a mount namespace of its
# own; the root's path and the arguments travel as argv, never through quoting.
in_root() {
  local user=$1
  shift
  as_root unshare -m sh -c 'root=$1; user=$2; shift 2
    mount -t proc proc "$root/proc" && mount --rbind /dev "$root/dev" &&
    exec chroot --userspec="$user" "$root" "$@"' sh "$ROOT" "$user" env "${env_vars[@]}" "$@"
}
ctl() { in_root rabbitmq:rabbitmq /usr/lib/rabbitmq/bin/rabbitmqctl -n "$node" "$@"; }

stop_node() {
  ctl stop >/dev/null 2>&1 || true
  # A node that did not stop on request, then the node's own epmd, then its data.
  if [ -f "$ROOT$data/pid" ]; then
    as_root kill -9 "$(cat "$ROOT$data/pid")" 2>/dev/null || true
  fi
  ss -ltnpH "sport = :$epmd" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u \
    | while read -r pid; do as_root kill "$pid" 2>/dev/null || true; done
  as_root rm -rf "$ROOT$data"
}

case $action in
start)
  mgmt=${3:?management port}
  as_root rm -rf "$ROOT$data"
  as_root mkdir -p "$ROOT$data/home" "$ROOT$data/mnesia" "$ROOT$data/log"
  head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | as_root tee "$ROOT$data/home/.erlang.cookie" >/dev/null
  printf 'listeners.tcp.default = 127.0.0.1:%s\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\nloopback_users = none\n' \
    "$port" "$mgmt" | as_root tee "$ROOT$data/rabbitmq.conf" >/dev/null
  echo '[rabbitmq_management].' | as_root tee "$ROOT$data/enabled_plugins" >/dev/null
  as_root chroot "$ROOT" chown -R rabbitmq:rabbitmq "$data"
  as_root chmod 400 "$ROOT$data/home/.erlang.cookie"
  # A node that does not come up is stopped again before the error is reported.
  trap 'stop_node' ERR
  in_root rabbitmq:rabbitmq /usr/lib/rabbitmq/bin/rabbitmq-server -detached
  for _ in $(seq 1 90); do
    ctl await_startup --timeout 30 >/dev/null 2>&1 && break
    sleep 1
  done
  ctl await_startup --timeout 5 >/dev/null
  ctl enable_feature_flag all >/dev/null
  trap - ERR
  echo "$node"
  ;;
stop) stop_node ;;
*) echo "usage: $0 start AMQP_PORT MANAGEMENT_PORT | stop AMQP_PORT" >&2; exit 2 ;;
esac
