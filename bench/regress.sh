#!/usr/bin/env bash
# PostgreSQL's own regression suite (pg_regress), in one run: directly,
# through PgBouncer (session mode), through pgcache with caching on and
# through pgcache --no-cache, with caching on but replication off (to tell
# the stream's share) and in transaction pooling mode with caching on.
# Prints each run's wall time, its ratio to the direct run, and the tests
# that failed on a route but not directly.
#   REGRESS_SRC=.../src/test/regress bench/regress.sh [parallel|serial|both]
#   (ROUTES="cache no-cache" runs only those routes besides direct)
# REGRESS_SRC is src/test/regress of a PostgreSQL source tree of the
# server's major version, e.g. with deb-src in the apt sources:
#   apt-get source --download-only postgresql-15
#   tar xjf postgresql-15_*.orig.tar.bz2 --wildcards '*/src/test/regress' '*/contrib/spi'
# Diffs are kept in $KEEP (default /tmp/pgcache-regress) for reading.
source "$(dirname "$0")/lib.sh"
SCHEDULES=${1:-both}
SRC=${REGRESS_SRC:?set REGRESS_SRC to a PostgreSQL source tree\'s src/test/regress}
SRC=$(cd "$SRC" && pwd)
SPI="$SRC/../../../contrib/spi"
KEEP=${KEEP:-/tmp/pgcache-regress}
PG_REGRESS=$(pg_config --pgxs | sed 's#src/makefiles/pgxs.mk#src/test/regress/pg_regress#')

build_pgcache
start_postgres
# PgBouncer 1.18 refuses the startup parameter "options" that pg_regress's
# psql sends; ignoring it loses those settings, so its failures are its own.
BOUNCER_IGNORE=extra_float_digits,options start_pgbouncer
CACHE_PORT=$(free_port)
start_pgcache "$CACHE_PORT"
CACHE_PID=$PGCACHE_PID
PASS_PORT=$(free_port)
start_pgcache "$PASS_PORT" --no-cache
PASS_PID=$PGCACHE_PID
# Caching on without replication: what the stream's share of the cost is.
printf '[replication]\nenabled = false\n' >"$RUNDIR/norepl.toml"
NOREPL_PORT=$(free_port)
start_pgcache "$NOREPL_PORT" --config "$RUNDIR/norepl.toml"
NOREPL_PID=$PGCACHE_PID
# Transaction pooling with caching on: what pins, what moves between
# connections, and what is tracked per client must leave every test's
# answers as they are directly.
printf '[pool]\nmode = "transaction"\ndefault_pool_size = 20\n' >"$RUNDIR/transaction.toml"
TX_PORT=$(free_port)
start_pgcache "$TX_PORT" --config "$RUNDIR/transaction.toml"
TX_PID=$PGCACHE_PID
BOUNCER_PID=$(cat "$RUNDIR/pgbouncer/pgbouncer.pid")
POSTMASTER_PID=$(head -1 "$RUNDIR/pgdata/postmaster.pid")

# The C functions the suite loads (regress.so; autoinc.so and refint.so
# from contrib/spi), built against the server's headers.
LIB="$RUNDIR/lib"
mkdir -p "$LIB"
INC=$(pg_config --includedir-server)
[ -f "$INC/postgres.h" ] || apt_install "postgresql-server-dev-$("$PGBIN/postgres" --version | sed -E 's/.* ([0-9]+)\..*/\1/')"
gcc -O2 -fPIC -shared -I"$INC" "$SRC/regress.c" -o "$LIB/regress.so"
for m in autoinc refint; do
    gcc -O2 -fPIC -shared -I"$INC" "$SPI/$m.c" -o "$LIB/$m.so"
done
chown -R postgres: "$RUNDIR" 2>/dev/null || true
rm -rf "$KEEP" && mkdir -p "$KEEP" && chown postgres: "$KEEP" 2>/dev/null || true

# run NAME PORT SCHEDULE PROXY-PID: "wall proxy-cpu server-cpu" seconds
# (CPU: the proxy process's, and the backends' that exited during the run);
# failed tests in $KEEP/NAME.failed.
# "serial" is the parallel schedule one test at a time, as installcheck runs it.
run() {
    local name=$1 port=$2 schedule=$3 proxy=$4 out="$RUNDIR/out-$1" start end connections=20
    local proxy0 proxy1 server0 server1
    [ "$schedule" = serial ] && connections=1
    mkdir -p "$out" && chown postgres: "$out" 2>/dev/null || true
    start=$(date +%s.%N)
    proxy0=$(cpu_secs "$proxy" || echo 0)
    server0=$(CHILDREN=1 cpu_secs "$POSTMASTER_PID")
    (cd "$out" && as_pg "$PG_REGRESS" --host=127.0.0.1 --port="$port" --user=postgres \
        --dbname="regression_$name" --inputdir="$SRC" --outputdir="$out" --dlpath="$LIB" \
        --schedule="$SRC/parallel_schedule" --max-connections=$connections >"$out/log" 2>&1) || true
    end=$(date +%s.%N)
    proxy1=$(cpu_secs "$proxy" || echo 0)
    server1=$(CHILDREN=1 cpu_secs "$POSTMASTER_PID")
    # The next route starts from nothing the suite left (it leaves objects
    # owned by its roles, which would fail the next run's DROP ROLE).
    "$PGBIN/psql" -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -X -q -c "DROP DATABASE IF EXISTS \"regression_$name\" WITH (FORCE)" >/dev/null 2>&1 || true
    grep -E '\.\.\. +(FAILED|failed)' "$out/log" | sed -E 's/^ *(test +)?([^ ]+) .*/\2/' |
        sort >"$KEEP/$name.failed" || true
    [ -f "$out/regression.diffs" ] && cp "$out/regression.diffs" "$KEEP/$name.diffs"
    cp "$out/log" "$KEEP/$name.log"
    python3 -c "print(f'{$end - $start:.1f} {${proxy1:-0} - ${proxy0:-0}:.1f} {$server1 - $server0:.1f}')"
}

printf '%-10s %-12s %9s %9s %10s %10s %7s  %s\n' schedule route seconds ratio proxy-cpu server-cpu \
    failed 'failed here, not directly'
for schedule in parallel serial; do
    [ "$SCHEDULES" = both ] || [ "$SCHEDULES" = "$schedule" ] || continue
    direct=""
    for route in direct:"$PGPORT":0 pgbouncer:"$BOUNCER_PORT":"$BOUNCER_PID" cache:"$CACHE_PORT":"$CACHE_PID" \
        no-cache:"$PASS_PORT":"$PASS_PID" cache-norepl:"$NOREPL_PORT":"$NOREPL_PID" \
        transaction:"$TX_PORT":"$TX_PID"; do
        IFS=: read -r route port pid <<<"$route"
        name="${schedule}_$route"
        # ROUTES="direct cache" runs only those (direct always runs).
        case " direct ${ROUTES:-direct pgbouncer cache no-cache cache-norepl transaction} " in
            *" $route "*) ;;
            *) continue ;;
        esac
        read -r secs proxy_cpu server_cpu <<<"$(run "$name" "$port" "$schedule" "$pid")"
        [ -n "$direct" ] || direct=$secs
        extra=$(comm -13 "$KEEP/${schedule}_direct.failed" "$KEEP/$name.failed" | tr '\n' ' ')
        printf '%-10s %-12s %9s %9s %10s %10s %7s  %s\n' "$schedule" "$route" "$secs" "$(ratio "$secs" "$direct")" \
            "$proxy_cpu" "$server_cpu" "$(wc -l <"$KEEP/$name.failed")" "${extra:--}"
    done
done
