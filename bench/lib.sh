# Shared helpers for the side-by-side benchmarks. Source it; it starts a
# throwaway PostgreSQL (and whatever else a bench asks for) under $RUNDIR and
# stops everything on exit. Never touches services the machine already runs.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# On tmpfs by default: on ext4, CREATE TABLE's file creation slows as a run
# creates and drops databases (inode allocation scans recently deleted
# inodes), which moved DDL timings by tens of percent from run to run.
# BENCH_TMP=/tmp measures on disk.
BENCH_TMP=${BENCH_TMP:-$( [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo /tmp )}
RUNDIR=$(mktemp -d "$BENCH_TMP/pgcache-bench.XXXXXX")
chmod 755 "$RUNDIR"
PIDS=()
PGBIN=$(pg_config --bindir 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null
}

# Run as the postgres OS user when root (PostgreSQL, PgBouncer and Pgpool-II refuse root).
as_pg() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

cleanup() {
    for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
    for pidfile in "$RUNDIR"/*/*.pid; do [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true; done
    [ -f "$RUNDIR/pgdata/postmaster.pid" ] && as_pg "$PGBIN/pg_ctl" -D "$RUNDIR/pgdata" -m fast stop >/dev/null 2>&1 || true
    wait 2>/dev/null || true
    rm -rf "$RUNDIR"
}
trap cleanup EXIT

apt_install() {
    local sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}

start_postgres() {
    PGPORT=$(free_port)
    mkdir -p "$RUNDIR/sock"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$RUNDIR" "$RUNDIR/sock"
    as_pg "$PGBIN/initdb" -D "$RUNDIR/pgdata" -U postgres --auth=trust -E UTF8 --locale=C --no-sync >/dev/null
    # PG_CONF: more postgresql.conf lines (a library to preload, say).
    [ -z "${PG_CONF:-}" ] || printf '%s\n' "$PG_CONF" >>"$RUNDIR/pgdata/postgresql.conf"
    as_pg "$PGBIN/pg_ctl" -D "$RUNDIR/pgdata" -l "$RUNDIR/pg.log" -w start -o \
        "-p $PGPORT -k $RUNDIR/sock -c listen_addresses=127.0.0.1 -c wal_level=logical -c max_connections=${PG_MAX_CONNECTIONS:-300} -c shared_buffers=256MB -c fsync=off" >/dev/null
    export PGHOST=127.0.0.1 PGUSER=postgres
}

# init_bench_db: the database "bench" with pgbench's tables at scale 10.
init_bench_db() {
    "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres bench
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$PGPORT" -U postgres -i -s 10 -q bench >/dev/null 2>&1
}

# hotkey_sql KEYS: $RUNDIR/hotkey.sql, a pgbench script reading one of the
# first KEYS accounts by primary key.
hotkey_sql() {
    printf '\\set aid random(1, %d)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n' "$1" \
        >"$RUNDIR/hotkey.sql"
}

# build_pgcache: the release binary of this checkout, unless PGCACHE_BIN
# names one already (another commit's, to compare in one run).
build_pgcache() {
    if [ -n "${PGCACHE_BIN:-}" ]; then
        [ -x "$PGCACHE_BIN" ] || { echo "PGCACHE_BIN=$PGCACHE_BIN is not an executable" >&2; exit 1; }
        return
    fi
    (cd "$ROOT" && cargo build --release --locked -q)
    PGCACHE_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/pgcache"
}

psql_at() { # PORT DB [psql args...]: psql as postgres, stopping at the first error
    local port=$1 db=$2; shift 2
    "$PGBIN/psql" -h 127.0.0.1 -p "$port" -U postgres -d "$db" -X -q -v ON_ERROR_STOP=1 "$@"
}

# start_pgcache PORT [flags...]; its metrics port is left in $METRICS_PORT.
# $UPSTREAM_URL replaces the default upstream URL.
start_pgcache() {
    local port=$1; shift
    METRICS_PORT=$(free_port)
    RUST_LOG=warn "$PGCACHE_BIN" --listen "127.0.0.1:$port" --upstream "${UPSTREAM_URL:-postgres://postgres@127.0.0.1:$PGPORT}" \
        --metrics "127.0.0.1:$METRICS_PORT" "$@" >"$RUNDIR/pgcache-$port.log" 2>&1 &
    PIDS+=($!)
    PGCACHE_PID=$!
    wait_port "$port"
}

# $PGBOUNCER names another PgBouncer binary (Debian's is 1.18; prepared
# statements in transaction mode need 1.21+). BOUNCER_PREPARED is left 1
# when the one started has them.
start_pgbouncer() {
    local bin=${PGBOUNCER:-pgbouncer} version
    [ -n "${PGBOUNCER:-}" ] || command -v pgbouncer >/dev/null || apt_install pgbouncer
    BOUNCER_PORT=$(free_port)
    mkdir -p "$RUNDIR/pgbouncer"
    sed -e "s#@RUNDIR@#$RUNDIR#g" -e "s/55432/$PGPORT/" -e "s/56432/$BOUNCER_PORT/" -e "s/^bench = .*/* = host=127.0.0.1 port=$PGPORT/" \
        -e "s/^ignore_startup_parameters = .*/ignore_startup_parameters = ${BOUNCER_IGNORE:-extra_float_digits}/" \
        -e "s/^pool_mode = .*/pool_mode = ${BOUNCER_MODE:-session}/" \
        -e "s/^max_client_conn = .*/max_client_conn = ${BOUNCER_MAX_CLIENTS:-200}/" \
        -e "s/^default_pool_size = .*/default_pool_size = ${BOUNCER_POOL_SIZE:-32}/" \
        "$ROOT/../shared/anchors/pgbouncer-session.ini" >"$RUNDIR/pgbouncer.ini" 2>/dev/null || cat >"$RUNDIR/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$PGPORT
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BOUNCER_PORT
unix_socket_dir = $RUNDIR/sock
logfile = $RUNDIR/pgbouncer/pgbouncer.log
pidfile = $RUNDIR/pgbouncer/pgbouncer.pid
auth_type = trust
auth_file = $RUNDIR/userlist.txt
pool_mode = ${BOUNCER_MODE:-session}
max_client_conn = ${BOUNCER_MAX_CLIENTS:-200}
default_pool_size = ${BOUNCER_POOL_SIZE:-32}
server_reset_query = DISCARD ALL
ignore_startup_parameters = ${BOUNCER_IGNORE:-extra_float_digits}
INI
    version=$("$bin" --version | sed -n 's/^PgBouncer \([0-9]*\.[0-9]*\).*/\1/p')
    BOUNCER_PREPARED=0
    if [ "$(printf '%s\n' 1.21 "$version" | sort -V | head -1)" = 1.21 ]; then
        echo 'max_prepared_statements = 200' >>"$RUNDIR/pgbouncer.ini"
        BOUNCER_PREPARED=1
    fi
    echo '"postgres" ""' >"$RUNDIR/userlist.txt"
    [ "$(id -u)" -eq 0 ] && chown -R postgres: "$RUNDIR/pgbouncer" "$RUNDIR/userlist.txt" "$RUNDIR/pgbouncer.ini"
    as_pg "$bin" -d "$RUNDIR/pgbouncer.ini" >"$RUNDIR/pgbouncer/stdout.log" 2>&1
    wait_port "$BOUNCER_PORT"
}

wait_port() {
    for _ in $(seq 1 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "nothing listening on port $1" >&2
    return 1
}

# tps PORT MODE SCRIPT-ARGS... : prints TPS; fails if any transaction failed.
# As $BENCH_USER (default postgres).
tps() {
    local port=$1 mode=$2; shift 2
    local out
    out=$("$PGBIN/pgbench" -h 127.0.0.1 -p "$port" -U "${BENCH_USER:-postgres}" -n -M "$mode" "$@" bench 2>&1) || { echo "$out" >&2; return 1; }
    if ! grep -q "number of failed transactions: 0 " <<<"$out"; then
        echo "$out" >&2
        echo "failed transactions on port $port" >&2
        return 1
    fi
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out"
}

# best2 CMD...: runs a measurement twice, prints the larger result. Used for
# every contender alike, interleaved, to damp the shared machine's noise.
best2() {
    local a b
    a=$("$@"); b=$("$@")
    python3 -c "print(max(float('$a'), float('$b')))"
}

ratio() { python3 -c "print(f'{float($1)/float($2):.2f}')"; }

# median NUMBERS...: their median, to three decimals.
median() { python3 -c "import statistics, sys; print(f'{statistics.median(map(float, sys.argv[1:])):.3f}')" "$@"; }

# Pgpool-II with its in-memory query cache, from the anchor config.
start_pgpool() {
    command -v pgpool >/dev/null || apt_install pgpool2
    PGPOOL_PORT=$(free_port)
    local pcp_port; pcp_port=$(free_port)
    mkdir -p "$RUNDIR/pgpool/oiddir"
    sed -e "s#@RUNDIR@#$RUNDIR#g" -e "s/55432/$PGPORT/" -e "s/^port = 59999/port = $PGPOOL_PORT/" \
        -e "s/^pcp_port = 59898/pcp_port = $pcp_port/" \
        "$ROOT/../shared/anchors/pgpool-cache.conf" >"$RUNDIR/pgpool.conf"
    cp "$ROOT/../shared/anchors/pool_hba.conf" "$RUNDIR/pool_hba.conf"
    : >"$RUNDIR/pcp.conf"
    [ "$(id -u)" -eq 0 ] && chown -R postgres: "$RUNDIR/pgpool" "$RUNDIR/pgpool.conf" "$RUNDIR/pool_hba.conf" "$RUNDIR/pcp.conf"
    as_pg pgpool -n -f "$RUNDIR/pgpool.conf" -a "$RUNDIR/pool_hba.conf" -F "$RUNDIR/pcp.conf" >"$RUNDIR/pgpool/stdout.log" 2>&1 &
    PIDS+=($!)
    wait_port "$PGPOOL_PORT"
}

# CPU seconds a process has used (user + system), and with CHILDREN set,
# what its reaped children used (the postmaster's: the exited backends').
cpu_secs() {
    awk -v tck="$(getconf CLK_TCK)" -v kids="${CHILDREN:-}" '{
        sub(/^.*\) /, ""); # fields from state on: utime is $12, cutime $14
        printf "%.2f", (kids ? $14 + $15 : $12 + $13) / tck }' "/proc/$1/stat" 2>/dev/null
}

