#!/usr/bin/env bash
# What is *not* a hit, in one run: PostgreSQL directly vs pgcache (cache on)
# vs PgBouncer (session mode). Prints wall times or TPS and ratios to direct.
#   ddl        psql script: 200 x (CREATE TABLE ddl_i(a int); SELECT count(*) FROM t WHERE k < i)
#   migration  psql script: 200 x (CREATE TABLE mig_i(...); CREATE INDEX ...; ALTER TABLE ...)
#   distinct   psql script: 2,000 distinct SELECT v FROM t WHERE k = <i>, one session
#   select     pgbench -S, simple protocol, scale 10, 8 clients (mostly misses)
#   hot-key    pgbench, 1,000 hot keys, simple protocol, 8 clients (no regression on hits)
#   ddl-large  the ddl script on a database with 20,000 tables and 5,000
#              functions, divided by the same script on an empty database
#   bench/uncached.sh [SECONDS-PER-RUN]   (default 10; LARGE=0 skips ddl-large,
#   whose set-up takes a minute; ROUNDS=3 runs the three psql scripts in 3
#   interleaved rounds and prints each one's median, with pgcache's and
#   PgBouncer's CPU time per statement: user and system time over the
#   script, pgcache's less what it spends idle). pgcache runs
#   with its defaults but lets go of a database a second after its last
#   client, and each run starts once no stream is left: a walsender decodes
#   the whole cluster's WAL, and one left running slows every route.
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}

build_pgcache
start_postgres
init_bench_db
start_pgbouncer
BOUNCER_PID=$(cat "$RUNDIR/pgbouncer/pgbouncer.pid")
PGCACHE_PORT=$(free_port)
# Defaults, but a database no client uses is let go after a second rather
# than a minute: every stream's walsender decodes the whole cluster's WAL,
# and one left from an earlier run would slow the next (direct runs too).
printf '[replication]\nidle_release_secs = 1\n' >"$RUNDIR/uncached.toml"
start_pgcache "$PGCACHE_PORT" --config "$RUNDIR/uncached.toml"

# A database with t(k, v) of 10,000 rows; with $2 = big, also 20,000 tables
# and 5,000 functions, made in transactions of 1,000 (the lock table's size).
make_db() {
    table_db "$1"
    [ "${2:-}" = big ] || return 0
    python3 - "$RUNDIR/big.sql" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    for batch in range(20):
        f.write("BEGIN;\n")
        for i in range(batch * 1000, (batch + 1) * 1000):
            f.write(f"CREATE TABLE big_{i} (a int PRIMARY KEY, b text);\n")
        f.write("COMMIT;\n")
    f.write("BEGIN;\n")
    for i in range(5000):
        f.write(f"CREATE FUNCTION fn_{i}(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1 + {i}';\n")
    f.write("COMMIT;\n")
PY
    psql_at "$PGPORT" "$1" -f "$RUNDIR/big.sql" >/dev/null
}

ddl_scripts

# seconds PORT DB FILE: wall time of one psql run of FILE.
seconds() {
    local start end
    start=$(date +%s.%N)
    psql_at "$1" "$2" -f "$3" >/dev/null
    end=$(date +%s.%N)
    python3 -c "print(f'{$end - $start:.3f}')"
}

printf '%-22s %10s %10s %10s %10s %10s %10s %10s\n' workload direct pgcache pgbouncer cache/dir bouncer/dir 'cpu us/st' 'bouncer us'
row() { printf '%-22s %10s %10s %10s %10s %10s %10s %10s\n' "$1" "$2" "$3" "$4" "$(ratio "$3" "$2")" "$(ratio "$4" "$2")" "${5:-}" "${6:-}"; }

