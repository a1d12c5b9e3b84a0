#!/usr/bin/env bash
# The tests whose outcome depends on the broker's version, again against a private
# RabbitMQ 4.x node (Debian 13's package, from the root scripts/rabbitmq4.sh makes):
# the pipeline, topology apply/verify and drift, the parked workflow, redelivery past
# the delivery limit, held deliveries, status. Extra arguments go to cargo test.
# LAPSE_RABBITMQ4=0 skips it (and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${LAPSE_RABBITMQ4:-1}" = 0 ]; then
  echo "[rabbitmq4] skipped: LAPSE_RABBITMQ4=0" >&2
  exit 0
fi
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# AMQP, management, the node's epmd (+1000), distribution (+2000) and CLI (+3000 to
# +3010) ports, all free, below the kernel's ephemeral range.
ok=0
for _ in $(seq 1 50); do
  amqp=$((20000 + RANDOM % 5000))
  ok=1
  for p in $amqp $((amqp + 1)) $((amqp + 1000)) $((amqp + 2000)) $(seq $((amqp + 3000)) $((amqp + 3010))); do
    if port_open "$p"; then ok=0; break; fi
  done
  [ $ok = 1 ] && break
done
if [ $ok = 0 ]; then
  echo "[rabbitmq4] no free set of ports found" >&2
  exit 1
fi
mgmt=$((amqp + 1))
stop() { bash scripts/rabbitmq4-node.sh stop "$amqp" || true; }
trap stop EXIT
node=$(bash scripts/rabbitmq4-node.sh start "$amqp" "$mgmt")
echo "[rabbitmq4] $node on :$amqp (management :$mgmt)" >&2
TEST_BROKER_AMQP_URL="amqp://guest:guest@127.0.0.1:$amqp/%2f" \
TEST_BROKER_MANAGEMENT_URL="http://guest:guest@127.0.0.1:$mgmt" \
  cargo test --locked --test it "$@" -- \
    pipeline:: topology:: parked:: redelivery:: status:: \
    locks::a_held_ locks::a_locked_order_defers_only_itself
