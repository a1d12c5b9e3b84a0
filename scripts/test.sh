#!/usr/bin/env bash
# The whole test suite: make sure the services are up, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
# The cluster tests (tests/it/cluster.rs, a private 3-node RabbitMQ cluster, a few
# minutes) are part of the suite; RUN_CLUSTER_TESTS=0 leaves them out of a quick run.
export RUN_CLUSTER_TESTS=${RUN_CLUSTER_TESTS:-1}
cargo test --locked "$@"
# The tests whose outcome depends on the broker's version, again against a private
# RabbitMQ 4.x node (scripts/test-rabbitmq4.sh; the first run makes its Debian 13
# root, a few minutes). LAPSE_RABBITMQ4=0 leaves them out; so does a run given
# arguments (a filter, say): they would not apply to that subset.
if [ $# -eq 0 ]; then
  bash scripts/test-rabbitmq4.sh
  # The container image, where a Docker engine answers (skipped loudly otherwise).
  bash scripts/test-image.sh
fi
