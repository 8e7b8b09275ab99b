# Sourced by scripts/test-all.sh after scripts/bind9.sh: starts Let's Encrypt's `pebble` ACME
# test server on free loopback ports, resolving DNS-01 challenges through the private BIND 9
# (so the TXT records our DNS provider writes are what it checks; real validation, no
# PEBBLE_VA_ALWAYS_VALID). Its HTTPS certificate comes from a throwaway CA made here with
# openssl. Exports ORBIT_TEST_ACME_DIRECTORY, ORBIT_TEST_ACME_ROOT (that CA, PEM) and
# ORBIT_TEST_PEBBLE_MANAGEMENT; `pebble_cleanup` stops it. Installs the Debian `pebble` package
# as root when missing, or stops with the command to run.

PEBBLE_PID=""
PEBBLE_DIR=""

pebble_cleanup() {
    if [ -n "$PEBBLE_PID" ]; then
        kill "$PEBBLE_PID" >/dev/null 2>&1 || true
        wait "$PEBBLE_PID" 2>/dev/null || true
    fi
    [ -n "$PEBBLE_DIR" ] && rm -rf "$PEBBLE_DIR"
}

pebble_setup() {
    if [ -n "${ORBIT_TEST_ACME_DIRECTORY:-}" ]; then
        echo "pebble: using ORBIT_TEST_ACME_DIRECTORY from the environment"
        return 0
    fi
    local tool missing=0
    for tool in pebble openssl curl; do
        command -v "$tool" >/dev/null 2>&1 || missing=1
    done
    if [ "$missing" = 1 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "pebble: installing pebble, openssl and curl (apt-get install pebble openssl curl)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pebble openssl curl >/dev/null
    fi
    missing=0
    for tool in pebble openssl curl; do
        command -v "$tool" >/dev/null 2>&1 || missing=1
    done
    if [ "$missing" = 1 ]; then
        echo "error: pebble, openssl and curl are required for the ACME tests: run 'apt-get install pebble openssl curl'" >&2
        exit 1
    fi
    PEBBLE_DIR="$(mktemp -d /tmp/iop-pebble.XXXXXX)"
    local port mgmt
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    mgmt="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    (
        cd "$PEBBLE_DIR"
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
            -subj "/CN=pebble test CA" -keyout ca.key -out ca.pem >/dev/null 2>&1
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -subj "/CN=localhost" -keyout key.pem -out req.csr >/dev/null 2>&1
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > ext.cnf
        openssl x509 -req -in req.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
            -extfile ext.cnf -out cert.pem >/dev/null 2>&1
    )
    cat > "$PEBBLE_DIR/config.json" <<JSON
{"pebble": {"listenAddress": "127.0.0.1:$port", "managementListenAddress": "127.0.0.1:$mgmt",
 "certificate": "$PEBBLE_DIR/cert.pem", "privateKey": "$PEBBLE_DIR/key.pem",
 "httpPort": 5002, "tlsPort": 5001, "ocspResponderURL": "", "externalAccountBindingRequired": false}}
JSON
    PEBBLE_VA_NOSLEEP=1 PEBBLE_WFE_NONCEREJECT=0 pebble -config "$PEBBLE_DIR/config.json" \
        -dnsserver "$ORBIT_TEST_DNS_SERVER" >"$PEBBLE_DIR/pebble.log" 2>&1 &
    PEBBLE_PID=$!
    for _ in $(seq 1 100); do
        if curl -s --cacert "$PEBBLE_DIR/ca.pem" "https://127.0.0.1:$port/dir" >/dev/null 2>&1; then
            export ORBIT_TEST_ACME_DIRECTORY="https://127.0.0.1:$port/dir"
            export ORBIT_TEST_ACME_ROOT="$PEBBLE_DIR/ca.pem"
            export ORBIT_TEST_PEBBLE_MANAGEMENT="https://127.0.0.1:$mgmt"
            echo "pebble: ACME directory $ORBIT_TEST_ACME_DIRECTORY, DNS via $ORBIT_TEST_DNS_SERVER (stopped at exit)"
            return 0
        fi
        if ! kill -0 "$PEBBLE_PID" 2>/dev/null; then
            break
        fi
        sleep 0.1
    done
    echo "error: pebble did not start; its log:" >&2
    cat "$PEBBLE_DIR/pebble.log" >&2
    exit 1
}
