#!/usr/bin/env bash
# See pgcache work in one command, on a fresh machine: installs what is
# missing (PostgreSQL, Redis), starts a throwaway PostgreSQL
# (wal_level=logical) and Redis on free ports, starts pgcache in front of
# them, loads pgbench's tables, runs a short read-mostly workload through
# pgcache and prints the hit ratio and where to look. It stays up until
# Ctrl-C, then removes everything it started.
#
#   scripts/quickstart.sh                 stay up until Ctrl-C
#   scripts/quickstart.sh --duration N    run the workload N seconds, then exit
#   scripts/quickstart.sh --debug         use the debug build (faster to build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/lib/install.sh

DURATION=""
PROFILE=release
while [ $# -gt 0 ]; do
    case "$1" in
        --duration) DURATION=${2:?--duration needs a number of seconds}; shift 2 ;;
        --debug) PROFILE=debug; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
WORKLOAD_SECS=${DURATION:-15}

need_postgres
need_redis
install_needed
PGBIN=$(pg_bindir)

RUNDIR=$(mktemp -d /tmp/pgcache-quickstart.XXXXXX)
chmod 755 "$RUNDIR"
PIDS=()
as_pg() {
    # PostgreSQL refuses to run as root.
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
cleanup() {
    for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -f "$RUNDIR/pgdata/postmaster.pid" ] && as_pg "$PGBIN/pg_ctl" -D "$RUNDIR/pgdata" -m fast stop >/dev/null 2>&1 || true
    rm -rf "$RUNDIR"
}
trap cleanup EXIT
trap 'echo; echo "stopping"; exit 0' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
http_get() {
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

# Cargo shows its progress: a first release build takes about ten
# minutes on two cores.
echo "building pgcache ($PROFILE; a first release build takes several minutes)..."
if [ "$PROFILE" = release ]; then
    cargo build --release --locked
else
    cargo build --locked
fi
# Where cargo put it: CARGO_TARGET_DIR or a cargo config may move target/.
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps --locked |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
PGCACHE_BIN="$TARGET_DIR/$PROFILE/pgcache"
if [ ! -x "$PGCACHE_BIN" ]; then
    echo "cargo built pgcache, but there is no $PGCACHE_BIN" >&2
    exit 1
fi

PGPORT=$(free_port)
[ "$(id -u)" -eq 0 ] && chown postgres: "$RUNDIR"
as_pg "$PGBIN/initdb" -D "$RUNDIR/pgdata" -U postgres --auth=trust -E UTF8 --locale=C --no-sync >/dev/null
as_pg "$PGBIN/pg_ctl" -D "$RUNDIR/pgdata" -l "$RUNDIR/postgres.log" -w start \
    -o "-p $PGPORT -k $RUNDIR -c listen_addresses=127.0.0.1 -c wal_level=logical" >/dev/null

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$RUNDIR/redis.log" 2>&1 &
PIDS+=($!)

PORT=$(free_port)
METRICS_PORT=$(free_port)
RUST_LOG=${RUST_LOG:-info} "$PGCACHE_BIN" --config config/pgcache.toml \
    --listen "127.0.0.1:$PORT" --upstream "postgres://postgres@127.0.0.1:$PGPORT" \
    --redis "redis://127.0.0.1:$REDIS_PORT" --disk "$RUNDIR/disk" \
    --metrics "127.0.0.1:$METRICS_PORT" >"$RUNDIR/pgcache.log" 2>&1 &
PGCACHE_PID=$!
PIDS+=($PGCACHE_PID)
# Up when it answers; a pgcache that exited is reported at once.
for _ in $(seq 600); do
    if ! kill -0 "$PGCACHE_PID" 2>/dev/null; then
        echo "pgcache did not start:" >&2
        cat "$RUNDIR/pgcache.log" >&2
        exit 1
    fi
    "$PGBIN/psql" -X -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c 'SELECT 1' >/dev/null 2>&1 && break
    sleep 0.1
done
if ! "$PGBIN/psql" -X -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c 'SELECT 1' >/dev/null 2>&1; then
    echo "pgcache did not answer within 60 s:" >&2
    cat "$RUNDIR/pgcache.log" >&2
    exit 1
fi

echo "loading pgbench's tables..."
"$PGBIN/pgbench" -h 127.0.0.1 -p "$PGPORT" -U postgres -i -s 1 -q postgres >/dev/null 2>&1
# Read-mostly: most transactions read one of 2,000 accounts (some much more
# than others); a few record a teller's activity. Invalidation is per table:
# those writes leave the accounts' cached reads standing, where writes to
# pgbench_accounts would end every cached read of it.
cat >"$RUNDIR/read.sql" <<'SQL'
\set aid random_zipfian(1, 2000, 1.1)
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
SQL
cat >"$RUNDIR/write.sql" <<'SQL'
\set tid random(1, 10)
\set delta random(-5000, 5000)
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, 1, 1, :delta, CURRENT_TIMESTAMP);
SQL
# The same workload through pgcache, then straight to PostgreSQL.
workload() {
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$1" -U postgres -n -M prepared -c 4 -j 2 -T "$WORKLOAD_SECS" \
        -f "$RUNDIR/read.sql@95" -f "$RUNDIR/write.sql@5" postgres >"$2" 2>&1 || {
        cat "$2" >&2
        exit 1
    }
    awk '/^tps = / { print $3 }' "$2"
}
echo "running a read-mostly workload through pgcache for ${WORKLOAD_SECS}s..."
THROUGH=$(workload "$PORT" "$RUNDIR/pgbench.log")
echo "running it straight against PostgreSQL for ${WORKLOAD_SECS}s..."
DIRECT=$(workload "$PGPORT" "$RUNDIR/pgbench-direct.log")

