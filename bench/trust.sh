#!/usr/bin/env bash
# What trusting the cache costs, in one run:
#   sampler   hot-key select-only pgbench (8 clients, 1,000 keys, simple and
#             prepared) through pgcache with the correctness sampler at its
#             default rate (cache.verify_sample_rate = 0.001) vs off (0)
#   shadow    the same workload through pgcache in shadow mode
#             (cache.mode = "shadow": everything forwarded, every would-be hit
#             checked) vs --no-cache
# Runs are interleaved in ROUNDS rounds (default 3), each contender keeping
# its best, to damp the shared machine's noise. Targets: sampler >= 0.98x,
# shadow >= 0.95x in throughput. Beside throughput it prints CPU time per
# transaction, each contender's lowest: the whole machine's (pgbench,
# PostgreSQL and pgcache together, which is what a saturated machine's
# throughput is the inverse of, and steadier than throughput while other
# guests share the cores) and pgcache's own. The last two columns are
# the feature's cost: pgcache's extra CPU per transaction as a share of
# the baseline's whole-machine CPU per transaction, in user time and in
# user and system time. Each pair sends PostgreSQL the same statements
# (shadow forwards every one as --no-cache does; the sampler's checks are
# at most cache.verify_max_per_sec) with the same system calls, so
# PostgreSQL's and pgbench's work per transaction is the same, and what
# the feature adds is pgcache's own time: the share of a saturated
# machine's throughput it takes, read from the clocks that other guests'
# load moves least (user time least of all; system time differs only by
# the noise of the kernel's own work, or by what user work evicts from
# the caches). Targets: sampler <= 2%, shadow <= 5%.
#   [ROUNDS=N] bench/trust.sh [SECONDS-PER-RUN]   (default 10)
source "$(dirname "$0")/lib.sh"
DURATION=${1:-10}
ROUNDS=${ROUNDS:-3}

build_pgcache
start_postgres
init_bench_db

config() { # NAME TOML...
    printf '%s\n' "${@:2}" >"$RUNDIR/$1.toml"
    echo "$RUNDIR/$1.toml"
}
OFF_PORT=$(free_port);     start_pgcache "$OFF_PORT" --config "$(config off '[cache]' 'verify_sample_rate = 0')"
OFF_PID=$PGCACHE_PID
DEFAULT_PORT=$(free_port); start_pgcache "$DEFAULT_PORT" --config "$(config default '[cache]' 'verify_sample_rate = 0.001')"
DEFAULT_METRICS=$METRICS_PORT DEFAULT_PID=$PGCACHE_PID
NOCACHE_PORT=$(free_port); start_pgcache "$NOCACHE_PORT" --no-cache
NOCACHE_PID=$PGCACHE_PID
SHADOW_PORT=$(free_port);  start_pgcache "$SHADOW_PORT" --config "$(config shadow '[cache]' 'mode = "shadow"')"
SHADOW_METRICS=$METRICS_PORT SHADOW_PID=$PGCACHE_PID

hotkey_sql 1000

printf '%-20s %9s %9s %6s | %-17s %6s | %-17s %6s | %6s %6s\n' workload 'base tps' tps ratio 'machine us/tx' ratio 'pgcache us/tx' ratio 'cost' '(+sys)'
declare -A PORT=([off]=$OFF_PORT [sampled]=$DEFAULT_PORT [nocache]=$NOCACHE_PORT [shadow]=$SHADOW_PORT)
declare -A PID=([off]=$OFF_PID [sampled]=$DEFAULT_PID [nocache]=$NOCACHE_PID [shadow]=$SHADOW_PID)
# row NAME BASELINE MEASURED: throughput and CPU per transaction, measured ÷ baseline.
row() {
    printf '%-20s %9.0f %9.0f %6s | %8.1f %8.1f %6s | %8.1f %8.1f %6s | %5.1f%% %5.1f%%\n' "$1" \
        "${BEST[$2]}" "${BEST[$3]}" "$(ratio "${BEST[$3]}" "${BEST[$2]}")" \
        "${MACHINE[$2]}" "${MACHINE[$3]}" "$(ratio "${MACHINE[$3]}" "${MACHINE[$2]}")" \
        "${OWN[$2]}" "${OWN[$3]}" "$(ratio "${OWN[$3]}" "${OWN[$2]}")" \
        "$(python3 -c "print(100 * (${USERCPU[$3]} - ${USERCPU[$2]}) / ${MACHINE[$2]})")" \
        "$(python3 -c "print(100 * (${OWN[$3]} - ${OWN[$2]}) / ${MACHINE[$2]})")"
}
for mode in simple prepared; do
    args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION")
    for port in "$OFF_PORT" "$DEFAULT_PORT" "$SHADOW_PORT"; do
        tps "$port" "$mode" -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 2 >/dev/null # warm
    done
    # Each round runs every contender once, in turn; each keeps its best
    # throughput and its lowest CPU time per transaction.
    declare -A BEST=() MACHINE=() OWN=() USERCPU=()
    for _ in $(seq "$ROUNDS"); do
        for name in off sampled nocache shadow; do
            machine0=$(machine_busy_secs); read -r user0 sys0 < <(cpu_split "${PID[$name]}")
            t=$(tps "${PORT[$name]}" "$mode" "${args[@]}")
            machine1=$(machine_busy_secs); read -r user1 sys1 < <(cpu_split "${PID[$name]}")
            read -r best machine own user < <(python3 -c "
t, n = $t, $t * $DURATION
print(max(t, ${BEST[$name]:-0}), min(($machine1 - $machine0) / n * 1e6, ${MACHINE[$name]:-1e9}),
      min(($user1 + $sys1 - $user0 - $sys0) / n * 1e6, ${OWN[$name]:-1e9}),
      min(($user1 - $user0) / n * 1e6, ${USERCPU[$name]:-1e9}))")
            BEST[$name]=$best MACHINE[$name]=$machine OWN[$name]=$own USERCPU[$name]=$user
        done
    done
    row "sampler ($mode)" off sampled
    row "shadow ($mode)" nocache shadow
done
metrics() { # METRICS-PORT PATTERN
    python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://127.0.0.1:$1/metrics" | grep "^$2" || true
}
echo "the sampler's checks at the default rate:"
metrics "$DEFAULT_METRICS" pgcache_verify_total
echo "shadow mode's would-be hits:"
metrics "$SHADOW_METRICS" pgcache_shadow_hits_total
