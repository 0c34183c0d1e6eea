#!/usr/bin/env bash
# pgcache's own instructions per transaction, counted by callgrind: unlike
# throughput on a shared 2-core machine, the count is the same from run to
# run, so a few percent of difference is visible. Each route runs pgcache
# under valgrind, warms it with 2,000 transactions, then counts 10,000
# (4 clients, hot-key select-only, 1,000 keys):
#   no-cache    --no-cache (frames relayed in bulk)
#   shadow      cache.mode = "shadow" (the whole caching path on every
#               statement, every answer compared with the would-be hit)
#   cache       the default mode (nearly all hits), sampler off
#   sampler     the default mode with the sampler at its default rate
# and prints the ratios that bench/trust.sh targets (shadow / no-cache,
# sampler / cache), in instructions.
# The modes ddl and distinct count what is not a hit instead, per statement
# of a psql script in one session (default settings, its stream up, the
# second after the script counted too, as the stream handles DDL then):
#   ddl        100 x (CREATE TABLE ddl_i(a int); SELECT count(*) FROM t WHERE k < i)
#   distinct   1,000 distinct SELECT v FROM t WHERE k = <i>
#   bench/instructions.sh [simple|prepared|ddl|distinct ...]   (default: simple prepared)
# KEEP=dir keeps the callgrind profiles there, for callgrind_annotate (build
# with CARGO_PROFILE_RELEASE_DEBUG=line-tables-only and a CARGO_TARGET_DIR
# of its own to see functions and lines).
source "$(dirname "$0")/lib.sh"
if [ $# -gt 0 ]; then MODES=("$@"); else MODES=(simple prepared); fi
command -v valgrind >/dev/null || apt_install valgrind

build_pgcache
start_postgres
init_bench_db
hotkey_sql 1000
printf '[cache]\nmode = "shadow"\n' >"$RUNDIR/shadow.toml"
printf '[cache]\nverify_sample_rate = 0\n' >"$RUNDIR/cache.toml"
printf '[cache]\nverify_sample_rate = 0.001\n' >"$RUNDIR/sampler.toml"

# count ROUTE MODE FLAGS...: instructions per transaction.
count() {
    local route=$1 mode=$2; shift 2
    local port metrics out="$RUNDIR/callgrind.$route.$mode"
    port=$(free_port); metrics=$(free_port)
    RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out" "$PGCACHE_BIN" \
        --listen "127.0.0.1:$port" --upstream "postgres://postgres@127.0.0.1:$PGPORT" \
        --metrics "127.0.0.1:$metrics" "$@" >"$RUNDIR/valgrind.$route.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        "$PGBIN/psql" -X -h 127.0.0.1 -p "$port" -U postgres -d bench -Atc 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.5
    done
    bench_run() {
        "$PGBIN/pgbench" -h 127.0.0.1 -p "$port" -U postgres -n -M "$mode" -f "$RUNDIR/hotkey.sql" \
            -c 4 -j 2 -t "$1" bench >"$RUNDIR/pgbench.out" 2>&1 || { cat "$RUNDIR/pgbench.out" >&2; return 1; }
    }
    bench_run 500
    callgrind_control -z "$pid" >/dev/null 2>&1
    bench_run 2500
    callgrind_control -d "$pid" >/dev/null 2>&1
    kill "$pid"; wait "$pid" 2>/dev/null || true
    if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$out.1" "$KEEP/callgrind.$route.$mode"; fi
    callgrind_annotate "$out.1" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print int($1 / 10000)}'
}

# script NAME STATEMENTS: instructions per statement of $RUNDIR/NAME.sql,
# run on a fresh database with t(k, v).
script() {
    local name=$1 statements=$2
    local port metrics out="$RUNDIR/callgrind.$name"
    port=$(free_port); metrics=$(free_port)
    "$PGBIN/psql" -X -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -c "CREATE DATABASE s_$name" \
        -c "\\c s_$name" -c "CREATE TABLE t(k int PRIMARY KEY, v int); INSERT INTO t SELECT i, i FROM generate_series(1, 10000) i" >/dev/null
    RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out" "$PGCACHE_BIN" \
        --listen "127.0.0.1:$port" --upstream "postgres://postgres@127.0.0.1:$PGPORT" \
        --metrics "127.0.0.1:$metrics" >"$RUNDIR/valgrind.$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        "$PGBIN/psql" -X -h 127.0.0.1 -p "$port" -U postgres -d "s_$name" -Atc 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.5
    done
    # The stream starts with the first client.
    sleep 3
    callgrind_control -z "$pid" >/dev/null 2>&1
    "$PGBIN/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d "s_$name" -f "$RUNDIR/$name.sql" >/dev/null
    sleep 1
    callgrind_control -d "$pid" >/dev/null 2>&1
    kill "$pid"; wait "$pid" 2>/dev/null || true
    if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$out.1" "$KEEP/callgrind.$name"; fi
    callgrind_annotate "$out.1" | awk -v n="$statements" '/PROGRAM TOTALS/ {gsub(",", "", $1); print int($1 / n)}'
}

header=
for mode in "${MODES[@]}"; do
    case $mode in
        ddl)
            python3 -c "
for i in range(100):
    print(f'CREATE TABLE ddl_{i}(a int);\nSELECT count(*) FROM t WHERE k < {i};')" >"$RUNDIR/ddl.sql"
            printf '%-10s %12s instructions per statement\n' ddl "$(script ddl 200)"
            continue;;
        distinct)
            python3 -c "
for i in range(1, 1001):
    print(f'SELECT v FROM t WHERE k = {i};')" >"$RUNDIR/distinct.sql"
            printf '%-10s %12s instructions per statement\n' distinct "$(script distinct 1000)"
            continue;;
    esac
    [ -n "$header" ] || printf '%-10s %12s %12s %12s %12s %10s %10s\n' mode no-cache shadow cache sampler shadow/nc sampler/c
    header=1
    nc=$(count no-cache "$mode" --no-cache)
    shadow=$(count shadow "$mode" --config "$RUNDIR/shadow.toml")
    cache=$(count cache "$mode" --config "$RUNDIR/cache.toml")
    sampler=$(count sampler "$mode" --config "$RUNDIR/sampler.toml")
    printf '%-10s %12s %12s %12s %12s %10s %10s\n' "$mode" "$nc" "$shadow" "$cache" "$sampler" \
        "$(ratio "$shadow" "$nc")" "$(ratio "$sampler" "$cache")"
done
