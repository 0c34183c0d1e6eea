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
# shadow >= 0.95x.
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
DEFAULT_PORT=$(free_port); start_pgcache "$DEFAULT_PORT" --config "$(config default '[cache]' 'verify_sample_rate = 0.001')"
DEFAULT_METRICS=$METRICS_PORT
NOCACHE_PORT=$(free_port); start_pgcache "$NOCACHE_PORT" --no-cache
SHADOW_PORT=$(free_port);  start_pgcache "$SHADOW_PORT" --config "$(config shadow '[cache]' 'mode = "shadow"')"
SHADOW_METRICS=$METRICS_PORT

hotkey_sql 1000

printf '%-22s %12s %12s %8s\n' workload baseline measured ratio
declare -A PORT=([off]=$OFF_PORT [sampled]=$DEFAULT_PORT [nocache]=$NOCACHE_PORT [shadow]=$SHADOW_PORT)
for mode in simple prepared; do
    args=(-f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T "$DURATION")
    for port in "$OFF_PORT" "$DEFAULT_PORT" "$SHADOW_PORT"; do
        tps "$port" "$mode" -f "$RUNDIR/hotkey.sql" -c 8 -j 2 -T 2 >/dev/null # warm
    done
    # Each round runs every contender once, in turn; each keeps its best.
    declare -A BEST=([off]=0 [sampled]=0 [nocache]=0 [shadow]=0)
    for _ in $(seq "$ROUNDS"); do
        for name in off sampled nocache shadow; do
            t=$(tps "${PORT[$name]}" "$mode" "${args[@]}")
            BEST[$name]=$(python3 -c "print(max($t, ${BEST[$name]}))")
        done
    done
    printf '%-22s %12.0f %12.0f %8s\n' "sampler ($mode)" "${BEST[off]}" "${BEST[sampled]}" "$(ratio "${BEST[sampled]}" "${BEST[off]}")"
    printf '%-22s %12.0f %12.0f %8s\n' "shadow ($mode)" "${BEST[nocache]}" "${BEST[shadow]}" "$(ratio "${BEST[shadow]}" "${BEST[nocache]}")"
done
metrics() { # METRICS-PORT PATTERN
    python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://127.0.0.1:$1/metrics" | grep "^$2" || true
}
echo "the sampler's checks at the default rate:"
metrics "$DEFAULT_METRICS" pgcache_verify_total
echo "shadow mode's would-be hits:"
metrics "$SHADOW_METRICS" pgcache_shadow_hits_total
