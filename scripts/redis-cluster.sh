# Sourced by scripts/test-all.sh: starts a private Redis Cluster for this test run (three
# masters, three replicas, nothing on disk) on free loopback ports, waits until every slot is
# served, and exports IOP_TEST_REDIS_CLUSTER_URL (the nodes' URLs, comma-separated);
# `redis_cluster_cleanup` stops it. Needs redis-server and redis-cli (the Debian
# `redis-server` package, installed by scripts/redis.sh). IOP_TEST_REDIS_CLUSTER_URL already
# set: used as is.

REDIS_CLUSTER_PIDS=""
REDIS_CLUSTER_DIR=""

redis_cluster_cleanup() {
    for pid in $REDIS_CLUSTER_PIDS; do
        kill "$pid" >/dev/null 2>&1 || true
    done
    for pid in $REDIS_CLUSTER_PIDS; do
        wait "$pid" 2>/dev/null || true
    done
    [ -n "$REDIS_CLUSTER_DIR" ] && rm -rf "$REDIS_CLUSTER_DIR"
}

redis_cluster_setup() {
    if [ -n "${IOP_TEST_REDIS_CLUSTER_URL:-}" ]; then
        echo "redis cluster: using IOP_TEST_REDIS_CLUSTER_URL from the environment"
        return 0
    fi
    if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
        echo "error: redis-server and redis-cli are required for the Redis Cluster tests: run 'apt-get install redis-server' (or set IOP_TEST_REDIS_CLUSTER_URL)" >&2
        exit 1
    fi
    REDIS_CLUSTER_DIR="$(mktemp -d /tmp/iop-redis-cluster.XXXXXX)"
    local ports nodes urls port
    # Six free ports (a cluster bus port is the port + 10000: keep ports below 55535).
    ports="$(python3 -c '
import socket
ports = []
while len(ports) < 6:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p < 55000 and p not in ports:
        ports.append(p)
print(" ".join(map(str, ports)))')"
    nodes=""
    urls=""
    for port in $ports; do
        mkdir -p "$REDIS_CLUSTER_DIR/$port"
        redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
            --cluster-enabled yes --cluster-config-file "$REDIS_CLUSTER_DIR/$port/nodes.conf" \
            --cluster-node-timeout 2000 --dir "$REDIS_CLUSTER_DIR/$port" \
            --logfile "$REDIS_CLUSTER_DIR/$port/redis.log" &
        REDIS_CLUSTER_PIDS="$REDIS_CLUSTER_PIDS $!"
        nodes="$nodes 127.0.0.1:$port"
        urls="${urls:+$urls,}redis://127.0.0.1:$port/"
    done
    for port in $ports; do
        for _ in $(seq 1 100); do
            redis-cli -p "$port" ping >/dev/null 2>&1 && break
            sleep 0.1
        done
    done
    # shellcheck disable=SC2086
    if ! redis-cli --cluster create $nodes --cluster-replicas 1 --cluster-yes \
        >"$REDIS_CLUSTER_DIR/create.log" 2>&1; then
        echo "error: redis-cli --cluster create failed; see $REDIS_CLUSTER_DIR/create.log" >&2
        cat "$REDIS_CLUSTER_DIR/create.log" >&2
        exit 1
    fi
    port="${ports%% *}"
    for _ in $(seq 1 200); do
        if redis-cli -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
            export IOP_TEST_REDIS_CLUSTER_URL="$urls"
            echo "redis cluster: 3 masters + 3 replicas on 127.0.0.1:{$(echo $ports | tr ' ' ',')} (stopped at exit)"
            return 0
        fi
        sleep 0.1
    done
    echo "error: the Redis Cluster did not reach cluster_state:ok; see $REDIS_CLUSTER_DIR" >&2
    exit 1
}
