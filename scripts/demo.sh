#!/usr/bin/env bash
# lapse's main job on local services: `lapse demo` schedules thousands of orders in
# its own broker prefix and database, runs the worker in-process while payments and
# extensions race the deadlines, prints a report and writes an SVG picture, then
# removes what it created. Arguments go to `lapse demo` (e.g. --orders 500 --duration 10s).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
echo "== building lapse (release)"
cargo build --release --locked --quiet
echo "== lapse demo $*"
exec "${CARGO_TARGET_DIR:-target}/release/lapse" --config lapse.example.toml demo "$@"
