# Sourced by scripts/test-all.sh: starts a private BIND 9 (`named`) for this test run on a free
# loopback port, on 127.0.0.1 and ::1 (UDP and TCP), authoritative for `orbit.test.` and
# accepting RFC 2136 updates signed with a TSIG key (hmac-sha256) made here; exports
# ORBIT_TEST_DNS_SERVER (127.0.0.1:port), ORBIT_TEST_DNS_SERVER_V6 ([::1]:port),
# ORBIT_TEST_DNS_ZONE and ORBIT_TEST_TSIG (name:base64 secret). `bind9_cleanup` stops it.
# Installs the Debian `bind9` package as root when missing, or stops with the command to run.

BIND9_PID=""
BIND9_DIR=""

bind9_cleanup() {
    if [ -n "$BIND9_PID" ]; then
        kill "$BIND9_PID" >/dev/null 2>&1 || true
        wait "$BIND9_PID" 2>/dev/null || true
    fi
    [ -n "$BIND9_DIR" ] && rm -rf "$BIND9_DIR"
}

bind9_setup() {
    if [ -n "${ORBIT_TEST_DNS_SERVER:-}" ]; then
        echo "bind9: using ORBIT_TEST_DNS_SERVER from the environment"
        if [ -z "${ORBIT_TEST_DNS_SERVER_V6:-}" ]; then
            echo "error: ORBIT_TEST_DNS_SERVER_V6 must be set too (the same server on IPv6)" >&2
            exit 1
        fi
        return 0
    fi
    if ! command -v named >/dev/null 2>&1; then
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
            echo "bind9: installing bind9 (apt-get install bind9)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bind9 >/dev/null
        fi
    fi
    if ! command -v named >/dev/null 2>&1; then
        echo "error: named (BIND 9) is required for the DNS tests: run 'apt-get install bind9' (or set ORBIT_TEST_DNS_SERVER, ORBIT_TEST_DNS_ZONE, ORBIT_TEST_TSIG)" >&2
        exit 1
    fi
    BIND9_DIR="$(mktemp -d /tmp/iop-bind9.XXXXXX)"
    chmod 777 "$BIND9_DIR"
    local port secret
    # A port free on both loopback addresses.
    port="$(python3 -c 'import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    try:
        t = socket.socket(socket.AF_INET6); t.bind(("::1", p)); t.close(); break
    except OSError:
        pass
print(p)')"
    secret="$(python3 -c 'import base64,os; print(base64.b64encode(os.urandom(32)).decode())')"
    cat > "$BIND9_DIR/orbit.test.zone" <<ZONE
\$TTL 60
@ IN SOA ns.orbit.test. hostmaster.orbit.test. 1 60 60 600 60
@ IN NS ns.orbit.test.
ns IN A 127.0.0.1
ZONE
    cat > "$BIND9_DIR/named.conf" <<CONF
options {
    directory "$BIND9_DIR";
    listen-on port $port { 127.0.0.1; };
    listen-on-v6 port $port { ::1; };
    pid-file "$BIND9_DIR/named.pid";
    recursion no;
    allow-query { 127.0.0.1; ::1; };
    dnssec-validation no;
};
key "orbit-test-key" {
    algorithm hmac-sha256;
    secret "$secret";
};
controls { };
zone "orbit.test" {
    type primary;
    file "$BIND9_DIR/orbit.test.zone";
    journal "$BIND9_DIR/orbit.test.zone.jnl";
    allow-update { key "orbit-test-key"; };
};
CONF
    chmod 666 "$BIND9_DIR"/*
    local user_flag=""
    [ "$(id -u)" = "0" ] && user_flag="-u root"
    # -g: foreground, log to stderr.
    named -g -c "$BIND9_DIR/named.conf" $user_flag >"$BIND9_DIR/named.log" 2>&1 &
    BIND9_PID=$!
    for _ in $(seq 1 100); do
        if grep -q "running" "$BIND9_DIR/named.log" 2>/dev/null; then
            export ORBIT_TEST_DNS_SERVER="127.0.0.1:$port"
            export ORBIT_TEST_DNS_SERVER_V6="[::1]:$port"
            export ORBIT_TEST_DNS_ZONE="orbit.test"
            export ORBIT_TEST_TSIG="orbit-test-key:$secret"
            echo "bind9: private named on 127.0.0.1:$port and [::1]:$port for orbit.test (stopped at exit)"
            return 0
        fi
        if ! kill -0 "$BIND9_PID" 2>/dev/null; then
            break
        fi
        sleep 0.1
    done
    echo "error: named did not start; its log:" >&2
    cat "$BIND9_DIR/named.log" >&2
    exit 1
}
