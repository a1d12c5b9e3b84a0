#!/usr/bin/env bash
# Closes per second with 1, 2 and 4 workers on the local cluster of scripts/cluster.sh
# (start it first: bash scripts/cluster.sh start 3). For each worker count: a fresh
# database and prefix, N orders created in one statement all due at the same moment
# 15 s ahead, W `lapse worker` processes (sweeper off: the message path alone), then
# the drain rate from the deadline to the last close, and the lateness.
#   N=20000 WORKERS="1 2 4" PROFILE=release bash scripts/cluster-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-20000}
WORKERS=${WORKERS:-1 2 4}
PROFILE=${PROFILE:-release}
urls=$(bash scripts/cluster.sh urls)
[ -n "$urls" ] || { echo "no cluster recorded: bash scripts/cluster.sh start 3" >&2; exit 2; }
if [ "$PROFILE" = release ]; then cargo build --release --locked --quiet; else cargo build --locked --quiet; fi
lapse=${CARGO_TARGET_DIR:-target}/$PROFILE/lapse
[ "$PROFILE" = release ] || lapse=${CARGO_TARGET_DIR:-target}/debug/lapse
admin=${LAPSE_BENCH_ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export LAPSE_BROKER__URL=$urls
export LAPSE_WORKER__SWEEPER=false
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
for w in $WORKERS; do
  db=lapse_cluster_bench_$w
  export LAPSE_DATABASE__URL=${admin%/*}/$db
  export LAPSE_BROKER__PREFIX=lapse-cbench-$w
  sql() { psql -X -q -t -A "$LAPSE_DATABASE__URL" -c "$1"; }
  psql -X -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"
  $lapse migrate >/dev/null
  $lapse topology apply >/dev/null
  pids=()
  for _ in $(seq 1 "$w"); do
    LAPSE_LOG=warn $lapse worker >/dev/null 2>&1 &
    pids+=($!)
  done
  sql "INSERT INTO stock (sku, available) VALUES ('bench', 1000000000)"
  sql "SELECT count(lapse_create_order(t, '[{\"sku\": \"bench\", \"qty\": 1}]'))
         FROM (SELECT now() + interval '15 s' AS t) d, generate_series(1, $N)" >/dev/null
  until [ "$(sql "SELECT count(*) FROM orders WHERE status = 'UNPAID'")" = 0 ]; do sleep 0.5; done
  sql "SELECT '$w worker(s): $N closed, early ' || count(*) FILTER (WHERE closed_at < expire_at)
            || ', drain ' || round(extract(epoch FROM max(closed_at) - min(expire_at))::numeric, 2) || ' s = '
            || round(count(*) / extract(epoch FROM max(closed_at) - min(expire_at))::numeric) || ' closes/s'
            || '; lateness ms p50 ' || round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric)
            || ', p99 ' || round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric)
       FROM (SELECT *, extract(epoch FROM closed_at - expire_at)::float8 * 1000 AS ms FROM orders) l"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  pids=()
  psql -X -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"
done
