#!/usr/bin/env bash
# Where a miss's time goes when it is not DDL: the distinct script of
# uncached.sh (2,000 point selects, one session, texts new to the caches in
# every round), ROUNDS interleaved rounds (default 5), through:
#   direct      PostgreSQL
#   bouncer     PgBouncer (session mode)
#   hop         pgcache --no-cache --workers 1: the relay alone
#   one-thread  pgcache with the cache on, --workers 1
#   default     pgcache with its defaults
# Prints each route's median wall time, its ratio to direct, and the
# proxy's user and system CPU per statement (medians; /proc counts in
# 1/100 s, so steps of 5 µs here). With STRACE=1 (strace is installed with
# apt-get when missing) it then counts each proxy's system calls per
# statement over one more run (strace -c -f).
#   bench/hop.sh [ROUNDS]
source "$(dirname "$0")/lib.sh"
ROUNDS=${1:-5}

build_pgcache
start_postgres
init_bench_db
start_pgbouncer
table_db hop
HOP_PORT=$(free_port); start_pgcache "$HOP_PORT" --no-cache --workers 1; HOP_PID=$PGCACHE_PID
ONE_PORT=$(free_port); start_pgcache "$ONE_PORT" --workers 1; ONE_PID=$PGCACHE_PID
DEF_PORT=$(free_port); start_pgcache "$DEF_PORT"; DEF_PID=$PGCACHE_PID
ROUTES=(direct:"$PGPORT":
    bouncer:"$BOUNCER_PORT":"$(cat "$RUNDIR/pgbouncer/pgbouncer.pid")"
    hop:"$HOP_PORT":"$HOP_PID" one-thread:"$ONE_PORT":"$ONE_PID" default:"$DEF_PORT":"$DEF_PID")
# Each pgcache streams the database before the first round.
for port in "$ONE_PORT" "$DEF_PORT"; do psql_at "$port" hop -c "SELECT 1" >/dev/null; done

# script ROUND: 2,000 texts no earlier round sent.
script() {
    python3 - "$RUNDIR/hop.sql" "$1" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    for i in range(1, 2001):
        f.write(f"SELECT v FROM t WHERE k = {i} AND v > -{sys.argv[2]};\n")
PY
}
now() { date +%s.%N; }
declare -A wall=() user=() sys=()
for round in $(seq "$ROUNDS"); do
    script "$round"
    for route in "${ROUTES[@]}"; do
        IFS=: read -r name port pid <<<"$route"
        [ -n "$pid" ] && read -r u0 s0 <<<"$(cpu_split "$pid")"
        start=$(now)
        psql_at "$port" hop -f "$RUNDIR/hop.sql" >/dev/null
        wall[$name]+=" $(python3 -c "print($(now) - $start)")"
        if [ -n "$pid" ]; then
            read -r u1 s1 <<<"$(cpu_split "$pid")"
            user[$name]+=" $(python3 -c "print(($u1 - $u0) * 1e6 / 2000)")"
            sys[$name]+=" $(python3 -c "print(($s1 - $s0) * 1e6 / 2000)")"
        fi
    done
done

direct=$(median ${wall[direct]})
printf '%-11s %9s %9s %12s %12s\n' route 'wall s' '÷ direct' 'user us/st' 'sys us/st'
for route in "${ROUTES[@]}"; do
    IFS=: read -r name _ pid <<<"$route"
    w=$(median ${wall[$name]})
    if [ -n "$pid" ]; then
        u=$(printf %.0f "$(median ${user[$name]})"); s=$(printf %.0f "$(median ${sys[$name]})")
    else
        u=-; s=-
    fi
    printf '%-11s %9.3f %9s %12s %12s\n' "$name" "$w" "$(ratio "$w" "$direct")" "$u" "$s"
done

[ "${STRACE:-0}" = 1 ] || exit 0
command -v strace >/dev/null || apt_install strace
script $((ROUNDS + 1))
echo "system calls per statement (strace -c -f, one run each):"
for route in "${ROUTES[@]:1}"; do
    IFS=: read -r name port pid <<<"$route"
    strace -f -c -p "$pid" -o "$RUNDIR/strace.$name" 2>/dev/null &
    tracer=$!
    sleep 1 # strace attaches to every thread
    psql_at "$port" hop -f "$RUNDIR/hop.sql" >/dev/null
    kill -INT "$tracer"; wait "$tracer" || true
    calls=$(awk '$NF ~ /^[a-z_0-9]+$/ && $4 ~ /^[0-9]+$/ && $NF != "total" && $4 >= 20 {printf "%s %.2f, ", $NF, $4 / 2000}' "$RUNDIR/strace.$name")
    printf '%-11s %s\n' "$name" "${calls%, }"
done
