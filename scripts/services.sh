#!/usr/bin/env bash
# Makes sure PostgreSQL and RabbitMQ (with the management plugin) answer on loopback.
# Installs (never starts) Prometheus, which the monitoring test runs on its own.
# Starts what is stopped; installs from Debian's packages what is absent; uses
# docker compose only when a Docker engine answers. Safe to run again and again.
set -euo pipefail

PG_PORT=${LAPSE_PG_PORT:-5432}
AMQP_PORT=${LAPSE_AMQP_PORT:-5672}
MGMT_PORT=${LAPSE_MGMT_PORT:-15672}
here=$(cd "$(dirname "$0")/.." && pwd)

log() { echo "[services] $*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port seconds what
  for _ in $(seq 1 "$2"); do port_open "$1" && return 0; sleep 1; done
  log "$3 did not open port $1 within $2 s"; return 1
}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=""
apt_install() {
  [ -n "$apt_updated" ] || { as_root apt-get update -q; apt_updated=1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

# --- Prometheus: installed only (tests/it/prometheus.rs starts its own on a free port) -
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  log "installing Prometheus from Debian's packages (not started here)"
  apt_install --no-install-recommends prometheus
fi

# --- PgBouncer: installed only (tests/it/pooler.rs runs its own, in transaction mode) -
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  log "installing PgBouncer from Debian's packages (not started here)"
  apt_install --no-install-recommends pgbouncer
  # The package starts a system instance on :6432; the tests do not use it.
  as_root systemctl disable --now pgbouncer >/dev/null 2>&1 \
    || as_root service pgbouncer stop >/dev/null 2>&1 || true
fi

if port_open "$PG_PORT" && port_open "$AMQP_PORT" && port_open "$MGMT_PORT"; then
  log "PostgreSQL :$PG_PORT, RabbitMQ :$AMQP_PORT and management :$MGMT_PORT are up"
  exit 0
fi

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  log "starting services with docker compose"
  docker compose -f "$here/docker-compose.yml" up -d rabbitmq postgres
  wait_port "$PG_PORT" 60 PostgreSQL
  wait_port "$AMQP_PORT" 90 RabbitMQ
  wait_port "$MGMT_PORT" 60 "RabbitMQ management"
  exit 0
fi

# --- PostgreSQL -------------------------------------------------------------
if ! port_open "$PG_PORT"; then
  if ! command -v pg_ctlcluster >/dev/null; then
    log "installing PostgreSQL from Debian's packages"
    apt_install postgresql
    installed_pg=1
  fi
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -1)
    as_root pg_createcluster "$version" main
  fi
  if [ -n "${installed_pg:-}" ]; then
    # A fresh install asks for passwords on TCP; lapse's defaults use trust on loopback.
    hba=/etc/postgresql/$version/main/pg_hba.conf
    as_root sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
  fi
  log "starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_port "$PG_PORT" 60 PostgreSQL
fi

# --- RabbitMQ ---------------------------------------------------------------
if ! command -v rabbitmq-server >/dev/null; then
  log "installing RabbitMQ from Debian's packages"
  apt_install rabbitmq-server
fi
if ! port_open "$AMQP_PORT"; then
  log "starting RabbitMQ"
  as_root rabbitmq-server -detached || true
  wait_port "$AMQP_PORT" 120 RabbitMQ
fi
for _ in $(seq 1 30); do
  as_root rabbitmqctl -q await_startup >/dev/null 2>&1 && break
  sleep 1
done
if ! port_open "$MGMT_PORT"; then
  log "enabling the RabbitMQ management plugin"
  as_root rabbitmq-plugins -q enable rabbitmq_management >/dev/null
  wait_port "$MGMT_PORT" 60 "RabbitMQ management"
fi
# At-least-once dead-lettering silently degrades without these two flags.
as_root rabbitmqctl -q enable_feature_flag quorum_queue >/dev/null 2>&1 || true
as_root rabbitmqctl -q enable_feature_flag stream_queue >/dev/null 2>&1 || true
log "PostgreSQL :$PG_PORT, RabbitMQ :$AMQP_PORT and management :$MGMT_PORT are up"
