#!/usr/bin/env bash
# The cache's tiers side by side (memory, disk, Redis) and PostgreSQL:
#  1. a hit's latency from each tier at a fixed rate (RATE a second, 4
#     clients, prepared reads of 1,000 hot keys): p50 and p99 from pgbench -l,
#     beside PostgreSQL's for the same read. Each tier is made the only one
#     that can answer: memory (the default), disk (cache.local.max_bytes = 0,
#     a disk tier), Redis (cache.local.max_bytes = 0, a Redis).
#  2. a working set four times the memory budget (4 MiB of memory, 40,000
#     keys read uniformly), memory only against memory plus a disk tier:
#     hit ratio, client throughput, and PostgreSQL's CPU per 1,000
#     transactions (its exited backends', from /proc);
#  3. the same with an expensive read (an aggregate over 200 rows);
#  4. a restart: the hit ratio in the first 10 s after SIGTERM and a new
#     start, memory only against memory plus disk;
#  5. bytes per entry on disk and in memory (the gauges).
#   bench/tiers.sh [SECONDS]   (default 10; RATE=2000)
source "$(dirname "$0")/lib.sh"
SECS=${1:-10}
RATE=${RATE:-2000}
KEYS=40000

build_pgcache
start_postgres
init_bench_db
command -v redis-server >/dev/null || apt_install redis-server
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --pidfile "$RUNDIR/redis.pid" --logfile "$RUNDIR/redis.log" >/dev/null
PGPID=$(head -1 "$RUNDIR/pgdata/postmaster.pid")
hotkey_sql 1000
printf '\\set aid random(1, %d)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n' "$KEYS" >"$RUNDIR/wide.sql"
printf '\\set aid random(1, %d)\nSELECT count(*), sum(abalance), max(filler) FROM pgbench_accounts WHERE aid BETWEEN :aid AND :aid + 199;\n' \
    "$KEYS" >"$RUNDIR/aggregate.sql"
printf '[cache]\nverify_sample_rate = 0\n' >"$RUNDIR/memory.toml"
printf '[cache]\nverify_sample_rate = 0\n[cache.local]\nmax_bytes = 0\n[cache.disk]\npath = "%s"\n' \
    "$RUNDIR/disk-only" >"$RUNDIR/disk-only.toml"
printf '[cache]\nverify_sample_rate = 0\n[cache.local]\nmax_bytes = 0\n' >"$RUNDIR/redis-only.toml"
printf '[cache]\nverify_sample_rate = 0\nmax_entry_bytes = 65536\n[cache.local]\nmax_bytes = 4194304\n' >"$RUNDIR/small.toml"
printf '[cache]\nverify_sample_rate = 0\nmax_entry_bytes = 65536\n[cache.local]\nmax_bytes = 4194304\n[cache.disk]\npath = "%s"\nmax_bytes = 268435456\n' \
    "$RUNDIR/disk" >"$RUNDIR/small-disk.toml"

metric() { # NAME{labels}: its value on the running pgcache, 0 when absent
    curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | awk -v k="$1" '$1 == k {print $2; f=1} END {if (!f) print 0}'
}
hits() { metric 'pgcache_cache_lookups_total{result="hit"}'; }
misses() { metric 'pgcache_cache_lookups_total{result="miss"}'; }
stop_pgcache() { kill -TERM "$PGCACHE_PID"; wait "$PGCACHE_PID" 2>/dev/null || true; }

# percentiles PORT SCRIPT: p50 and p99 in microseconds at RATE.
percentiles() {
    local dir="$RUNDIR/log.$RANDOM"
    mkdir -p "$dir"
    (cd "$dir" && tps "$1" prepared -f "$2" -c 4 -j 2 -R "$RATE" -T "$SECS" -l --log-prefix=tx >/dev/null)
    cat "$dir"/tx.* | python3 -c '
import sys
lat = sorted(int(line.split()[2]) for line in sys.stdin if line.strip())
pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]
print(f"{pick(0.5):8d} {pick(0.99):8d}")'
}

