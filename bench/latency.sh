#!/usr/bin/env bash
# Latency at a fixed rate, what users feel: prepared reads by primary key
# over 1,000 hot keys, RATE a second (default 8,000) from 8 clients,
# directly and through pgcache in alternating rounds. Percentiles of every
# transaction's latency (from pgbench -l, measured from its scheduled start)
# per round: p50, p99, p99.9 and the maximum, in microseconds.
#   bench/latency.sh [SECONDS-PER-ROUND] [ROUNDS]   (default 10, 3)
#   RATE=8000; PGCACHE_ARGS="--workers 1" passes flags to pgcache
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}
ROUNDS=${2:-3}
RATE=${RATE:-8000}

build_pgcache
start_postgres
init_bench_db
PGCACHE_PORT=$(free_port)
# shellcheck disable=SC2086
start_pgcache "$PGCACHE_PORT" ${PGCACHE_ARGS:-}
hotkey_sql 1000

# Every key once through pgcache, and once more: each is a hit from then on.
tps "$PGCACHE_PORT" prepared -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 3 >/dev/null

# run NAME PORT: one round at RATE; prints NAME and the percentiles.
run() {
    local dir="$RUNDIR/log-$1"
    rm -rf "$dir"; mkdir -p "$dir"
    (cd "$dir" && tps "$2" prepared -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -R "$RATE" -T "$DURATION" -l --log-prefix=tx >/dev/null)
    cat "$dir"/tx.* | python3 -c '
import sys
# client, transaction, latency (us), script, epoch s, epoch us[, lag us]
lat = sorted(int(line.split()[2]) for line in sys.stdin if line.strip())
pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]
print(f"{sys.argv[1]:8} {len(lat):9d} {pick(0.5):8d} {pick(0.99):8d} {pick(0.999):8d} {lat[-1]:8d}")
' "$1"
}

printf '%-8s %9s %8s %8s %8s %8s   (latency in us, at %s/s)\n' route txns p50 p99 p99.9 max "$RATE"
for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) -eq 1 ]; then
        run direct "$PGPORT"; run pgcache "$PGCACHE_PORT"
    else
        run pgcache "$PGCACHE_PORT"; run direct "$PGPORT"
    fi
done
hits=$(curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | awk '$1 == "pgcache_cache_lookups_total{result=\"hit\"}" {print $2}')
misses=$(curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | awk '$1 == "pgcache_cache_lookups_total{result=\"miss\"}" {print $2}')
echo "pgcache: $hits hits, $misses misses in all"
