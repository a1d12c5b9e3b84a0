#!/usr/bin/env bash
# The whole test suite: make sure the services are up, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
cargo test --locked "$@"
