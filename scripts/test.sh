#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the PostgreSQL server,
# redis-server, Prometheus and Chromium binaries the tests start (throwaway
# instances on free ports; nothing here uses services the machine already
# runs), then runs formatting, lint and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
    need_apt+=(postgresql postgresql-contrib)
fi
command -v psql >/dev/null 2>&1 || need_apt+=(postgresql-client)
command -v pgbench >/dev/null 2>&1 || need_apt+=(postgresql-client)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# A real Prometheus scrapes pgcache, and headless Chromium loads its live page.
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "installing: ${need_apt[*]}"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
cargo test --locked
