#!/usr/bin/env bash
# Benchmarks on local services (release build) with `lapse bench`: every scenario, the
# broker alone first, a table on stdout, the JSON report and the pictures in docs/img.
# Results and what bounds them: docs/benchmarks.md.
#   bash scripts/bench.sh                      # lapse bench all
#   bash scripts/bench.sh steady --rate 500 --duration 60s
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
cargo build --release --locked --quiet
export LAPSE_BROKER__MANAGEMENT_URL=${LAPSE_BROKER__MANAGEMENT_URL:-http://guest:guest@127.0.0.1:15672}
export LAPSE_DATABASE__URL=${LAPSE_DATABASE__URL:-postgres://postgres@127.0.0.1:5432/postgres}
export LAPSE_LOG=${LAPSE_LOG:-warn}
if [ $# -eq 0 ]; then
  set -- all --svg docs/img
fi
"${CARGO_TARGET_DIR:-target}"/release/lapse bench "$@"
