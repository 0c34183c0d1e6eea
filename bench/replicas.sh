#!/usr/bin/env bash
# Read replicas, in one run: a read workload that mostly misses (pgbench -S,
# uniform keys over pgbench_accounts at scale 10, a local tier of 1 MiB)
# through pgcache with the primary alone, then through pgcache with the
# primary and one standby (pg_basebackup -R, on this machine). One
# 2-core machine cannot show more throughput, so this prints what each
# server answered: the share of the reads pgcache routed, and the
# transactions per second of client traffic each server committed
# (pg_stat_database.xact_commit of the database, over the run); then the
# same with pool.mode = "transaction".
#   bench/replicas.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
SECONDS_PER_RUN=${1:-10}

build_pgcache
start_postgres
init_bench_db

# The standby: a base backup of the primary, streaming from it.
STANDBY_PORT=$(free_port)
as_pg "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$PGPORT" -U postgres -X stream -R -c fast -D "$RUNDIR/standby"
# A hot standby needs max_connections at least the primary's.
as_pg "$PGBIN/pg_ctl" -D "$RUNDIR/standby" -l "$RUNDIR/standby.log" -w start -o \
    "-p $STANDBY_PORT -k $RUNDIR/sock -c listen_addresses=127.0.0.1 -c hot_standby=on -c max_connections=${PG_MAX_CONNECTIONS:-300}" >/dev/null ||
    { cat "$RUNDIR/standby.log" >&2; exit 1; }
PIDS+=("$(head -1 "$RUNDIR/standby/postmaster.pid")")

printf '[cache.local]\nmax_bytes = 1048576\n' >"$RUNDIR/alone.toml"
cat >"$RUNDIR/replica.toml" <<TOML
[upstream]
replicas = ["postgres://postgres@127.0.0.1:$STANDBY_PORT"]
[cache.local]
max_bytes = 1048576
TOML
# The same in transaction mode: reads take connections of the standby's pool.
{ cat "$RUNDIR/replica.toml"; printf '[pool]\nmode = "transaction"\n'; } >"$RUNDIR/pooled.toml"

commits() { # PORT: xact_commit of the bench database on that server
    "$PGBIN/psql" -X -h 127.0.0.1 -p "$1" -U postgres -d postgres -Atc \
        "SELECT xact_commit FROM pg_stat_database WHERE datname = 'bench'"
}

metric() { # METRICS_PORT NAME-AND-LABELS: its value, 0 when absent
    curl -s "http://127.0.0.1:$1/metrics" | awk -v m="$2" 'index($0, m " ") == 1 {print $2; f=1} END {if (!f) print 0}'
}

# run LABEL CONFIG: pgbench -S through a pgcache of its own.
run() {
    local label=$1 config=$2 port p0 s0 p1 s1 tps
    port=$(free_port)
    start_pgcache "$port" --config "$config"
    # Warm up: the catalog, the stream, the replica's rotation.
    "$PGBIN/pgbench" -h 127.0.0.1 -p "$port" -U postgres -n -S -c 2 -T 2 bench >/dev/null 2>&1
    p0=$(commits "$PGPORT"); s0=$(commits "$STANDBY_PORT")
    tps=$("$PGBIN/pgbench" -h 127.0.0.1 -p "$port" -U postgres -n -S -c 8 -j 2 -T "$SECONDS_PER_RUN" bench 2>/dev/null |
        awk '/^tps/ {printf "%.0f", $3}')
    # Statistics reach pg_stat_database within a second of each commit.
    sleep 1.5
    p1=$(commits "$PGPORT"); s1=$(commits "$STANDBY_PORT")
    local standby routed_primary routed_standby
    standby="127.0.0.1:$STANDBY_PORT"
    routed_primary=$(metric "$METRICS_PORT" 'pgcache_reads_routed_total{server="primary"}')
    routed_standby=$(metric "$METRICS_PORT" "pgcache_reads_routed_total{server=\"$standby\"}")
    local misses
    misses=$(metric "$METRICS_PORT" 'pgcache_cache_lookups_total{result="miss"}')
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$label" "$tps" "$misses" \
        "$routed_standby" "$routed_primary" \
        "$(( (p1 - p0) / SECONDS_PER_RUN ))" "$(( (s1 - s0) / SECONDS_PER_RUN ))"
    kill "$PGCACHE_PID"; wait "$PGCACHE_PID" 2>/dev/null || true
}

echo "Read replicas: pgbench -S, 8 clients, ${SECONDS_PER_RUN}s per run, scale 10, local tier 1 MiB ($(date +%F))"
echo
echo "| route | client TPS | misses | reads routed to the standby | routed reads the primary took | primary xact/s | standby xact/s |"
echo "|---|---:|---:|---:|---:|---:|---:|"
run "primary alone" "$RUNDIR/alone.toml"
run "primary + standby" "$RUNDIR/replica.toml"
run "primary + standby, transaction mode" "$RUNDIR/pooled.toml"
