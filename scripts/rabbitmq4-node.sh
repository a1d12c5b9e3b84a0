#!/usr/bin/env bash
# A private RabbitMQ 4.x node from the trixie root that scripts/rabbitmq4.sh makes,
# on ports of its own (its own node name, epmd port, data directory and HOME), next
# to whatever broker the machine runs. For tests; never the system's broker.
#   rabbitmq4-node.sh start AMQP_PORT MANAGEMENT_PORT   # prints the node's name
#   rabbitmq4-node.sh stop AMQP_PORT
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ROOT=$(bash "$here/rabbitmq4.sh")
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

action=${1:?start or stop}
port=${2:?AMQP port}
node="lapse-4x-$port@localhost"
data="/var/tmp/lapse-4x-$port"          # inside the root
epmd=$((port + 1000))                   # the node's own epmd, away from the system's 4369
env_vars=(HOME="$data/home" ERL_EPMD_PORT="$epmd" RABBITMQ_NODENAME="$node"
  RABBITMQ_NODE_PORT="$port" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  RABBITMQ_DIST_PORT=$((port + 2000)) RABBITMQ_MNESIA_BASE="$data/mnesia"
  RABBITMQ_LOG_BASE="$data/log" RABBITMQ_CONFIG_FILE="$data/rabbitmq.conf"
  RABBITMQ_ENABLED_PLUGINS_FILE="$data/enabled_plugins")
in_root() { # runs a command in the root, with /proc and /dev, in a mount namespace of its own
  as_root unshare -m sh -c "mount -t proc proc '$ROOT/proc' && mount --rbind /dev '$ROOT/dev' \
    && exec chroot '$ROOT' env $(printf '%q ' "${env_vars[@]}") $(printf '%q ' "$@")"
}
ctl() { in_root /usr/lib/rabbitmq/bin/rabbitmqctl -n "$node" "$@"; }

case $action in
start)
  mgmt=${3:?management port}
  as_root rm -rf "$ROOT$data"
  as_root mkdir -p "$ROOT$data/home" "$ROOT$data/mnesia" "$ROOT$data/log"
  echo "LAPSE4X$port" | as_root tee "$ROOT$data/home/.erlang.cookie" >/dev/null
  as_root chmod 400 "$ROOT$data/home/.erlang.cookie"
  printf 'listeners.tcp.default = 127.0.0.1:%s\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\nloopback_users = none\n' \
    "$port" "$mgmt" | as_root tee "$ROOT$data/rabbitmq.conf" >/dev/null
  echo '[rabbitmq_management].' | as_root tee "$ROOT$data/enabled_plugins" >/dev/null
  in_root /usr/lib/rabbitmq/bin/rabbitmq-server -detached
  for _ in $(seq 1 90); do
    ctl await_startup --timeout 30 >/dev/null 2>&1 && break
    sleep 1
  done
  ctl await_startup --timeout 5 >/dev/null
  ctl enable_feature_flag all >/dev/null
  ctl eval 'os:getpid().' | tr -d '"' | as_root tee "$ROOT$data/pid" >/dev/null
  echo "$node"
  ;;
stop)
  ctl stop >/dev/null 2>&1 || true
  # A node that did not stop on request, then the node's own epmd, then its data.
  if [ -f "$ROOT$data/pid" ]; then
    as_root kill -9 "$(cat "$ROOT$data/pid")" 2>/dev/null || true
  fi
  in_root epmd -kill >/dev/null 2>&1 || true
  as_root rm -rf "$ROOT$data"
  ;;
*) echo "usage: $0 start AMQP_PORT MANAGEMENT_PORT | stop AMQP_PORT" >&2; exit 2 ;;
esac