# CPU ticks (1/100 s, user + system) pgcache (or process $1) has used so far.
cpu_ticks() { awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/${1:-$PGCACHE_PID}/stat"; }
declare -A statements=([ddl]=400 [migration]=600 [distinct]=2000) wall=() cpu=() bouncer_cpu=()

# Round by round, each script directly, through pgcache, through PgBouncer.
n=0
for round in $(seq "${ROUNDS:-1}"); do
    for script in ddl migration distinct; do
        for port in "$PGPORT" "$PGCACHE_PORT" "$BOUNCER_PORT"; do
            n=$((n + 1))
            make_db "s$n"
            no_streams
            if [ "$port" != "$PGCACHE_PORT" ]; then
                before=$(cpu_ticks "$BOUNCER_PID")
                wall[$script,$port]+=" $(seconds "$port" "s$n" "$RUNDIR/$script.sql")"
                [ "$port" = "$BOUNCER_PORT" ] && bouncer_cpu[$script]+=" $(( $(cpu_ticks "$BOUNCER_PID") - before ))"
                psql_at "$PGPORT" postgres -c "DROP DATABASE s$n WITH (FORCE)" >/dev/null
                continue
            fi
            # The database's stream starts with its first client: steady
            # state is what is measured. What pgcache spends idle (the
            # heartbeats), over a second, is taken off the script's count;
            # the stream handles DDL after the script, so a second after it
            # counts too.
            psql_at "$port" "s$n" -c "SELECT 1" >/dev/null
            idle=$(cpu_ticks); sleep 1; idle=$(( $(cpu_ticks) - idle ))
            before=$(cpu_ticks)
            took=$(seconds "$port" "s$n" "$RUNDIR/$script.sql")
            sleep 1
            wall[$script,$port]+=" $took"
            cpu[$script]+=" $(python3 -c "print(max(0, $(cpu_ticks) - $before - $idle * ($took + 1)))")"
            # Dropped through pgcache, which lets go of its stream first;
            # the stream of "postgres" goes a second later.
            psql_at "$port" postgres -c "DROP DATABASE s$n" >/dev/null
        done
    done
done
per_statement() { python3 -c "print(round($1 * 10000 / $2))"; }
for script in ddl migration distinct; do
    row "$script (s)" "$(median ${wall[$script,$PGPORT]})" "$(median ${wall[$script,$PGCACHE_PORT]})" \
        "$(median ${wall[$script,$BOUNCER_PORT]})" \
        "$(per_statement "$(median ${cpu[$script]})" "${statements[$script]}")" \
        "$(per_statement "$(median ${bouncer_cpu[$script]})" "${statements[$script]}")"
done

for what in select hot-key; do
    if [ "$what" = select ]; then
        args=(-S -c 8 -j 2 -T "$DURATION")
    else
        printf '\\set aid random(1, 1000)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n' >"$RUNDIR/hot.sql"
        args=(-f "$RUNDIR/hot.sql" -c 8 -j 2 -T "$DURATION")
        tps "$PGCACHE_PORT" simple -f "$RUNDIR/hot.sql" -c 8 -j 2 -T 2 >/dev/null
    fi
    no_streams
    d=$(best2 tps "$PGPORT" simple "${args[@]}")
    c=$(best2 tps "$PGCACHE_PORT" simple "${args[@]}")
    no_streams
    b=$(best2 tps "$BOUNCER_PORT" simple "${args[@]}")
    row "$what (tps)" "$(printf %.0f "$d")" "$(printf %.0f "$c")" "$(printf %.0f "$b")"
    [ "$what" = select ] && select_vs_bouncer=$(ratio "$c" "$b")
done
echo "select: pgcache / pgbouncer = $select_vs_bouncer"

[ "${LARGE:-1}" = 0 ] && exit 0
make_db empty_db
make_db big_db big
for port in "$PGPORT" "$PGCACHE_PORT"; do
    psql_at "$port" empty_db -c "SELECT 1" >/dev/null
    psql_at "$port" big_db -c "SELECT 1" >/dev/null
done
empty=$(seconds "$PGCACHE_PORT" empty_db "$RUNDIR/ddl.sql")
big=$(seconds "$PGCACHE_PORT" big_db "$RUNDIR/ddl.sql")
psql_at "$PGPORT" empty_db -c "DROP TABLE $(python3 -c "print(','.join(f'ddl_{i}' for i in range(200)))")" >/dev/null
psql_at "$PGPORT" big_db -c "DROP TABLE $(python3 -c "print(','.join(f'ddl_{i}' for i in range(200)))")" >/dev/null
d_empty=$(seconds "$PGPORT" empty_db "$RUNDIR/ddl.sql")
d_big=$(seconds "$PGPORT" big_db "$RUNDIR/ddl.sql")
echo "ddl-large: pgcache ${big}s on 20,000 tables vs ${empty}s empty = $(ratio "$big" "$empty")x; directly ${d_big}s vs ${d_empty}s = $(ratio "$d_big" "$d_empty")x"
