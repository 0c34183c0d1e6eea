#!/usr/bin/env bash
# Runs every cargo-fuzz target for a while and reports what it found.
#   bench/fuzz.sh [SECONDS-PER-TARGET]   (default 60)
# Targets (fuzz/fuzz_targets/): frames (frame decoder, Parse/Bind/Describe/
# Execute/DataRow views, pgoutput decoder), startup (startup packets),
# classify (sqlparser analysis), hints (hint lexer), shared_entry (values read
# from Redis), auth (SCRAM on both sides, SASL messages, upstream.url).
# Needs the nightly toolchain; installs cargo-fuzz when missing.
# A crash is saved under fuzz/artifacts/<target>/ and makes this script fail:
# keep the input as a regression test in the crate's unit tests.
set -euo pipefail
SECONDS_PER_TARGET=${1:-60}
cd "$(dirname "$0")/../fuzz"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
status=0
for target in frames startup classify hints shared_entry auth; do
    corpus="corpus/$target"
    mkdir -p "$corpus"
    cp -n seeds/"$target"/* "$corpus"/ 2>/dev/null || true
    log=$(mktemp)
    if cargo +nightly fuzz run "$target" "$corpus" -- \
        -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -max_len=65536 >"$log" 2>&1; then
        runs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | tail -1)
        echo "$target: ok ($runs)"
    else
        status=1
        echo "$target: FOUND A CRASH"
        grep -E 'panicked|ERROR|Test unit written' "$log" | head -5
    fi
    rm -f "$log"
done
exit $status
