#!/usr/bin/env bash
# The container image, where a Docker engine answers: build it, check what it runs as
# and with, run `lapse --version` and `lapse topology plan` in it, and the demo against
# the compose services. Where no engine answers this says so loudly and exits 0: the
# image cannot be tested here, which is not a failure of the code.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v docker > /dev/null 2>&1 || ! docker info > /dev/null 2>&1; then
  echo "################################################################" >&2
  echo "# SKIPPED: container image test — no Docker engine answers      #" >&2
  echo "# (docker info failed). The image was neither built nor run.    #" >&2
  echo "################################################################" >&2
  exit 0
fi
tag="lapse-image-test:$$"
cleanup() { docker image rm -f "$tag" > /dev/null 2>&1 || true; }
trap cleanup EXIT
commit=$(git rev-parse --short=12 HEAD 2> /dev/null || echo unknown)
echo "[image] building $tag (commit $commit)"
docker build --build-arg "BUILD_GIT_COMMIT=$commit" -t "$tag" .
fail() { echo "[image] FAILED: $*" >&2; exit 1; }
version=$(docker run --rm "$tag" --version)
echo "[image] $version"
[[ "$version" == "lapse "*"(commit $commit)" ]] || fail "--version printed '$version'"
docker run --rm "$tag" topology plan > /dev/null || fail "lapse topology plan"
uid=$(docker run --rm --entrypoint id "$tag" -u)
[ "$uid" != 0 ] || fail "the image runs as root"
docker image inspect "$tag" --format '{{json .Config.Healthcheck.Test}}' | grep -q probe \
  || fail "no HEALTHCHECK with lapse probe"
docker image inspect "$tag" --format '{{json .Config.Cmd}}' | grep -q worker \
  || fail "CMD is not worker"
echo "[image] the demo in the image, against the compose services"
docker compose up -d --wait rabbitmq postgres
docker compose run --rm --build demo
echo "[image] ok"
