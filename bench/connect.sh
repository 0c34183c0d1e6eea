#!/usr/bin/env bash
# The cost of logging in, in one run: pgbench -C (a new connection for every
# transaction) -S, 4 clients, directly and through pgcache, for a trust user
# and for a SCRAM-SHA-256 user, with each of pgcache's ways to log in:
#   passthrough   PostgreSQL authenticates the client through pgcache;
#   term/password auth.mode = terminate, the password in auth.users;
#   term/query    auth.mode = terminate, the verifier from auth_query
#                 (pgcache logs in with the key the client's proof yields).
#   sslmode=disable  passthrough without asking PostgreSQL for TLS first;
#   reuse         passthrough with server connections reused (opt-in:
#                 pool.max_idle_servers = 16; by default every client gets a
#                 new backend, as directly, and so do the routes above);
#   pgbouncer     PgBouncer in session mode (trust user only).
# Prints TPS and each one's ratio to the direct run of the same user.
#   bench/connect.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}
CLIENTS=4
PASSWORD=bench-scram-secret

build_pgcache
start_postgres
init_bench_db
psql -X -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d bench -c \
    "SET password_encryption = 'scram-sha-256'; CREATE ROLE scram LOGIN PASSWORD '$PASSWORD';
     GRANT SELECT ON ALL TABLES IN SCHEMA public TO scram;"
sed -i "1i host all scram 127.0.0.1/32 scram-sha-256" "$RUNDIR/pgdata/pg_hba.conf"
psql -X -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d bench -c "SELECT pg_reload_conf()" >/dev/null

PASS_PORT=$(free_port)
start_pgcache "$PASS_PORT"
# The default sslmode (prefer) asks PostgreSQL for TLS on every backend
# connection; this server says no, which costs one round trip.
PLAIN_PORT=$(free_port)
UPSTREAM_URL="postgres://postgres@127.0.0.1:$PGPORT?sslmode=disable" start_pgcache "$PLAIN_PORT"
REUSE_PORT=$(free_port)
printf '[pool]\nmax_idle_servers = 16\n' >"$RUNDIR/reuse.toml"
start_pgcache "$REUSE_PORT" --config "$RUNDIR/reuse.toml"
start_pgbouncer
TERM_PORT=$(free_port)
cat >"$RUNDIR/terminate.toml" <<TOML
[auth]
mode = "terminate"
[auth.users]
scram = "$PASSWORD"
postgres = "unused"
TOML
start_pgcache "$TERM_PORT" --config "$RUNDIR/terminate.toml"
QUERY_PORT=$(free_port)
cat >"$RUNDIR/query.toml" <<TOML
[auth]
mode = "terminate"
auth_query = "SELECT rolpassword FROM pg_catalog.pg_authid WHERE rolname = \$1"
TOML
start_pgcache "$QUERY_PORT" --config "$RUNDIR/query.toml"

run() { BENCH_USER=$1 PGPASSWORD=$PASSWORD best2 tps "$2" simple -C -S -c "$CLIENTS" -j 2 -T "$DURATION"; }

printf '%-8s %-14s %10s %8s\n' user route tps ratio
direct=$(run postgres "$PGPORT")
printf '%-8s %-14s %10.0f %8s\n' trust direct "$direct" 1.00
for route in passthrough:$PASS_PORT sslmode=disable:$PLAIN_PORT reuse:$REUSE_PORT pgbouncer:$BOUNCER_PORT; do
    c=$(run postgres "${route#*:}")
    printf '%-8s %-14s %10.0f %8s\n' trust "${route%%:*}" "$c" "$(ratio "$c" "$direct")"
done
direct=$(run scram "$PGPORT")
printf '%-8s %-14s %10.0f %8s\n' scram direct "$direct" 1.00
for route in passthrough:$PASS_PORT term/password:$TERM_PORT term/query:$QUERY_PORT; do
    c=$(run scram "${route#*:}")
    printf '%-8s %-14s %10.0f %8s\n' scram "${route%%:*}" "$c" "$(ratio "$c" "$direct")"
done
