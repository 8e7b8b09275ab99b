#!/usr/bin/env bash
# Smoke run of every fuzz target: build once, then fuzz each for FUZZ_SECONDS (default 15)
# starting from a temporary copy of its committed seed corpus (so new inputs never land in
# fuzz/corpus/). Exits non-zero on the first crash, leak, timeout or OOM; the reproducer is
# kept in fuzz/artifacts/<target>/. Prints one line per target with its exec count.
#
#   bash fuzz/smoke.sh                 # from anywhere
#   FUZZ_SECONDS=10 bash fuzz/smoke.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
seconds="${FUZZ_SECONDS:-15}"
targets=(frame_decoder tunnel_sequencer registry_ops lease_open signed_request stream_translate report_decode ping_scanner usage_filter trace_context passthrough_splice usage_scan)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "smoke: cargo-fuzz missing, installing (cargo install cargo-fuzz --locked)" >&2
    cargo install cargo-fuzz --locked
fi

cargo fuzz build --sanitizer none

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for target in "${targets[@]}"; do
    corpus="$work/corpus-$target"
    mkdir -p "$corpus"
    cp corpus/"$target"/* "$corpus"/
    log="$work/$target.log"
    if ! cargo fuzz run --sanitizer none "$target" "$corpus" -- \
        -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 \
        -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "smoke: $target FAILED (reproducer in fuzz/artifacts/$target/)" >&2
        exit 1
    fi
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    cov="$(grep -E '^#[0-9]+' "$log" | tail -n 1 | sed -n 's/.*cov: \([0-9]*\).*/\1/p')"
    printf 'smoke: %-17s ok  %10s execs in %ss (%s exec/s)  cov %s  corpus %s\n' \
        "$target" "${execs:-?}" "$seconds" "$(( ${execs:-0} / seconds ))" "${cov:-?}" \
        "$(find "$corpus" -type f | wc -l)"
done