# cpu_split PID: a process's user and system CPU seconds so far.
cpu_split() {
    awk -v tck="$(getconf CLK_TCK)" '{sub(/^.*\) /, ""); printf "%.2f %.2f\n", $12 / tck, $13 / tck}' "/proc/$1/stat"
}

# sched_ns PID: nanoseconds a process's threads have run so far, and have
# waited runnable for a CPU (/proc/PID/task/*/schedstat). Run and wait
# together near a run's whole length: the process never had nothing to do,
# so it set the pace.
sched_ns() {
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{r += $1; w += $2} END {printf "%d %d\n", r, w}'
}

# CPU seconds the whole machine has spent busy so far (user, nice, system,
# irq and softirq: not idle, iowait, or steal by other guests).
machine_busy_secs() {
    awk -v tck="$(getconf CLK_TCK)" '/^cpu / {printf "%.2f", ($2 + $3 + $4 + $7 + $8) / tck}' /proc/stat
}

# Peak resident memory of a process, in MiB.
peak_rss_mib() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status" 2>/dev/null; }

# no_streams: waits until no walsender runs (pgcache has let go of every
# database); a walsender left running decodes every later run's WAL.
no_streams() {
    for _ in $(seq 100); do
        [ "$(psql_at "$PGPORT" postgres -Atc "SELECT count(*) FROM pg_stat_replication")" = 0 ] && return
        sleep 0.1
    done
    echo "pgcache's streams are still up after 10 s" >&2
    exit 1
}

