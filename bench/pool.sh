#!/usr/bin/env bash
# Transaction pooling, in one run: pgcache in transaction mode (cache off and
# on) against PgBouncer in transaction mode and PostgreSQL directly.
#   select-only   pgbench -S, 8 clients, simple / extended / prepared
#   connect       pgbench -C -S (a new connection per transaction), 8 clients
#   hot keys      500 clients, 100 keys, pool size 8: throughput and the peak
#                 number of server backends PostgreSQL saw during the run
# Ratios are to PgBouncer (the hot-key run: to direct). Each figure is the
# best of two interleaved runs, to damp the shared machine's noise. Beside
# each proxy's throughput: its own user and system CPU time per
# transaction (the lower of the two runs), which the machine's noise moves
# less and which says where a proxy spends what it costs. The
# Debian PgBouncer (1.18) has no prepared statements in transaction mode:
# its prepared row says n/a and pgcache's are to direct, unless $PGBOUNCER
# names a PgBouncer 1.21+ (max_prepared_statements = 200).
# pgcache runs with one worker thread (--workers 1), as PgBouncer does, so
# that CPU per transaction compares like with like on shared cores.
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
OFF_PORT=$(free_port); start_pgcache "$OFF_PORT" --config "$TX" --no-cache --workers 1
OFF_PID=$PGCACHE_PID
ON_PORT=$(free_port);  start_pgcache "$ON_PORT" --config "$TX" --workers 1
ON_PID=$PGCACHE_PID
BOUNCER_MODE=transaction BOUNCER_POOL_SIZE=$POOL BOUNCER_MAX_CLIENTS=2000 start_pgbouncer
BOUNCER_PID=$(cat "$RUNDIR/pgbouncer/pgbouncer.pid")

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

# measured2 PID PORT MODE ARGS...: like best2 tps, and beside the best
# throughput the process's lowest user and system CPU microseconds per
# transaction (PID "-": none).
measured2() {
    local pid=$1 best=0 user=-1 sys=-1 u0 s0 u1 s1 t; shift
    for _ in 1 2; do
        [ "$pid" = - ] || read -r u0 s0 < <(cpu_split "$pid")
        t=$(tps "$@")
        if [ "$pid" = - ]; then
            best=$(python3 -c "print(max($best, $t))")
            continue
        fi
        read -r u1 s1 < <(cpu_split "$pid")
        read -r best user sys < <(python3 -c "
n = $t * $DURATION
u, s = ($u1 - $u0) / n * 1e6, ($s1 - $s0) / n * 1e6
print(max($best, $t), u if $user < 0 else min($user, u), s if $sys < 0 else min($sys, s))")
    done
    echo "$best $user $sys"
}

row() { # LABEL ROUTE "TPS USER SYS" BASE-TPS
    local tps user sys
    read -r tps user sys <<<"$3"
    if [ "$user" = -1 ]; then
        printf '%-22s %-16s %10.0f %8s %8s %8s\n' "$1" "$2" "$tps" "$(ratio "$tps" "$4")" - -
    else
        printf '%-22s %-16s %10.0f %8s %8.1f %8.1f\n' "$1" "$2" "$tps" "$(ratio "$tps" "$4")" "$user" "$sys"
    fi
}

printf '%-22s %-16s %10s %8s %8s %8s\n' workload route tps ratio 'user/tx' 'sys/tx'
for mode in simple extended prepared; do
    args=("$mode" -S -c 8 -j 8 -T "$DURATION")
    direct=$(measured2 - "$PGPORT" "${args[@]}")
    off=$(measured2 "$OFF_PID" "$OFF_PORT" "${args[@]}")
    on=$(measured2 "$ON_PID" "$ON_PORT" "${args[@]}")
    if [ "$mode" = prepared ] && [ "$BOUNCER_PREPARED" = 0 ]; then
        base=${direct%% *}
        row "select-only $mode" direct "$direct" "$base"
        printf '%-22s %-16s %10s %8s\n' "select-only $mode" pgbouncer n/a ""
        row "select-only $mode" pgcache-off "$off" "$base" | sed 's/$/  (ratio: x direct)/'
        row "select-only $mode" pgcache-on "$on" "$base" | sed 's/$/  (ratio: x direct)/'
        continue
    fi
    bouncer=$(measured2 "$BOUNCER_PID" "$BOUNCER_PORT" "${args[@]}")
    base=${bouncer%% *}
    row "select-only $mode" direct "$direct" "$base"
    row "select-only $mode" pgbouncer "$bouncer" "$base"
    row "select-only $mode" pgcache-off "$off" "$base"
    row "select-only $mode" pgcache-on "$on" "$base"
done

bouncer=$(best2 tps "$BOUNCER_PORT" simple -C -S -c 8 -j 8 -T "$DURATION")
for route in direct:-:$PGPORT pgbouncer:$BOUNCER_PID:$BOUNCER_PORT pgcache-off:$OFF_PID:$OFF_PORT pgcache-on:$ON_PID:$ON_PORT; do
    IFS=: read -r name pid port <<<"$route"
    c=$(measured2 "$pid" "$port" simple -C -S -c 8 -j 8 -T "$DURATION")
    row "connect per tx (-C)" "$name" "$c" "$bouncer"
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
