#!/usr/bin/env bash
# Benchmarks on local services (release build): close lateness of scheduled orders,
# and the unthrottled drain rate of an overdue backlog. Results: docs/benchmarks.md.
#   ORDERS=6000 BURST=5000 BACKLOG=50000 bash scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ORDERS=${ORDERS:-6000}
BURST=${BURST:-5000}
BACKLOG=${BACKLOG:-50000}
bash scripts/services.sh
cargo build --release --locked --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export LAPSE_BROKER__PREFIX=lapse-bench
export LAPSE_BROKER__MANAGEMENT_URL=${LAPSE_BROKER__MANAGEMENT_URL:-http://guest:guest@127.0.0.1:15672}
export LAPSE_DATABASE__URL=${LAPSE_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/lapse_bench}
export RUST_LOG=${RUST_LOG:-warn}
lapse=./target/release/lapse
sql() { psql -X -q -t -A "$LAPSE_DATABASE__URL" -c "$1"; }
admin=${LAPSE_DATABASE__URL%/*}/postgres

psql -X -q "$admin" -c "DROP DATABASE IF EXISTS lapse_bench WITH (FORCE)"
$lapse migrate >/dev/null
$lapse topology apply >/dev/null
for q in $($lapse topology plan --json | python3 -c 'import json,sys; print(" ".join(q["name"] for q in json.load(sys.stdin)["queues"]))'); do
  rabbitmqctl -q purge_queue "$q" >/dev/null 2>&1 || true
done

report() { # label
  sql "SELECT '$1: closed ' || count(*) || ', early ' || count(*) FILTER (WHERE closed_at < expire_at)
            || ', by sweeper ' || count(*) FILTER (WHERE close_reason = 'sweeper')
            || '; lateness ms p50 ' || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 1)
            || ', p99 ' || round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 1)
            || ', max ' || round(max(ms)::numeric, 1)
       FROM (SELECT *, extract(epoch FROM closed_at - expire_at)::float8 * 1000 AS ms FROM orders) l"
  sql "SELECT '  hops ' || hops || ': ' || count(*) || ' orders, lateness ms p50 '
            || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 1)
            || ', p90 ' || round(percentile_cont(0.9) WITHIN GROUP (ORDER BY ms)::numeric, 1)
       FROM (SELECT e.detail->>'hops' AS hops, extract(epoch FROM o.closed_at - o.expire_at)::float8 * 1000 AS ms
               FROM order_events e JOIN orders o ON o.id = e.order_id WHERE e.event = 'closed') h
      GROUP BY hops ORDER BY hops"
}
wait_closed() {
  until [ "$(sql "SELECT count(*) FROM orders WHERE status = 'UNPAID'")" = 0 ]; do sleep 0.5; done
}
line='[{"sku": "bench", "qty": 1}]'
sql "INSERT INTO stock (sku, available) VALUES ('bench', 1000000000)"

$lapse worker > "$work/worker.log" 2>&1 &
worker=$!
echo "== steady: $ORDERS orders created 20 at a time every ~0.1 s, each with its own deadline"
echo "   (5 s and 15 s equal tiers of topology/default.toml; the others take several hops)"
for _ in $(seq 1 $((ORDERS / 20))); do
  sql "SELECT count(lapse_create_order(clock_timestamp() + d * interval '1 ms', '$line'))
         FROM unnest(ARRAY[5000, 15000, 6300, 7770, 9010, 11500, 13250, 16900, 18040, 20000,
                           5000, 15000, 8123, 10456, 12789, 14012, 17345, 19678, 5000, 15000]) d" >/dev/null
  sleep 0.1
done
wait_closed
report steady
sql "TRUNCATE orders, order_lines, stock_ledger, order_events, late_payments, outbox"

echo "== burst: $BURST orders sharing one deadline 5 s ahead (a flash sale)"
sql "SELECT count(lapse_create_order(now() + interval '5 s', '$line')) FROM generate_series(1, $BURST)" >/dev/null
wait_closed
report burst
kill -TERM $worker; wait $worker || true
sql "TRUNCATE orders, order_lines, stock_ledger, order_events, late_payments, outbox"

echo "== backlog: $BACKLOG orders already overdue when the worker starts, no rate limit"
sql "SELECT count(lapse_create_order(now() - interval '2 s', '$line'))
       FROM generate_series(1, $BACKLOG)" >/dev/null
LAPSE_WORKER__PREFETCH=1000 LAPSE_WORKER__BATCH_SIZE=500 LAPSE_SWEEPER__GRACE=10m \
  $lapse worker > "$work/backlog.log" 2>&1 &
worker=$!
start=$(date +%s.%N)
until [ "$(sql "SELECT count(*) FROM orders WHERE status = 'UNPAID'")" = 0 ]; do sleep 0.2; done
end=$(date +%s.%N)
rss=$(awk '/VmHWM/ {print int($2/1024)}' /proc/$worker/status)
kill -TERM $worker; wait $worker || true
python3 -c "print(f'drained $BACKLOG in {$end-$start:.1f} s: {$BACKLOG/($end-$start):.0f} closes/s; worker peak RSS ${rss} MiB')"