# table_db NAME: a database with t(k, v) of 10,000 rows.
table_db() {
    psql_at "$PGPORT" postgres -c "CREATE DATABASE $1" >/dev/null
    psql_at "$PGPORT" "$1" -c "CREATE TABLE t(k int PRIMARY KEY, v int);
        INSERT INTO t SELECT i, i FROM generate_series(1, 10000) i;" >/dev/null
}

# ddl_scripts: the psql scripts of what is not a hit, in $RUNDIR:
#   ddl.sql        200 x (CREATE TABLE ddl_i(a int); SELECT count(*) FROM t WHERE k < i)
#   migration.sql  200 x (CREATE TABLE mig_i(...); CREATE INDEX ...; ALTER TABLE ...)
#   distinct.sql   2,000 distinct SELECT v FROM t WHERE k = <i>
ddl_scripts() {
    python3 - "$RUNDIR" <<'PY'
import sys
d = sys.argv[1]
with open(f"{d}/ddl.sql", "w") as f:
    for i in range(200):
        f.write(f"CREATE TABLE ddl_{i}(a int);\nSELECT count(*) FROM t WHERE k < {i};\n")
with open(f"{d}/migration.sql", "w") as f:
    for i in range(200):
        f.write(f"CREATE TABLE mig_{i}(a int PRIMARY KEY, b text);\n"
                f"CREATE INDEX ON mig_{i}(b);\n"
                f"ALTER TABLE mig_{i} ADD COLUMN c int DEFAULT 0;\n")
with open(f"{d}/distinct.sql", "w") as f:
    for i in range(1, 2001):
        f.write(f"SELECT v FROM t WHERE k = {i};\n")
PY
}
