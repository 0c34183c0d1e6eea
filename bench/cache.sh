#!/usr/bin/env bash
# What the cache buys, in one run: PostgreSQL directly vs pgcache vs
# Pgpool-II's query cache (installed with apt-get when missing).
#   hot-key   pgbench, 8 clients, SELECT by primary key over 1,000 keys (simple, prepared)
#   latency   the same with 1 client (simple, prepared): average latency, lower is better
#   aggregate SELECT bid, sum(abalance) FROM pgbench_accounts GROUP BY bid (scale 10)
#   memory    pgcache with cache.local.max_bytes = 256 MiB after 1,000,000 distinct keys
#   bench/cache.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}

build_pgcache
start_postgres
init_bench_db
PGCACHE_PORT=$(free_port)
start_pgcache "$PGCACHE_PORT"
PGCACHE_PID=${PIDS[-1]}
if start_pgpool 2>/dev/null; then HAVE_PGPOOL=1; else HAVE_PGPOOL=0; echo "Pgpool-II unavailable: its column is skipped" >&2; fi

hotkey_sql 1000
echo 'SELECT bid, sum(abalance) FROM pgbench_accounts GROUP BY bid;' >"$RUNDIR/aggregate.sql"

# latency PORT MODE: average latency in ms with one client.
latency() {
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$1" -U postgres -n -M "$2" -f "$RUNDIR/hotkey.sql" -c 1 -j 1 -T "$DURATION" bench 2>&1 |
        sed -n 's/^latency average = \([0-9.]*\) ms/\1/p'
}

row() { # name direct pgcache pgpool higher_is_better
    local pp="-" rp="-" rc
    rc=$(ratio "$3" "$2")
    if [ "$HAVE_PGPOOL" = 1 ]; then pp=$4; rp=$(ratio "$4" "$2"); fi
    printf '%-22s %12s %12s %12s %10s %10s\n' "$1" "$2" "$3" "$pp" "$rc" "$rp"
}

printf '%-22s %12s %12s %12s %10s %10s\n' workload direct pgcache pgpool cache/dir pool/dir
for mode in simple prepared; do
    args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION")
    # Warm the caches for the 1,000 keys, then measure (best of two).
    tps "$PGCACHE_PORT" "$mode" -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 2 >/dev/null
    [ "$HAVE_PGPOOL" = 1 ] && tps "$PGPOOL_PORT" "$mode" -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 2 >/dev/null
    d=$(best2 tps "$PGPORT" "$mode" "${args[@]}")
    c=$(best2 tps "$PGCACHE_PORT" "$mode" "${args[@]}")
    p=0
    [ "$HAVE_PGPOOL" = 1 ] && p=$(best2 tps "$PGPOOL_PORT" "$mode" "${args[@]}")
    row "hot-key tps ($mode)" "$(printf %.0f "$d")" "$(printf %.0f "$c")" "$(printf %.0f "$p")"
done
for mode in simple prepared; do
    d=$(latency "$PGPORT" "$mode"); c=$(latency "$PGCACHE_PORT" "$mode"); p=0
    [ "$HAVE_PGPOOL" = 1 ] && p=$(latency "$PGPOOL_PORT" "$mode")
    row "latency ms ($mode)" "$d" "$c" "$p"
done
args=(-f "$RUNDIR/aggregate.sql" -c 8 -j 2 -T "$DURATION")
d=$(tps "$PGPORT" simple "${args[@]}")
tps "$PGCACHE_PORT" simple -f "$RUNDIR/aggregate.sql" -c 1 -T 1 >/dev/null
c=$(tps "$PGCACHE_PORT" simple "${args[@]}"); p=0
if [ "$HAVE_PGPOOL" = 1 ]; then
    tps "$PGPOOL_PORT" simple -f "$RUNDIR/aggregate.sql" -c 1 -T 1 >/dev/null
    p=$(tps "$PGPOOL_PORT" simple "${args[@]}")
fi
row "aggregate tps" "$(printf %.0f "$d")" "$(printf %.0f "$c")" "$(printf %.0f "$p")"

# Memory bound: one million distinct keys through a 256 MiB cache.
cat >"$RUNDIR/distinct.sql" <<'SQL'
\set aid random(1, 1000000)
\set r random(1, 1000000000)
SELECT abalance, filler, :r AS r FROM pgbench_accounts WHERE aid = :aid;
SQL
tps "$PGCACHE_PORT" prepared -f "$RUNDIR/distinct.sql" -c 8 -j 2 -t 125000 >/dev/null
echo "memory: pgcache peak RSS $(peak_rss_mib "$PGCACHE_PID") MiB after 1,000,000 distinct keys (cache.local.max_bytes = 256 MiB)"
