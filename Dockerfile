FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
# The default tiers are compiled into the binary (src/tier_file.rs includes this file).
COPY topology ./topology
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/lapse /usr/local/bin/lapse
# Other shipped tier files, for `topology.file = "/etc/lapse/topology/rocketmq-4x.toml"`;
# the default tiers need none of them.
COPY topology /etc/lapse/topology
WORKDIR /var/lib/lapse
ENTRYPOINT ["lapse"]
