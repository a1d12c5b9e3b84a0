#!/usr/bin/env bash
# lapse's main job on local services: provision the broker, schedule a few orders,
# run the worker, and watch them close on time (one paid, one extended).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
echo "== building lapse (release)"
cargo build --release --locked --quiet
lapse() { ./target/release/lapse --config lapse.example.toml "$@"; }
# The worker runs in the background: start the binary itself so the signal reaches it.
start_worker() { exec ./target/release/lapse --config lapse.example.toml worker "$@"; }
export RUST_LOG=${RUST_LOG:-warn}

echo "== migrate, topology apply, topology verify"
lapse migrate
lapse topology apply | tail -1
lapse topology verify | tail -1

echo "== five orders due in 3 s (2 apples + 1 pear each)"
ids=$(lapse order create --expires-in 3s --line apple:2 --line pear:1 --count 5)
set -- $ids
echo "created: $*"
lapse order pay "$1"
lapse order extend "$2" --by 2s

echo "== worker running for 7 s"
start_worker --metrics-listen 127.0.0.1:9464 &
worker=$!
sleep 6
echo "-- its health"
curl -s http://127.0.0.1:9464/health; echo
echo "-- is it ready"
curl -s http://127.0.0.1:9464/readyz; echo
echo "-- a few of its metrics"
curl -s http://127.0.0.1:9464/metrics | grep -E '^lapse_(closes_total|decisions_total|close_lateness_seconds_(count|sum))' || true
sleep 1
kill -TERM "$worker"
wait "$worker"

for id in "$@"; do
  echo
  lapse order show "$id"
done
echo
echo "== a payment after the close is refused and recorded for a refund"
lapse order pay "$3" || true
