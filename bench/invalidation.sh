#!/usr/bin/env bash
# Bounded staleness for writes that bypass pgcache: under a pgbench write
# load of about 1,000 transactions/s on a direct connection, how long after a
# write commits does pgcache stop serving the old value (p50, p99, max)?
# Once with synchronous commit, once with synchronous_commit = off (where the
# heartbeat's synchronous commit flushes the WAL decoding waits for). Then
# the heartbeat's cost: pgbench tpcb-like TPS on a direct connection while
# pgcache streams the database with heartbeats every 100 ms, against while
# it streams with heartbeats practically off (one a day).
#   bench/invalidation.sh [SAMPLES] [SECONDS-PER-TPS-RUN]   (default 300, 15)
source "$(dirname "$0")/lib.sh"
SAMPLES=${1:-300}
DURATION=${2:-15}

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
for commit in sync async; do
    "$ROOT/target/release/examples/staleness" \
        "host=127.0.0.1 port=$PGPORT user=postgres dbname=bench" \
        "host=127.0.0.1 port=$PGCACHE_PORT user=postgres dbname=bench" "$SAMPLES" "$commit"
done
# A background job of a script ignores SIGINT: TERM ends it.
kill $LOAD 2>/dev/null || true
wait $LOAD 2>/dev/null || true
sleep 1 # statistics are reported at transaction end, with a short delay
python3 -c "print(f'write load during the measurement: {($(updates) - $BEFORE) / ($(date +%s.%N) - $STARTED):.0f} updates/s on a direct connection')"

# The heartbeat's cost on writes: pgbench's TPC-B-like script directly on
# PostgreSQL while one pgcache streams the database, with heartbeats every
# 100 ms or one a day; each twice, interleaved, best of two.
kill "$PGCACHE_PID" 2>/dev/null || true
printf '[replication]\nheartbeat_ms = 86400000\nmax_staleness_ms = 172800000\n' >"$RUNDIR/noheartbeat.toml"
streamed_tps() {
    local port; port=$(free_port)
    start_pgcache "$port" "$@"
    "$PGBIN/psql" -h 127.0.0.1 -p "$port" -U postgres -d bench -XAtqc "SELECT 1" >/dev/null
    sleep 1 # the stream starts in the background
    tps "$PGPORT" simple -c 4 -j 2 -T "$DURATION"
    kill "$PGCACHE_PID"; wait "$PGCACHE_PID" 2>/dev/null || true
}
on=(); off=()
for _ in 1 2; do
    on+=("$(streamed_tps)")
    off+=("$(streamed_tps --config "$RUNDIR/noheartbeat.toml")")
done
python3 - "${on[@]}" "${off[@]}" <<'PY'
import sys
on, off = max(map(float, sys.argv[1:3])), max(map(float, sys.argv[3:5]))
print(f"pgbench tpcb-like TPS, direct, database streamed: heartbeat 100 ms {on:.0f}, "
      f"heartbeat off {off:.0f}, ratio {on / off:.3f}")
PY
