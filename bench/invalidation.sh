#!/usr/bin/env bash
# Bounded staleness for writes that bypass pgcache: under a pgbench write
# load of about 1,000 transactions/s on a direct connection, how long after a
# write commits does pgcache stop serving the old value (p50, p99, max)?
#   bench/invalidation.sh [SAMPLES]   (default 300)
source "$(dirname "$0")/lib.sh"
SAMPLES=${1:-300}

build_pgcache
(cd "$ROOT" && cargo build --release --locked -q --example staleness)
start_postgres
init_bench_db
PGCACHE_PORT=$(free_port)
start_pgcache "$PGCACHE_PORT"

cat >"$RUNDIR/writes.sql" <<'SQL'
\set aid random(1, 1000000)
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
SQL
updates() { "$PGBIN/psql" -h 127.0.0.1 -p "$PGPORT" -U postgres -d bench -XAtc \
    "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'pgbench_accounts'"; }
BEFORE=$(updates); STARTED=$(date +%s.%N)
# The write load, rate-limited to ~1,000/s, runs for the whole measurement.
"$PGBIN/pgbench" -h 127.0.0.1 -p "$PGPORT" -U postgres -n -f "$RUNDIR/writes.sql" -c 4 -j 2 -R 1000 -T 600 bench \
    >"$RUNDIR/load.log" 2>&1 &
LOAD=$!
PIDS+=($LOAD)
"$ROOT/target/release/examples/staleness" \
    "host=127.0.0.1 port=$PGPORT user=postgres dbname=bench" \
    "host=127.0.0.1 port=$PGCACHE_PORT user=postgres dbname=bench" "$SAMPLES"
kill -INT $LOAD 2>/dev/null || true
wait $LOAD 2>/dev/null || true
sleep 1 # statistics are reported at transaction end, with a short delay
python3 -c "print(f'write load during the measurement: {($(updates) - $BEFORE) / ($(date +%s.%N) - $STARTED):.0f} updates/s on a direct connection')"
