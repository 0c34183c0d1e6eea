#!/usr/bin/env bash
# Reads that cannot stay cached: range reads of pgbench_accounts (21 rows
# each, over the first 1,000 accounts) with a share of single-row updates
# to the whole table (every update retires every range read's answer),
# prepared, 8 clients. Directly, then through three pgcache instances in
# turn: defaults, cache.adaptive_admission = true, and --no-cache (relaying
# only). Each round prints every route's TPS, its ratio to direct and
# pgcache's CPU per transaction (user + system, from /proc).
#   bench/churn.sh [SECONDS-PER-RUN] [ROUNDS]   (default 8, 3)
#   WRITES=5: the updates' share of transactions, in percent
source "$(dirname "$0")/lib.sh"
DURATION=${1:-8}
ROUNDS=${2:-3}
WRITES=${WRITES:-5}

build_pgcache
start_postgres
init_bench_db
printf '[cache]\nadaptive_admission = true\n' >"$RUNDIR/admission.toml"
DEFAULT_PORT=$(free_port); start_pgcache "$DEFAULT_PORT"; DEFAULT_PID=$PGCACHE_PID; DEFAULT_METRICS=$METRICS_PORT
ADMISSION_PORT=$(free_port); start_pgcache "$ADMISSION_PORT" --config "$RUNDIR/admission.toml"; ADMISSION_PID=$PGCACHE_PID; ADMISSION_METRICS=$METRICS_PORT
RELAY_PORT=$(free_port); start_pgcache "$RELAY_PORT" --no-cache; RELAY_PID=$PGCACHE_PID
printf '\\set aid random(1, 1000)\nSELECT sum(abalance) FROM pgbench_accounts WHERE aid BETWEEN :aid AND :aid + 20;\n' >"$RUNDIR/range.sql"
printf '\\set aid random(1, 1000000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' >"$RUNDIR/write.sql"
MIX=(-f "$RUNDIR/range.sql@$((100 - WRITES))" -f "$RUNDIR/write.sql@$WRITES" -c 8 -j 2 -T "$DURATION")

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# route NAME PORT PID DIRECT-TPS: one run through pgcache, printed.
route() {
    local t0 t1 n
    t0=$(ticks "$3"); n=$(tps "$2" prepared "${MIX[@]}"); t1=$(ticks "$3")
    python3 -c "import sys; n, d, ticks, hz, s = map(float, sys.argv[2:]); print(f'  {sys.argv[1]:10} {n:9.0f} tps  {n / d:.2f}x direct  {ticks / hz / (n * s) * 1e6:5.1f} us CPU per transaction')" \
        "$1" "$n" "$4" "$((t1 - t0))" "$(getconf CLK_TCK)" "$DURATION"
}
# Once through each, unmeasured: every shape planned, every stream up.
for port in "$DEFAULT_PORT" "$ADMISSION_PORT" "$RELAY_PORT"; do
    tps "$port" prepared "${MIX[@]::4}" -c 8 -j 2 -T 2 >/dev/null
done
echo "range reads with ${WRITES} % updates, ${DURATION} s per run"
for round in $(seq 1 "$ROUNDS"); do
    direct=$(tps "$PGPORT" prepared "${MIX[@]}")
    printf 'round %d: direct %.0f tps\n' "$round" "$direct"
    route defaults "$DEFAULT_PORT" "$DEFAULT_PID" "$direct"
    route admission "$ADMISSION_PORT" "$ADMISSION_PID" "$direct"
    route no-cache "$RELAY_PORT" "$RELAY_PID" "$direct"
done
# What became of the reads: looked up (hits, misses) or not (bypasses, and
# why: not_admitted is admission's pause, replication_stale a stream
# without a recent heartbeat).
for name_port in "defaults $DEFAULT_METRICS" "admission $ADMISSION_METRICS"; do
    read -r name port <<<"$name_port"
    curl -sf "http://127.0.0.1:$port/metrics" | awk -v name="$name" '
        /^pgcache_cache_lookups_total\{/ || /^pgcache_cache_bypasses_total\{reason="(not_admitted|replication_stale)"\}/ {
            sub(/^pgcache_cache_/, ""); out = out " " $1 "=" $2 }
        END { print name ":" out }'
done
