# syntax=docker/dockerfile:1
# The lapse image: `docker build -t lapse .` (add `--build-arg BUILD_GIT_COMMIT=$(git
# rev-parse --short=12 HEAD)` for the commit in `lapse --version`; the build context
# carries no .git). Runs as an unprivileged user; `lapse worker` by default.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, in a layer of their own: a change to lapse's sources rebuilds
# lapse, not the ~300 crates below it. Stub sources stand in for the real ones.
COPY Cargo.toml Cargo.lock build.rs ./
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked \
 && rm -rf src target/release/.fingerprint/lapse-* target/release/deps/lapse-* target/release/deps/liblapse-*
COPY src ./src
COPY migrations ./migrations
# The default tiers are compiled into the binary (src/tier_file.rs includes this file).
COPY topology ./topology
ARG BUILD_GIT_COMMIT=unknown
ENV BUILD_GIT_COMMIT=${BUILD_GIT_COMMIT}
RUN cargo build --release --locked && strip target/release/lapse

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 lapse \
 && useradd --system --uid 10001 --gid lapse --home-dir /var/lib/lapse --create-home --shell /usr/sbin/nologin lapse
COPY --from=build /src/target/release/lapse /usr/local/bin/lapse
# Other shipped tier files, for `topology.file = "/etc/lapse/topology/rocketmq-4x.toml"`;
# the default tiers need none of them.
COPY topology /etc/lapse/topology
USER lapse:lapse
WORKDIR /var/lib/lapse
# /metrics, /livez, /readyz and /health.
ENV LAPSE_WORKER__METRICS_LISTEN=0.0.0.0:9464
EXPOSE 9464
# The image has no HTTP client: `lapse probe` asks /livez and exits 0 when live.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["lapse", "probe", "--timeout", "4s"]
ENTRYPOINT ["lapse"]
CMD ["worker"]