METRICS=$(http_get "http://127.0.0.1:$METRICS_PORT/metrics")
lookups() {
    echo "$METRICS" | awk -v r="$1" '$1 == "pgcache_cache_lookups_total{result=\"" r "\"}" { print $2 }'
}
HITS=$(lookups hit); MISSES=$(lookups miss); BYPASSES=$(lookups bypass)
tier() {
    echo "$METRICS" | awk -v t="$1" '$1 == "pgcache_cache_hits_total{tier=\"" t "\"}" { print $2 }'
}
echo
echo "pgcache answered ${HITS:-0} reads from its cache, sent ${MISSES:-0} misses and ${BYPASSES:-0} other statements to PostgreSQL"
echo "hits by tier: $(tier local) from memory, $(tier disk) from disk, $(tier shared) from Redis"
python3 -c 'import sys; h, m = float(sys.argv[1]), float(sys.argv[2]); print("hit ratio of cacheable reads: %.1f%%" % (100 * h / max(h + m, 1)))' "${HITS:-0}" "${MISSES:-0}"
python3 -c 'import sys; t, d = float(sys.argv[1]), float(sys.argv[2]); print("transactions a second: %.0f through pgcache, %.0f straight to PostgreSQL: %.2fx" % (t, d, t / max(d, 1)))' "${THROUGH:-0}" "${DIRECT:-0}"
if [ "$PROFILE" = debug ]; then
    echo "(a debug build of pgcache, unoptimised: run without --debug for its real speed)"
fi
echo
echo "connect through pgcache:  psql -h 127.0.0.1 -p $PORT -U postgres postgres"
echo "live page:                http://127.0.0.1:$METRICS_PORT/"
echo "metrics:                  http://127.0.0.1:$METRICS_PORT/metrics"
if [ -z "$DURATION" ]; then
    # With --duration everything is removed on exit, the log too.
    echo "pgcache's log:            $RUNDIR/pgcache.log"
fi

if [ "${HITS:-0}" = 0 ]; then
    echo "no read was answered from the cache: something is wrong (see the log above)" >&2
    cat "$RUNDIR/pgcache.log" >&2
    exit 1
fi
if [ -n "$DURATION" ]; then
    exit 0
fi
echo
echo "pgcache stays up until Ctrl-C; everything this script started is then removed."
wait "$PGCACHE_PID"
