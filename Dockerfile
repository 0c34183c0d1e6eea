# Builds pgcache from this repository.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
# The disk tier's directory (a volume in docker-compose.yml).
RUN useradd --system pgcache && mkdir -p /var/lib/pgcache && chown pgcache /var/lib/pgcache
COPY --from=build /src/target/release/pgcache /usr/local/bin/pgcache
COPY config/pgcache.toml /etc/pgcache/pgcache.toml
USER pgcache
EXPOSE 6432 9187
ENTRYPOINT ["pgcache", "--config", "/etc/pgcache/pgcache.toml"]
