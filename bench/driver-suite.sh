#!/usr/bin/env bash
# A driver's own test suite, run directly against PostgreSQL and through
# pgcache (cache on; session mode and transaction pooling) in one run:
# node-postgres's integration tests, one file at a time as its Makefile
# runs them. Prints per route the test files and tests that passed, and
# every file whose outcome differs from the direct run.
#
#   NODE_POSTGRES_SRC=/path/to/node-postgres bench/driver-suite.sh
#
# NODE_POSTGRES_SRC is a checkout (or bare git directory) of
# github.com/brianc/node-postgres: npm publishes the driver without its
# tests. Node.js and npm are installed with apt-get when missing; the
# driver's dependencies come from the npm registry.
. "$(dirname "$0")/lib.sh"

SRC=${NODE_POSTGRES_SRC:?set NODE_POSTGRES_SRC to a node-postgres checkout}
command -v node >/dev/null && command -v npm >/dev/null || apt_install nodejs npm

mkdir -p "$RUNDIR/np"
if git --git-dir="$SRC" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    git --git-dir="$SRC" archive HEAD packages/pg | tar -x -C "$RUNDIR/np"
elif git -C "$SRC" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    git -C "$SRC" archive HEAD packages/pg | tar -x -C "$RUNDIR/np"
else
    mkdir -p "$RUNDIR/np/packages" && cp -r "$SRC/packages/pg" "$RUNDIR/np/packages/"
fi
DRIVER="$RUNDIR/np/packages/pg"
# The runtime dependencies and what the integration tests require, without
# the Cloudflare worker tooling.
python3 - "$DRIVER/package.json" <<'PY'
import json, sys
path = sys.argv[1]
pkg = json.load(open(path))
dev = pkg.get("devDependencies", {})
pkg["devDependencies"] = {k: v for k, v in dev.items() if k in ("async", "bluebird", "co", "pg-copy-streams")}
pkg.pop("optionalDependencies", None)
pkg.pop("peerDependencies", None)
json.dump(pkg, open(path, "w"), indent=2)
PY
(cd "$DRIVER" && npm install --no-audit --no-fund --silent >/dev/null 2>&1) || {
    echo "npm install failed" >&2
    exit 1
}

start_postgres
build_pgcache
PROXY_PORT=$(free_port)
start_pgcache "$PROXY_PORT"
PROXY_METRICS=$METRICS_PORT
# The same with transaction pooling: statements prepared once per server
# connection, settings carried from client to connection, pins.
printf '[pool]\nmode = "transaction"\ndefault_pool_size = 10\n' >"$RUNDIR/transaction.toml"
TX_PORT=$(free_port)
start_pgcache "$TX_PORT" --config "$RUNDIR/transaction.toml"
TX_METRICS=$METRICS_PORT

# run_suite LABEL PORT: each test file's exit status and ticks, per line.
run_suite() {
    local label=$1 port=$2 db="driver_$1"
    mkdir -p "$RUNDIR/out/$label"
    (cd "$DRIVER" && find test/integration -name '*-tests.js' | sort) | while read -r file; do
        local log="$RUNDIR/out/$label/$(echo "$file" | tr / _).log" status=0
        (cd "$DRIVER" && PGHOST=127.0.0.1 PGPORT=$port PGUSER=postgres PGDATABASE=$db PGTESTNOSSL=true \
            timeout 180 node "$file") >"$log" 2>&1 || status=$?
        echo "$file $status $(grep -c '✔' "$log")"
    done >"$RUNDIR/$label.results"
}

# Every database is made before any suite runs: a suite's psql connects to
# template1, and a pooler's idle connection there (pgcache's as
# PgBouncer's) would make a later CREATE DATABASE, sent directly, fail.
for route in direct pgcache transaction; do
    "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres "driver_$route"
done
run_suite direct "$PGPORT"
run_suite pgcache "$PROXY_PORT"
run_suite transaction "$TX_PORT"

summary() {
    awk '{ files++; if ($2 == 0) ok++; ticks += $3 } END {
        printf "%-12s %d/%d test files pass, %d tests pass\n", label, ok, files, ticks }' label="$1" "$RUNDIR/$1.results"
}
outcomes() { awk '{print $1, ($2 == 0 ? "pass" : "FAIL"), $3}' "$RUNDIR/$1.results"; }
echo "node-postgres $(cd "$DRIVER" && node -p 'require("./package.json").version') integration tests (PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}'))"
for route in direct pgcache transaction; do summary "$route"; done
for route in pgcache transaction; do
    if diff <(outcomes direct) <(outcomes "$route") >"$RUNDIR/differ-$route.txt"; then
        echo "$route: no file differs"
    else
        echo "$route: files that differ (< direct, > through pgcache):"
        cat "$RUNDIR/differ-$route.txt"
        for file in $(grep '^>' "$RUNDIR/differ-$route.txt" | awk '$3 == "FAIL" {print $2}'); do
            echo "--- $file through $route:"
            tail -20 "$RUNDIR/out/$route/$(echo "$file" | tr / _).log"
        done
    fi
done
echo "files failing on both routes: $(awk '$2 != 0 {print $1}' "$RUNDIR/direct.results" | tr '\n' ' ')"
for route in pgcache:$PROXY_METRICS transaction:$TX_METRICS; do
    echo "${route%%:*}'s lookups during the run:"
    python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://127.0.0.1:${route#*:}/metrics" | grep -E '^pgcache_(cache_lookups_total|pool_pins_total)' || true
done