echo "1. a hit's latency from each tier, at $RATE/s (us)"
printf '   %-12s %8s %8s\n' source p50 p99
for tier in memory disk-only redis-only; do
    port=$(free_port)
    extra=()
    [ "$tier" = redis-only ] && extra=(--redis "redis://127.0.0.1:$REDIS_PORT")
    start_pgcache "$port" --config "$RUNDIR/$tier.toml" "${extra[@]}"
    tps "$port" prepared -f "$RUNDIR/hotkey.sql" -c 4 -j 2 -T 3 >/dev/null
    printf '   %-12s %s\n' "${tier%-only}" "$(percentiles "$port" "$RUNDIR/hotkey.sql")"
    stop_pgcache
done
printf '   %-12s %s\n' PostgreSQL "$(percentiles "$PGPORT" "$RUNDIR/hotkey.sql")"

# workload CONFIG SCRIPT: hit ratio, tps and PostgreSQL CPU ms per 1,000
# transactions of SECS after a warm-up of SECS.
workload() {
    local port h0 m0 c0 c1 t
    port=$(free_port)
    start_pgcache "$port" --config "$RUNDIR/$1.toml"
    tps "$port" prepared -f "$2" -c 4 -j 2 -T "$SECS" >/dev/null
    h0=$(hits); m0=$(misses); c0=$(CHILDREN=1 cpu_secs "$PGPID")
    t=$(tps "$port" prepared -f "$2" -c 4 -j 2 -T "$SECS")
    c1=$(CHILDREN=1 cpu_secs "$PGPID")
    python3 -c "
h, m, t, c = $(hits) - $h0, $(misses) - $m0, $t, $c1 - $c0
print(f'{h / max(h + m, 1):10.3f} {t:10.0f} {1e6 * c / max(t * $SECS, 1):14.1f}')"
}

echo "2. $KEYS keys read uniformly, 4 MiB of memory (four times less than they take)"
printf '   %-16s %10s %10s %14s\n' tiers "hit ratio" tps "pg CPU ms/1k"
# Not in a subshell: workload starts the pgcache stop_pgcache stops.
workload small "$RUNDIR/wide.sql" >"$RUNDIR/row"; stop_pgcache
printf '   %-16s %s\n' memory "$(cat "$RUNDIR/row")"
workload small-disk "$RUNDIR/wide.sql" >"$RUNDIR/row"
printf '   %-16s %s\n' "memory + disk" "$(cat "$RUNDIR/row")"
# Bytes on disk once the clean stop has written the last memtable out.
ENTRIES=$(metric pgcache_disk_entries)
MEMORY=$(python3 -c "print(round($(metric pgcache_cache_bytes) / max($(metric pgcache_cache_entries), 1)))")
stop_pgcache
DISK_BYTES=$(du -sb "$RUNDIR/disk" | cut -f1)
echo "5. bytes per entry: disk $(python3 -c "print(round($DISK_BYTES / max($ENTRIES, 1)))") ($ENTRIES entries), memory $MEMORY"

echo "3. an aggregate over 200 rows, the same setting"
printf '   %-16s %10s %10s %14s\n' tiers "hit ratio" tps "pg CPU ms/1k"
workload small "$RUNDIR/aggregate.sql" >"$RUNDIR/row"; stop_pgcache
printf '   %-16s %s\n' memory "$(cat "$RUNDIR/row")"
workload small-disk "$RUNDIR/aggregate.sql" >"$RUNDIR/row"; stop_pgcache
printf '   %-16s %s\n' "memory + disk" "$(cat "$RUNDIR/row")"

# restarted CONFIG: the hit ratio in the first 10 s after a restart.
restarted() {
    local port
    port=$(free_port)
    start_pgcache "$port" --config "$RUNDIR/$1.toml"
    tps "$port" prepared -f "$RUNDIR/wide.sql" -c 4 -j 2 -T "$SECS" >/dev/null
    stop_pgcache
    start_pgcache "$port" --config "$RUNDIR/$1.toml"
    tps "$port" prepared -f "$RUNDIR/wide.sql" -c 4 -j 2 -T 10 >/dev/null
    python3 -c "h, m = $(hits), $(misses); print(f'{h / max(h + m, 1):10.3f}')"
    stop_pgcache
}
echo "4. hit ratio in the first 10 s after a restart"
restarted small >"$RUNDIR/row"
printf '   %-16s %s\n' memory "$(cat "$RUNDIR/row")"
restarted small-disk >"$RUNDIR/row"
printf '   %-16s %s\n' "memory + disk" "$(cat "$RUNDIR/row")"
