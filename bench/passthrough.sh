#!/usr/bin/env bash
# Pass-through overhead, in one run: pgbench -S (select-only) in simple,
# extended and prepared mode, 8 clients, against PostgreSQL directly, through
# PgBouncer (session mode) and through `pgcache --no-cache`. Prints TPS and
# ratios (best of two runs each); fails if any transaction failed.
#   bench/passthrough.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}
CLIENTS=8

build_pgcache
start_postgres
init_bench_db
start_pgbouncer
PGCACHE_PORT=$(free_port)
start_pgcache "$PGCACHE_PORT" --no-cache

printf '%-9s %12s %12s %12s %10s %10s %12s\n' mode direct pgbouncer pgcache bouncer/dir cache/dir cache/bouncer
for mode in simple extended prepared; do
    d=$(best2 tps "$PGPORT" "$mode" -S -c "$CLIENTS" -j 2 -T "$DURATION")
    b=$(best2 tps "$BOUNCER_PORT" "$mode" -S -c "$CLIENTS" -j 2 -T "$DURATION")
    c=$(best2 tps "$PGCACHE_PORT" "$mode" -S -c "$CLIENTS" -j 2 -T "$DURATION")
    printf '%-9s %12.0f %12.0f %12.0f %10s %10s %12s\n' "$mode" "$d" "$b" "$c" \
        "$(ratio "$b" "$d")" "$(ratio "$c" "$d")" "$(ratio "$c" "$b")"
done
