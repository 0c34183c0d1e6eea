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
# PostgreSQL and pgcache together) and pgcache's own. Which of the two
# throughput follows depends on what sets the pace, and the "pgcache
# run+wait" column says which: the share of its best run pgcache's threads
# spent running, and waiting runnable for a CPU. Near 100 %, pgcache always
# had work and set the pace (every pgcache here runs --workers 1, one
# worker thread, so runs compare alike): throughput is the inverse of
# pgcache's own CPU per transaction, and a feature's cost is that ratio.
# Well below, the machine's cores set the pace,
# and the cost is the feature's share of the machine: the "cost" columns,
# pgcache's extra CPU per transaction over the baseline's whole-machine CPU
# per transaction, in user time and in user and system time. Each pair
# sends PostgreSQL the same statements (shadow forwards every one as
# --no-cache does; the sampler's checks are at most
# cache.verify_max_per_sec) with the same system calls.
# WORKLOAD=tpcb-like runs pgbench's default read-write transaction (scale
# 10) instead of the hot-key read: where PostgreSQL's own work per
# statement is more than a cached primary-key lookup.
#   [ROUNDS=N] [WORKLOAD=tpcb-like] bench/trust.sh [SECONDS-PER-RUN]   (default 10)
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
OFF_PORT=$(free_port);     start_pgcache "$OFF_PORT" --config "$(config off '[cache]' 'verify_sample_rate = 0')" --workers 1
OFF_PID=$PGCACHE_PID
DEFAULT_PORT=$(free_port); start_pgcache "$DEFAULT_PORT" --config "$(config default '[cache]' 'verify_sample_rate = 0.001')" --workers 1
DEFAULT_METRICS=$METRICS_PORT DEFAULT_PID=$PGCACHE_PID
NOCACHE_PORT=$(free_port); start_pgcache "$NOCACHE_PORT" --no-cache --workers 1
NOCACHE_PID=$PGCACHE_PID
SHADOW_PORT=$(free_port);  start_pgcache "$SHADOW_PORT" --config "$(config shadow '[cache]' 'mode = "shadow"')" --workers 1
SHADOW_METRICS=$METRICS_PORT SHADOW_PID=$PGCACHE_PID

hotkey_sql 1000
case ${WORKLOAD:-hotkey} in
    hotkey) SCRIPT=(-f "$RUNDIR/hotkey.sql") ;;
    tpcb-like) SCRIPT=(-b tpcb-like) ;;
    *) echo "WORKLOAD is hotkey or tpcb-like" >&2; exit 2 ;;
esac

printf '%-20s %9s %9s %6s | %-17s %6s | %-17s %6s | %6s %6s | %s\n' workload 'base tps' tps ratio 'machine us/tx' ratio 'pgcache us/tx' ratio 'cost' '(+sys)' 'pgcache run+wait %'
declare -A PORT=([off]=$OFF_PORT [sampled]=$DEFAULT_PORT [nocache]=$NOCACHE_PORT [shadow]=$SHADOW_PORT)
declare -A PID=([off]=$OFF_PID [sampled]=$DEFAULT_PID [nocache]=$NOCACHE_PID [shadow]=$SHADOW_PID)
# row NAME BASELINE MEASURED: throughput and CPU per transaction, measured ÷ baseline.
row() {
    printf '%-20s %9.0f %9.0f %6s | %8.1f %8.1f %6s | %8.1f %8.1f %6s | %5.1f%% %5.1f%% | %s, %s\n' "$1" \
        "${BEST[$2]}" "${BEST[$3]}" "$(ratio "${BEST[$3]}" "${BEST[$2]}")" \
        "${MACHINE[$2]}" "${MACHINE[$3]}" "$(ratio "${MACHINE[$3]}" "${MACHINE[$2]}")" \
        "${OWN[$2]}" "${OWN[$3]}" "$(ratio "${OWN[$3]}" "${OWN[$2]}")" \
        "$(python3 -c "print(100 * (${USERCPU[$3]} - ${USERCPU[$2]}) / ${MACHINE[$2]})")" \
        "$(python3 -c "print(100 * (${OWN[$3]} - ${OWN[$2]}) / ${MACHINE[$2]})")" \
        "${PACE[$2]}" "${PACE[$3]}"
}
for mode in simple prepared; do
    args=("${SCRIPT[@]}" -c 8 -j 2 -T "$DURATION")
    for port in "$OFF_PORT" "$DEFAULT_PORT" "$SHADOW_PORT"; do
        tps "$port" "$mode" "${SCRIPT[@]}" -c 8 -j 2 -T 2 >/dev/null # warm
    done
    # Each round runs every contender once, in turn; each keeps its best
    # throughput and its lowest CPU time per transaction.
    declare -A BEST=() MACHINE=() OWN=() USERCPU=() PACE=()
    for _ in $(seq "$ROUNDS"); do
        for name in off sampled nocache shadow; do
            machine0=$(machine_busy_secs); read -r user0 sys0 < <(cpu_split "${PID[$name]}")
            read -r run0 wait0 < <(sched_ns "${PID[$name]}"); wall0=$(date +%s%N)
            t=$(tps "${PORT[$name]}" "$mode" "${args[@]}")
            machine1=$(machine_busy_secs); read -r user1 sys1 < <(cpu_split "${PID[$name]}")
            read -r run1 wait1 < <(sched_ns "${PID[$name]}"); wall1=$(date +%s%N)
            read -r best machine own user pace < <(python3 -c "
t, n = $t, $t * $DURATION
wall = $wall1 - $wall0
pace = f'{100 * ($run1 - $run0) / wall:.0f}+{100 * ($wait1 - $wait0) / wall:.0f}'
print(max(t, ${BEST[$name]:-0}), min(($machine1 - $machine0) / n * 1e6, ${MACHINE[$name]:-1e9}),
      min(($user1 + $sys1 - $user0 - $sys0) / n * 1e6, ${OWN[$name]:-1e9}),
      min(($user1 - $user0) / n * 1e6, ${USERCPU[$name]:-1e9}),
      pace if t > ${BEST[$name]:-0} else '${PACE[$name]:-}')")
            BEST[$name]=$best MACHINE[$name]=$machine OWN[$name]=$own USERCPU[$name]=$user PACE[$name]=$pace
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
