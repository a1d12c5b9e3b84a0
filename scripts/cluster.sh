#!/usr/bin/env bash
# A local RabbitMQ cluster of N private nodes on loopback, for tests and for trying
# lapse against more than one broker node. Never touches the broker of
# scripts/services.sh.
#
#   bash scripts/cluster.sh start N      start N nodes, join them, enable feature flags
#   bash scripts/cluster.sh status [N]   which nodes run, their ports, the cluster view
#   bash scripts/cluster.sh stop [N]     stop every node cleanly, delete the directory
#   bash scripts/cluster.sh kill I       SIGKILL node I (1-based), as a crash would
#   bash scripts/cluster.sh node-stop I  stop node I cleanly (the others keep running)
#   bash scripts/cluster.sh node-start I start node I again; it rejoins the cluster
#   bash scripts/cluster.sh urls [N]     the AMQP URLs, comma-separated (for broker.url)
#
# Environment (all optional):
#   LAPSE_CLUSTER_DIR   where the nodes keep data, logs and the shared cookie
#                       (default: ${TMPDIR:-/tmp}/lapse-cluster-<user>)
#   LAPSE_CLUSTER_NAME  node name prefix: nodes are <name>-1@localhost ... (default lapse-cluster)
#   LAPSE_CLUSTER_PORT  AMQP port of node 1; node I listens on PORT+I-1 for AMQP,
#                       PORT+I-1+10000 for the management API and PORT+I-1+20000 for
#                       Erlang distribution (default 5701)
# Exit status: 0 ok, 1 a node failed to start/join/stop, 2 usage error.
set -euo pipefail

BIN=/usr/lib/rabbitmq/bin
DIR=${LAPSE_CLUSTER_DIR:-${TMPDIR:-/tmp}/lapse-cluster-$(id -un)}
NAME=${LAPSE_CLUSTER_NAME:-lapse-cluster}
PORT=${LAPSE_CLUSTER_PORT:-5701}

log() { echo "[cluster] $*" >&2; }
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
number() { [[ "$1" =~ ^[1-9][0-9]*$ ]] || { log "not a positive number: $1"; exit 2; }; }

node() { echo "$NAME-$1@localhost"; }
amqp_port() { echo $((PORT + $1 - 1)); }
mgmt_port() { echo $((PORT + $1 - 1 + 10000)); }
dist_port() { echo $((PORT + $1 - 1 + 20000)); }
ctl() { # I args...
  local i=$1; shift
  HOME="$DIR/home" "$BIN/rabbitmqctl" -n "$(node "$i")" "$@"
}
# Node count: the argument, else what `start` recorded.
count() {
  if [ -n "${1:-}" ]; then number "$1"; echo "$1"; return; fi
  [ -f "$DIR/nodes" ] && cat "$DIR/nodes" || echo 0
}

boot() { # I
  local i=$1 d="$DIR/node-$1"
  mkdir -p "$d/mnesia" "$d/log"
  # The old pid would make a dead boot look alive (`alive`) until the node writes its own.
  rm -f "$d/pid"
  cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$(amqp_port "$i")
management.tcp.ip = 127.0.0.1
management.tcp.port = $(mgmt_port "$i")
EOF
  # The broker's dead-letter worker re-sends a TTL-expired message only when its
  # confirm has not come within dead_letter_worker_publisher_confirm_timeout (180 s by
  # default in 3.10): after the due queue's leader dies, the messages it had not yet
  # confirmed would wait that long. 5 s bounds that wait; 512 raises the worker's
  # throughput (see deploy/rabbitmq/advanced.config).
  cat >"$d/advanced.config" <<EOF
[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000},
           {dead_letter_worker_consumer_prefetch, 512}]}].
EOF
  echo "[rabbitmq_management]." >"$d/enabled_plugins"
  (cd "$d" && HOME="$DIR/home" \
    RABBITMQ_NODENAME="$(node "$i")" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$(amqp_port "$i")" \
    RABBITMQ_DIST_PORT="$(dist_port "$i")" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_PID_FILE="$d/pid" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
    "$BIN/rabbitmq-server" -detached >"$d/start.out" 2>&1)
}

