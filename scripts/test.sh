#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the PostgreSQL server,
# redis-server, Prometheus and Chromium binaries the tests start (throwaway
# instances on free ports; nothing here uses services the machine already
# runs), then runs formatting, lint, every test, and the quickstart for a
# few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/install.sh

need_postgres
need_redis
# A real Prometheus scrapes pgcache, and headless Chromium loads its live page.
need_prometheus
need_chromium
install_needed

cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
# The fuzz targets are a crate of their own (bench/fuzz.sh runs them on
# nightly); building them on stable keeps them in step with the code.
cargo check --locked --manifest-path fuzz/Cargo.toml --target-dir target/fuzz
cargo test --locked
# The README's first command, as a newcomer runs it (with the debug build
# the tests just made, to keep CI short), with CARGO_TARGET_DIR set as many
# Rust developers have it: a link to target/, so nothing is built again.
link=$(mktemp -d)/target
ln -s "$PWD/target" "$link"
CARGO_TARGET_DIR=$link scripts/quickstart.sh --duration 10 --debug
