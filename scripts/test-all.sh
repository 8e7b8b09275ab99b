#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (`.ci/run` calls this script).
#
#   1. rustfmt check, 2. clippy with -D warnings on every target, 3. every test of the
#   workspace (unit, property, virtual-time harness, end-to-end over real TLS sockets, the
#   generated-code drift check, doc examples, the store contract suite against SQLite and a
#   PostgreSQL database this script provides: scripts/postgres.sh; the proxy-pool store
#   contract against a private redis-server: scripts/redis.sh; the OrbitMesh RFC 2136 DNS tests
#   against a private BIND 9: scripts/bind9.sh; ACME DNS-01 against a private pebble that
#   resolves through that BIND 9: scripts/pebble.sh), 4. a short smoke run of every cargo-fuzz
#   target.
#
# Environment: FUZZ_SECONDS (per fuzz target, default 15), SKIP_FUZZ=1 to skip step 4 locally.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says when it began (bash's SECONDS since this script started), so a slow CI run
# shows where its time went.
step() { printf '\n=== %s (at %dm%02ds) ===\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }

need() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "error: '$1' is required: $2" >&2
        exit 1
    fi
}
need cargo "install Rust with rustup (https://rustup.rs), stable >= 1.89"
need python3 "install Python 3 (Debian: apt-get install python3 python3-pip)"

# The end-to-end tests with the official OpenAI and Anthropic Python SDKs need both packages.
if ! python3 -c "import openai, anthropic" >/dev/null 2>&1; then
    echo "installing the official SDKs for the end-to-end tests (python3 -m pip install openai anthropic)"
    python3 -m pip install --quiet openai anthropic
fi

# The gRPC conformance tests use the standard Python clients operators and probes use.
if ! python3 -c "import grpc, grpc_health.v1.health_pb2, grpc_reflection.v1alpha.reflection_pb2" >/dev/null 2>&1; then
    echo "installing the Python gRPC clients for the conformance tests (python3 -m pip install grpcio grpcio-health-checking grpcio-reflection)"
    python3 -m pip install --quiet grpcio grpcio-health-checking grpcio-reflection
fi

# The status page tests drive Debian's chromium with Playwright from PyPI (Playwright's own
# browser download is not used: it cannot be fetched everywhere, and the system browser is
# the one operators have).
if ! python3 -c "import playwright.sync_api" >/dev/null 2>&1; then
    echo "installing Playwright for the browser tests (python3 -m pip install playwright)"
    python3 -m pip install --quiet playwright
fi
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's chromium for the browser tests (apt-get install chromium)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
fi
if [ ! -x /usr/bin/chromium ]; then
    echo "error: /usr/bin/chromium is required for the browser tests: run 'apt-get install chromium'" >&2
    exit 1
fi

# The Edge tier test (bins/tests/edge_tier.rs) puts two Edges behind Debian's HAProxy.
if [ ! -x /usr/sbin/haproxy ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's haproxy for the Edge tier test (apt-get install haproxy)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null
    fi
fi
if [ ! -x /usr/sbin/haproxy ]; then
    echo "error: /usr/sbin/haproxy is required for the Edge tier test: run 'apt-get install haproxy'" >&2
    exit 1
fi

# A clean build of every test target takes several GiB; with full debug info it once filled a
# CI machine's disk (see [profile.dev] in Cargo.toml). Incremental state is of no use to a
# clean clone and doubles the workspace crates' footprint.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
free_kib="$(df -Pk . | awk 'NR==2 {print $4}')"
echo "disk: $((free_kib / 1024 / 1024)) GiB free for the build"
if [ "${free_kib:-0}" -lt $((4 * 1024 * 1024)) ]; then
    echo "warning: under 4 GiB free; the build may fail with 'No space left on device'" >&2
fi

step "rustfmt"
cargo fmt --all --check
cargo fmt --manifest-path fuzz/Cargo.toml --check

step "clippy (-D warnings, all targets)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "docs (cargo doc, warnings are errors)"
# Every library's docs build without a warning: a broken intra-doc link is a newcomer's dead end.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --lib --locked

step "pure crates (no tokio in their normal dependencies)"
# The sans-io machines promise no runtime, no clock and no sockets; Cargo holds them to it.
for crate in iop-wire iop-edge-core iop-dialect iop-lease workload-identity; do
    if cargo tree --locked -p "$crate" -e normal --prefix none | grep -q '^tokio'; then
        echo "error: $crate depends on tokio (cargo tree -p $crate -e normal -i tokio)" >&2
        exit 1
    fi
    echo "$crate: no tokio"
done
# The wire crate has no TLS (workload identities live in workload-identity).
if cargo tree --locked -p iop-wire -e normal --prefix none | grep -q '^rustls'; then
    echo "error: iop-wire depends on rustls (cargo tree -p iop-wire -e normal -i rustls)" >&2
    exit 1
fi
echo "iop-wire: no rustls"

step "build the tests"
# Built apart from the run (the same build the run would do) so the step times tell building
# from running (doc tests still compile while they run); the services start after it.
cargo test --workspace --locked --no-run

step "services"
# shellcheck source=scripts/postgres.sh
. scripts/postgres.sh
# shellcheck source=scripts/redis.sh
. scripts/redis.sh
# shellcheck source=scripts/redis-cluster.sh
. scripts/redis-cluster.sh
# shellcheck source=scripts/bind9.sh
. scripts/bind9.sh
# shellcheck source=scripts/pebble.sh
. scripts/pebble.sh
test_log="$(mktemp)"
trap 'rm -f "$test_log"; pg_cleanup; redis_cleanup; redis_cluster_cleanup; pebble_cleanup; bind9_cleanup' EXIT
pg_setup
redis_setup
redis_cluster_setup
bind9_setup
pebble_setup

step "tests"
# Tests write only under temporary directories: the work tree must look the same afterwards
# (two stray configs were once committed from a run in the repository root).
tree_before="$(git status --porcelain --untracked-files=all 2>/dev/null || true)"
# --no-fail-fast: one failing test binary must not hide what the others would say.
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$test_log"
tree_after="$(git status --porcelain --untracked-files=all 2>/dev/null || true)"
if [ "$tree_before" != "$tree_after" ]; then
    echo "error: the test run changed the work tree (tests must write only under temporary directories):" >&2
    diff <(echo "$tree_before") <(echo "$tree_after") >&2 || true
    exit 1
fi
passed="$(sed -n 's/^test result: .*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' "$test_log" | awk '{s+=$1} END {print s+0}')"
failed="$(sed -n 's/^test result: .*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' "$test_log" | awk '{s+=$1} END {print s+0}')"

if [ "${SKIP_FUZZ:-0}" != "1" ]; then
    step "fuzz smoke (${FUZZ_SECONDS:-15}s per target)"
    if ! cargo fuzz --version >/dev/null 2>&1; then
        echo "cargo-fuzz is missing; installing it (cargo install cargo-fuzz --locked)"
        cargo install cargo-fuzz --locked
    fi
    bash fuzz/smoke.sh
fi

step "all checks passed"
# One closing line for the whole suite (cargo prints one per test binary).
printf 'tests: %s passed, %s failed; %dm%02ds in all\n' "$passed" "$failed" $((SECONDS / 60)) $((SECONDS % 60))
