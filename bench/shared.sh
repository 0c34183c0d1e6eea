#!/usr/bin/env bash
# The shared tier (Redis), in one run: PostgreSQL directly vs a pgcache
# instance that answers from Redis what another instance computed.
#   instance A  normal pgcache: fills Redis
#   instance B  cache.local.max_bytes = 0, so every hit is a shared-tier hit
#               (the case of an instance whose local tier is cold and Redis warm)
#   hot-key     pgbench, 8 clients, SELECT by primary key over 1,000 keys (simple, prepared)
#   aggregate   SELECT bid, sum(abalance) FROM pgbench_accounts GROUP BY bid (scale 10)
#   instance C  cache.shared.consistency = "read_your_writes": local hits,
#               each confirmed with Redis first; against A (eventual)
# Prints B/direct ratios and Redis round trips per query on B, and C's hot-key
# TPS and latency against A's.
#   bench/shared.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}

build_pgcache
start_postgres
init_bench_db

command -v redis-server >/dev/null || apt_install redis-server
REDIS_PORT=$(free_port)
mkdir -p "$RUNDIR/redis"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
    --pidfile "$RUNDIR/redis/redis.pid" --logfile "$RUNDIR/redis/redis.log" --dir "$RUNDIR/redis" >/dev/null
wait_port "$REDIS_PORT"

A_PORT=$(free_port); B_PORT=$(free_port)
printf '[cache.local]\nmax_bytes = 0\n' >"$RUNDIR/shared-only.toml"
start_pgcache "$A_PORT" --redis "redis://127.0.0.1:$REDIS_PORT"
A_METRICS=$METRICS_PORT
start_pgcache "$B_PORT" --redis "redis://127.0.0.1:$REDIS_PORT" --config "$RUNDIR/shared-only.toml"
B_METRICS=$METRICS_PORT
C_PORT=$(free_port)
printf '[cache.shared]\nconsistency = "read_your_writes"\n' >"$RUNDIR/ryw.toml"
start_pgcache "$C_PORT" --redis "redis://127.0.0.1:$REDIS_PORT" --config "$RUNDIR/ryw.toml"
C_METRICS=$METRICS_PORT

# metric PORT NAME: the sum of a metric's samples on an instance.
metric() {
    curl -fsS "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $2} END {printf "%d", s}'
}
command -v curl >/dev/null || apt_install curl

# Log in to both instances, then wait until their replication streams are up:
# a stream starting later would bump the shared epoch and void what A filled.
for pair in "$A_PORT:$A_METRICS" "$B_PORT:$B_METRICS" "$C_PORT:$C_METRICS"; do
    "$PGBIN/psql" -h 127.0.0.1 -p "${pair%%:*}" -U postgres -qAt -c 'SELECT 1' bench >/dev/null
    for _ in $(seq 1 200); do
        curl -fsS "http://127.0.0.1:${pair##*:}/readyz" >/dev/null 2>&1 && break
        sleep 0.05
    done
done

hotkey_sql 1000
echo 'SELECT bid, sum(abalance) FROM pgbench_accounts GROUP BY bid;' >"$RUNDIR/aggregate.sql"
# Every one of the 1,000 keys, once, to fill Redis through A.
python3 -c "
for aid in range(1, 1001):
    print(f'SELECT abalance FROM pgbench_accounts WHERE aid = {aid};')" >"$RUNDIR/fill.sql"

row() { printf '%-24s %12s %12s %10s %14s\n' "$@"; }
row workload direct "B (Redis)" "B/direct" "Redis RT/query"
for mode in simple prepared; do
    # Fill Redis through A with every key, in this protocol flavour.
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$A_PORT" -U postgres -n -M "$mode" -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 3 bench >/dev/null
    [ "$mode" = simple ] && "$PGBIN/psql" -h 127.0.0.1 -p "$A_PORT" -U postgres -q -f "$RUNDIR/fill.sql" bench >/dev/null
    args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION")
    trips0=$(metric "$B_METRICS" pgcache_shared_round_trips_total)
    lookups0=$(metric "$B_METRICS" pgcache_cache_lookups_total)
    d=$(best2 tps "$PGPORT" "$mode" "${args[@]}")
    b=$(best2 tps "$B_PORT" "$mode" "${args[@]}")
    trips=$(( $(metric "$B_METRICS" pgcache_shared_round_trips_total) - trips0 ))
    lookups=$(( $(metric "$B_METRICS" pgcache_cache_lookups_total) - lookups0 ))
    row "hot-key tps ($mode)" "$(printf %.0f "$d")" "$(printf %.0f "$b")" "$(ratio "$b" "$d")" "$(ratio "$trips" "$lookups")"
done
"$PGBIN/psql" -h 127.0.0.1 -p "$A_PORT" -U postgres -q -f "$RUNDIR/aggregate.sql" bench >/dev/null
args=(-f "$RUNDIR/aggregate.sql" -c 8 -j 2 -T "$DURATION")
trips0=$(metric "$B_METRICS" pgcache_shared_round_trips_total)
lookups0=$(metric "$B_METRICS" pgcache_cache_lookups_total)
d=$(tps "$PGPORT" simple "${args[@]}")
b=$(tps "$B_PORT" simple "${args[@]}")
trips=$(( $(metric "$B_METRICS" pgcache_shared_round_trips_total) - trips0 ))
lookups=$(( $(metric "$B_METRICS" pgcache_cache_lookups_total) - lookups0 ))
row "aggregate tps" "$(printf %.0f "$d")" "$(printf %.0f "$b")" "$(ratio "$b" "$d")" "$(ratio "$trips" "$lookups")"
hits=$(curl -fsS "http://127.0.0.1:$B_METRICS/metrics" | awk '/^pgcache_shared_lookups_total\{result="hit"\}/ {print $2}')
misses=$(curl -fsS "http://127.0.0.1:$B_METRICS/metrics" | awk '/^pgcache_shared_lookups_total\{result="miss"\}/ {print $2}')
echo "B shared-tier lookups: ${hits:-0} hits, ${misses:-0} misses"

# read_your_writes: hot keys from the local tier on A (eventual) and on C,
# whose every read confirms its versions with Redis first.
# latency PORT: pgbench's average latency in ms, hot keys, 8 clients.
latency() {
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$1" -U postgres -n -M prepared -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION" bench 2>&1 |
        sed -n 's/^latency average = \([0-9.]*\) ms/\1/p'
}
args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 3)
"$PGBIN/pgbench" -h 127.0.0.1 -p "$C_PORT" -U postgres -n -M prepared "${args[@]}" bench >/dev/null
args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION")
trips0=$(metric "$C_METRICS" pgcache_shared_round_trips_total)
lookups0=$(metric "$C_METRICS" pgcache_cache_lookups_total)
a=$(best2 tps "$A_PORT" prepared "${args[@]}")
c=$(best2 tps "$C_PORT" prepared "${args[@]}")
trips=$(( $(metric "$C_METRICS" pgcache_shared_round_trips_total) - trips0 ))
lookups=$(( $(metric "$C_METRICS" pgcache_cache_lookups_total) - lookups0 ))
la=$(latency "$A_PORT"); lc=$(latency "$C_PORT")
echo "read_your_writes vs eventual, hot keys (prepared, 8 clients): TPS $(printf %.0f "$c") vs $(printf %.0f "$a")" \
    "(ratio $(ratio "$c" "$a")), average latency ${lc} ms vs ${la} ms (ratio $(ratio "$lc" "$la")), Redis round trips per read $(ratio "$trips" "$lookups")"
