# Sourced by scripts/test-all.sh: starts a private redis-server for this test run on a free
# loopback port (nothing on disk) and exports PROXYPOOL_TEST_REDIS_URL; `redis_cleanup` stops
# it. Installs the Debian `redis-server` package as root when missing, or stops with the
# command to run. PROXYPOOL_TEST_REDIS_URL already set: used as is.

REDIS_PID=""
REDIS_DIR=""

redis_cleanup() {
    if [ -n "$REDIS_PID" ]; then
        kill "$REDIS_PID" >/dev/null 2>&1 || true
        wait "$REDIS_PID" 2>/dev/null || true
    fi
    [ -n "$REDIS_DIR" ] && rm -rf "$REDIS_DIR"
}

redis_setup() {
    if [ -n "${PROXYPOOL_TEST_REDIS_URL:-}" ]; then
        echo "redis: using PROXYPOOL_TEST_REDIS_URL from the environment"
        return 0
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
            echo "redis: installing redis-server (apt-get install redis-server)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
        fi
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "error: redis-server is required for the proxy-pool tests: run 'apt-get install redis-server' (or set PROXYPOOL_TEST_REDIS_URL)" >&2
        exit 1
    fi
    REDIS_DIR="$(mktemp -d /tmp/iop-redis.XXXXXX)"
    local port
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$REDIS_DIR" --logfile "$REDIS_DIR/redis.log" &
    REDIS_PID=$!
    for _ in $(seq 1 100); do
        if redis-cli -p "$port" ping >/dev/null 2>&1; then
            export PROXYPOOL_TEST_REDIS_URL="redis://127.0.0.1:$port/"
            echo "redis: private redis-server on 127.0.0.1:$port (stopped at exit)"
            return 0
        fi
        sleep 0.1
    done
    echo "error: redis-server did not start; see $REDIS_DIR/redis.log" >&2
    exit 1
}
