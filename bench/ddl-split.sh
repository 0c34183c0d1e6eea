#!/usr/bin/env bash
# Where DDL's extra time goes: the DDL and migration psql scripts of
# uncached.sh, ROUNDS interleaved rounds (default 3) on fresh databases,
# through each route, each adding one thing to the one before:
#   direct      PostgreSQL
#   trigger     PostgreSQL, in a database holding pgcache's DDL event
#               trigger (the default pgcache installs it, then lets go):
#               what the trigger alone costs, outside the chain
#   bouncer     PgBouncer (session mode)
#   hop         pgcache --no-cache: the relay alone
#   analysis    caching on, replication off: statements analysed and
#               planned, DDL's own invalidation (replication.enabled = false)
#   stream      replication on, no DDL event trigger: a walsender decoding
#               the WAL (replication.ddl_event_trigger = false)
#   default     the defaults: the event trigger (DDL sent through pgcache
#               takes no round after it there)
# Prints each route's median wall time and its ratio to direct.
#   bench/ddl-split.sh [ROUNDS]
source "$(dirname "$0")/lib.sh"
ROUNDS=${1:-3}

build_pgcache
start_postgres
start_pgbouncer
# Every pgcache lets go of a database a second after its last client, and
# each run starts once no stream is left (see uncached.sh).
declare -A PORT
PORT[direct]=$PGPORT
PORT[trigger]=$PGPORT
PORT[bouncer]=$BOUNCER_PORT
for route in hop analysis stream default; do
    conf="$RUNDIR/$route.toml"
    printf '[replication]\nidle_release_secs = 1\n' >"$conf"
    case $route in
        analysis) printf 'enabled = false\nrequired = false\n' >>"$conf" ;;
        stream) printf 'ddl_event_trigger = false\n' >>"$conf" ;;
    esac
    PORT[$route]=$(free_port)
    if [ "$route" = hop ]; then
        start_pgcache "${PORT[$route]}" --config "$conf" --no-cache
    else
        start_pgcache "${PORT[$route]}" --config "$conf"
    fi
done
ROUTES="direct trigger bouncer hop analysis stream default"

ddl_scripts

declare -A wall
n=0
for round in $(seq "$ROUNDS"); do
    for script in ddl migration; do
        for route in $ROUTES; do
            n=$((n + 1))
            table_db "s$n"
            no_streams
            if [ "$route" = trigger ]; then
                psql_at "${PORT[default]}" "s$n" -c "SELECT 1" >/dev/null
                for _ in $(seq 100); do
                    [ "$(psql_at "$PGPORT" "s$n" -Atc "SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE 'pgcache%'")" = 2 ] && break
                    sleep 0.1
                done
                no_streams
            fi
            # A first statement starts the database's stream, where there is one.
            psql_at "${PORT[$route]}" "s$n" -c "SELECT 1" >/dev/null
            start=$(date +%s.%N)
            psql_at "${PORT[$route]}" "s$n" -f "$RUNDIR/$script.sql" >/dev/null
            end=$(date +%s.%N)
            wall[$script,$route]+=" $(python3 -c "print(f'{$end - $start:.3f}')")"
            # Dropped directly once pgcache has let go of it.
            no_streams
            psql_at "$PGPORT" postgres -c "DROP DATABASE s$n WITH (FORCE)" >/dev/null
        done
    done
done

printf '%-10s' route; for script in ddl migration; do printf ' %12s %8s' "$script (s)" ratio; done; echo
for route in $ROUTES; do
    printf '%-10s' "$route"
    for script in ddl migration; do
        m=$(median ${wall[$script,$route]})
        printf ' %12s %8s' "$m" "$(ratio "$m" "$(median ${wall[$script,direct]})")"
    done
    echo
done
