#!/usr/bin/env bash
# Transaction pooling, in one run: pgcache in transaction mode (cache off and
# on) against PgBouncer in transaction mode and PostgreSQL directly.
#   select-only   pgbench -S, 8 clients, simple / extended / prepared
#   connect       pgbench -C -S (a new connection per transaction), 8 clients
#   hot keys      500 clients, 100 keys, pool size 8: throughput and the peak
#                 number of server backends PostgreSQL saw during the run
# Ratios are to PgBouncer (the hot-key run: to direct). Each figure is the
# best of two interleaved runs, to damp the shared machine's noise. The
# Debian PgBouncer (1.18) has no prepared statements in transaction mode:
# its prepared row says n/a and pgcache's are to direct, unless $PGBOUNCER
# names a PgBouncer 1.21+ (max_prepared_statements = 200).
#   [PGBOUNCER=path/to/pgbouncer] bench/pool.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}
POOL=8
ulimit -n 65536 2>/dev/null || true

build_pgcache
PG_MAX_CONNECTIONS=600 start_postgres
init_bench_db

config() { # NAME TOML...
    printf '%s\n' "${@:2}" >"$RUNDIR/$1.toml"
    echo "$RUNDIR/$1.toml"
}
TX=$(config tx '[pool]' 'mode = "transaction"' "default_pool_size = $POOL" '[server]' 'max_client_connections = 2000')
OFF_PORT=$(free_port); start_pgcache "$OFF_PORT" --config "$TX" --no-cache
ON_PORT=$(free_port);  start_pgcache "$ON_PORT" --config "$TX"
BOUNCER_MODE=transaction BOUNCER_POOL_SIZE=$POOL BOUNCER_MAX_CLIENTS=2000 start_pgbouncer

hotkey_sql 100

# Server backends of the bench database, sampled during a run.
peak_backends() {
    local peak=0 n
    while [ -e "$RUNDIR/sampling" ]; do
        n=$(psql -X -At -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -c \
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'bench' AND backend_type = 'client backend'")
        [ "$n" -gt "$peak" ] && peak=$n
        sleep 0.2
    done
    echo "$peak" >"$RUNDIR/peak"
}

row() { # LABEL ROUTE TPS BASE
    printf '%-22s %-16s %10.0f %8s\n' "$1" "$2" "$3" "$(ratio "$3" "$4")"
}

printf '%-22s %-16s %10s %8s\n' workload route tps ratio
for mode in simple extended prepared; do
    direct=$(best2 tps "$PGPORT" "$mode" -S -c 8 -j 8 -T "$DURATION")
    off=$(best2 tps "$OFF_PORT" "$mode" -S -c 8 -j 8 -T "$DURATION")
    on=$(best2 tps "$ON_PORT" "$mode" -S -c 8 -j 8 -T "$DURATION")
    if [ "$mode" = prepared ] && [ "$BOUNCER_PREPARED" = 0 ]; then
        printf '%-22s %-16s %10.0f %8s\n' "select-only $mode" direct "$direct" ""
        printf '%-22s %-16s %10s %8s\n' "select-only $mode" pgbouncer n/a ""
        printf '%-22s %-16s %10.0f %8s\n' "select-only $mode" pgcache-off "$off" "$(ratio "$off" "$direct")x-direct"
        printf '%-22s %-16s %10.0f %8s\n' "select-only $mode" pgcache-on "$on" "$(ratio "$on" "$direct")x-direct"
        continue
    fi
    bouncer=$(best2 tps "$BOUNCER_PORT" "$mode" -S -c 8 -j 8 -T "$DURATION")
    row "select-only $mode" direct "$direct" "$bouncer"
    row "select-only $mode" pgbouncer "$bouncer" "$bouncer"
    row "select-only $mode" pgcache-off "$off" "$bouncer"
    row "select-only $mode" pgcache-on "$on" "$bouncer"
done

bouncer=$(best2 tps "$BOUNCER_PORT" simple -C -S -c 8 -j 8 -T "$DURATION")
for route in direct:$PGPORT pgbouncer:$BOUNCER_PORT pgcache-off:$OFF_PORT pgcache-on:$ON_PORT; do
    c=$(best2 tps "${route#*:}" simple -C -S -c 8 -j 8 -T "$DURATION")
    row "connect per tx (-C)" "${route%%:*}" "$c" "$bouncer"
done

hot() { tps "$1" simple -f "$RUNDIR/hotkey.sql" -c 500 -j 4 -T "$DURATION"; }
tps "$ON_PORT" simple -f "$RUNDIR/hotkey.sql" -c 8 -T 2 >/dev/null # fill the cache
printf '\n%-22s %-16s %10s %8s %9s\n' workload route tps x-direct backends
for route in direct:$PGPORT pgbouncer:$BOUNCER_PORT pgcache-off:$OFF_PORT pgcache-on:$ON_PORT; do
    touch "$RUNDIR/sampling"
    peak_backends &
    sampler=$!
    c=$(hot "${route#*:}")
    rm -f "$RUNDIR/sampling"
    wait "$sampler"
    [ "${route%%:*}" = direct ] && direct=$c
    printf '%-22s %-16s %10.0f %8s %9s\n' "500 clients hot keys" "${route%%:*}" "$c" "$(ratio "$c" "$direct")" "$(cat "$RUNDIR/peak")"
done