# True while the node's recorded process runs.
alive() { # I
  local pid
  pid=$(cat "$DIR/node-$1/pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# Waits for node I to finish booting. A boot that died (say, started while epmd still
# listed the killed node's name, on a loaded machine) is booted again, up to twice.
await() { # I
  local i=$1 tries=0 reboots=0
  while [ "$tries" -lt 60 ]; do
    if ctl "$i" await_startup --timeout 30 >/dev/null 2>&1; then return 0; fi
    tries=$((tries + 1))
    if [ "$tries" -ge 5 ] && [ "$reboots" -lt 2 ] && ! alive "$i"; then
      log "node $(node "$i") is not running; booting it again"
      cat "$DIR/node-$i/start.out" >&2 || true
      reboots=$((reboots + 1)); tries=0
      boot "$i"
    fi
    sleep 1
  done
  log "node $(node "$i") did not start; log tail:"
  tail -n 30 "$DIR/node-$i/log/$(node "$i").log" >&2 || true
  cat "$DIR/node-$i/start.out" >&2 || true
  return 1
}

start() { # N
  local n=$1
  if [ -f "$DIR/nodes" ]; then
    log "a cluster is already recorded in $DIR (run: $0 stop)"; exit 1
  fi
  mkdir -p "$DIR/home"
  echo "$n" >"$DIR/nodes"
  # One cookie for every node and every rabbitmqctl call, written before anything
  # could generate one.
  echo "LAPSECLUSTER$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')" >"$DIR/home/.erlang.cookie"
  chmod 400 "$DIR/home/.erlang.cookie"
  for i in $(seq 1 "$n"); do boot "$i"; done
  for i in $(seq 1 "$n"); do await "$i"; done
  for i in $(seq 2 "$n"); do
    ctl "$i" stop_app >/dev/null
    ctl "$i" join_cluster "$(node 1)" >/dev/null
    ctl "$i" start_app >/dev/null
  done
  # quorum_queue, stream_queue (at-least-once dead-lettering needs both) and the rest.
  # Right after a join the call can fail (a node still starting its apps): retry.
  flags_on() {
    local listed
    listed=$(ctl 1 list_feature_flags -q name state 2>/dev/null) || return 1
    for flag in quorum_queue stream_queue; do
      grep -q "^$flag[[:space:]]*enabled" <<<"$listed" || return 1
    done
  }
  for _ in $(seq 1 20); do
    ctl 1 enable_feature_flag all >/dev/null 2>&1 || true
    flags_on && break
    sleep 2
  done
  flags_on || { log "feature flags quorum_queue and stream_queue could not be enabled"; exit 1; }
  log "$n nodes running in $DIR"
  echo "$DIR"
}

status() { # N
  local n=$1 i running=0
  echo "directory: $DIR"
  for i in $(seq 1 "$n"); do
    if ctl "$i" ping >/dev/null 2>&1; then
      state=running; running=$((running + 1))
    else
      state=down
    fi
    echo "$(node "$i") amqp=127.0.0.1:$(amqp_port "$i") management=127.0.0.1:$(mgmt_port "$i") $state"
  done
  if [ "$running" -gt 0 ]; then
    for i in $(seq 1 "$n"); do
      if ctl "$i" cluster_status -q --formatter json 2>/dev/null \
        | grep -o '"running_nodes":\[[^]]*\]'; then break; fi
    done
  fi
}

# Stop cleanly; a node that does not stop within the timeout is killed so that no
# process and no epmd registration stays behind.
node_stop() { # I
  local i=$1 pid
  pid=$(cat "$DIR/node-$i/pid" 2>/dev/null || true)
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then return 0; fi # not running
  # With the pid file, `stop` returns only once the process has exited (and left
  # epmd), so the node can be started again at once.
  timeout 90 env HOME="$DIR/home" "$BIN/rabbitmqctl" -n "$(node "$i")" stop --timeout 60 \
    "$DIR/node-$i/pid" >/dev/null 2>&1 || true
  if kill -0 "$pid" 2>/dev/null; then
    log "node $(node "$i") did not stop; killing pid $pid"
    kill -9 "$pid" 2>/dev/null || true
  fi
}

# SIGKILL, then wait (at most 30 s) until the process is gone and epmd no longer lists
# the node, so that `node-start` right after it does not collide with the dead node.
node_kill() { # I
  local pid short
  pid=$(cat "$DIR/node-$1/pid" 2>/dev/null || true)
  [ -n "$pid" ] || { log "no pid recorded for node $1"; exit 1; }
  kill -9 "$pid" 2>/dev/null || { log "node $(node "$1") (pid $pid) was not running"; return 0; }
  short=$(node "$1"); short=${short%@*}
  # A zombie (exited, not yet reaped) counts as gone.
  gone() { ! kill -0 "$pid" 2>/dev/null || [[ "$(ps -o stat= -p "$pid" 2>/dev/null)" == Z* ]]; }
  for _ in $(seq 1 300); do
    if ! gone; then
      sleep 0.1 # still running
    elif command -v epmd >/dev/null && epmd -names 2>/dev/null | grep -q "name $short "; then
      sleep 0.1 # still registered
    else
      return 0
    fi
  done
  if ! gone; then
    log "node $(node "$1") (pid $pid) still exists 30 s after SIGKILL"
  else
    log "node $(node "$1") is still registered in epmd 30 s after SIGKILL"
  fi
  exit 1
}

stop() { # N
  local n=$1 i
  for i in $(seq 1 "$n"); do node_stop "$i" & done
  wait
  if command -v epmd >/dev/null && epmd -names 2>/dev/null | grep -q "name $NAME-[0-9]* "; then
    log "epmd still lists a node of $NAME:"; epmd -names >&2; exit 1
  fi
  rm -rf "$DIR"
  log "stopped; removed $DIR"
}

urls() { # N
  local n=$1 i out=""
  for i in $(seq 1 "$n"); do
    out+="${out:+,}amqp://guest:guest@127.0.0.1:$(amqp_port "$i")/%2f"
  done
  echo "$out"
}

cmd=${1:-}; arg=${2:-}
case "$cmd" in
  start) [ -n "$arg" ] || usage; number "$arg"; start "$arg" ;;
  status) status "$(count "$arg")" ;;
  stop) stop "$(count "$arg")" ;;
  urls) urls "$(count "$arg")" ;;
  kill) [ -n "$arg" ] || usage; number "$arg"; node_kill "$arg" ;;
  node-stop) [ -n "$arg" ] || usage; number "$arg"; node_stop "$arg" ;;
  node-start) [ -n "$arg" ] || usage; number "$arg"; boot "$arg"; await "$arg" ;;
  *) usage ;;
esac
