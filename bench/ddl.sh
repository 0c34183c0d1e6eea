#!/usr/bin/env bash
# What DDL through pgcache costs, in CPU as well as time: 2,000 x
# (CREATE TABLE ddl_i(a int); SELECT count(*) FROM t WHERE k < i % 100)
# through pgcache with the DDL event trigger (the default) and without it
# (replication.ddl_event_trigger = false), ROUNDS interleaved rounds, each on
# a fresh database. Prints wall seconds and the CPU ticks (1/100 s) pgcache
# and every PostgreSQL process spent, from /proc; then, from
# pg_stat_statements, what pgcache's own statements (everything but the
# script's) cost PostgreSQL per DDL statement: how many, and their planning
# and execution time.
#   bench/ddl.sh [ROUNDS]   (default 2)
source "$(dirname "$0")/lib.sh"
ROUNDS=${1:-2}

build_pgcache
PG_CONF="shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track_planning = on
pg_stat_statements.track_utility = off" start_postgres
psql_at "$PGPORT" postgres -c "CREATE EXTENSION pg_stat_statements" >/dev/null
python3 - "$RUNDIR" <<'PY'
import sys
with open(f"{sys.argv[1]}/ddl.sql", "w") as f:
    for i in range(2000):
        f.write(f"CREATE TABLE ddl_{i}(a int);\nSELECT count(*) FROM t WHERE k < {i % 100};\n")
PY
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
postgres_ticks() {
    local sum=0 pid
    for pid in $(pgrep -f "postgres:"); do
        sum=$((sum + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
    done
    echo "$sum"
}
TRIGGER_PORT=$(free_port)
start_pgcache "$TRIGGER_PORT"
TRIGGER_PID=$PGCACHE_PID
printf '[replication]\nddl_event_trigger = false\n' >"$RUNDIR/no-trigger.toml"
PLAIN_PORT=$(free_port)
start_pgcache "$PLAIN_PORT" --config "$RUNDIR/no-trigger.toml"
PLAIN_PID=$PGCACHE_PID

printf '%-10s %-6s %8s %14s %15s\n' variant round wall_s pgcache_ticks postgres_ticks
for round in $(seq "$ROUNDS"); do
    for variant in trigger none; do
        db="ddl_${variant}_$round"
        if [ "$variant" = trigger ]; then port=$TRIGGER_PORT pid=$TRIGGER_PID; else port=$PLAIN_PORT pid=$PLAIN_PID; fi
        psql_at "$PGPORT" postgres -c "CREATE DATABASE $db" >/dev/null
        psql_at "$PGPORT" "$db" -c "CREATE TABLE t(k int PRIMARY KEY, v int);
            INSERT INTO t SELECT i, i FROM generate_series(1, 10000) i" >/dev/null
        # The stream starts with the first client; let it settle.
        psql_at "$port" "$db" -c "SELECT 1" >/dev/null
        sleep 1
        c0=$(ticks "$pid") g0=$(postgres_ticks) t0=$(date +%s.%N)
        psql_at "$port" "$db" -f "$RUNDIR/ddl.sql" >/dev/null
        t1=$(date +%s.%N)
        # What the stream does after the script (naming, the publication).
        sleep 1
        c1=$(ticks "$pid") g1=$(postgres_ticks)
        printf '%-10s %-6s %8.2f %14d %15d\n' "$variant" "$round" "$(python3 -c "print($t1 - $t0)")" $((c1 - c0)) $((g1 - g0))
    done
done

echo
echo "pgcache's own statements per DDL statement (pg_stat_statements, every round):"
psql_at "$PGPORT" postgres -c "
    SELECT CASE WHEN d.datname LIKE 'ddl_trigger%' THEN 'trigger' ELSE 'none' END AS variant,
           round(sum(s.calls) / (2000.0 * $ROUNDS), 2) AS statements,
           round((sum(s.total_plan_time) * 1000 / (2000 * $ROUNDS))::numeric, 1) AS plan_us,
           round((sum(s.total_exec_time) * 1000 / (2000 * $ROUNDS))::numeric, 1) AS exec_us
    FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
    WHERE d.datname LIKE 'ddl\\_%' AND s.toplevel
      AND s.query !~ '^(CREATE TABLE ddl_|SELECT count\\(\\*\\) FROM t WHERE)'
    GROUP BY 1 ORDER BY 1 DESC"
echo "the most costly of them:"
psql_at "$PGPORT" postgres -c "
    SELECT CASE WHEN d.datname LIKE 'ddl_trigger%' THEN 'trigger' ELSE 'none' END AS variant,
           round(sum(s.calls) / (2000.0 * $ROUNDS), 2) AS per_ddl,
           round((sum(s.total_plan_time + s.total_exec_time) * 1000 / (2000 * $ROUNDS))::numeric, 1) AS us_per_ddl,
           left(regexp_replace(s.query, '\s+', ' ', 'g'), 60) AS statement
    FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
    WHERE d.datname LIKE 'ddl\\_%' AND s.toplevel
      AND s.query !~ '^(CREATE TABLE ddl_|SELECT count\\(\\*\\) FROM t WHERE)'
    GROUP BY 1, 4 ORDER BY 3 DESC LIMIT 8"
