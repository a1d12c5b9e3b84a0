#!/usr/bin/env bash
# lapse's main job on local services: provision the broker from the tier file and
# prove it is right.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
cargo build --release --locked --quiet
lapse() { ./target/release/lapse --config lapse.example.toml "$@"; }
echo "== topology apply"
lapse topology apply
echo "== topology verify"
lapse topology verify
