# Sourced by scripts/test-all.sh: provides a PostgreSQL database for this test run and exports
# IOP_TEST_PG_URL. Nothing is shared with other runs: the database (or the whole private
# cluster) is created here and removed by `pg_cleanup`, which the caller runs at exit.
#
#   - IOP_TEST_PG_URL already set: used as is, nothing created or dropped.
#   - a server accepting connections on 127.0.0.1:${IOP_PG_PORT:-5432} with trust auth for
#     role `postgres`: a database `iop_test_<pid>` is created there and dropped afterwards.
#   - otherwise: a private cluster (initdb, trust auth, loopback only, a free port) in a temp
#     directory, started with pg_ctl and removed afterwards. The PostgreSQL server packages are
#     installed with apt-get when missing and we are root; otherwise this stops with the command
#     to run.

PG_CREATED_DB=""
PG_PRIVATE_DIR=""

pg_cleanup() {
    if [ -n "$PG_CREATED_DB" ]; then
        psql -h 127.0.0.1 -p "${IOP_PG_PORT:-5432}" -U postgres -d postgres -qAtc \
            "DROP DATABASE IF EXISTS $PG_CREATED_DB WITH (FORCE)" >/dev/null 2>&1 || true
    fi
    if [ -n "$PG_PRIVATE_DIR" ]; then
        pg_run pg_ctl -D "$PG_PRIVATE_DIR/data" -m immediate stop >/dev/null 2>&1 || true
        rm -rf "$PG_PRIVATE_DIR"
    fi
}

# Runs a PostgreSQL server tool, as the `postgres` user when we are root (initdb refuses root).
pg_run() {
    if [ "$(id -u)" = "0" ]; then
        su postgres -s /bin/sh -c "$(printf '%q ' "$@")"
    else
        "$@"
    fi
}

pg_bin() {
    command -v "$1" 2>/dev/null && return 0
    ls /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | sort -V | tail -n 1
}

pg_setup() {
    if [ -n "${IOP_TEST_PG_URL:-}" ]; then
        echo "postgres: using IOP_TEST_PG_URL from the environment"
        return 0
    fi
    local port="${IOP_PG_PORT:-5432}"
    if command -v psql >/dev/null 2>&1 \
        && psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAtc 'select 1' >/dev/null 2>&1; then
        PG_CREATED_DB="iop_test_$$"
        psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAtc "CREATE DATABASE $PG_CREATED_DB" >/dev/null
        export IOP_TEST_PG_URL="postgres://postgres@127.0.0.1:$port/$PG_CREATED_DB"
        echo "postgres: database $PG_CREATED_DB on 127.0.0.1:$port (dropped at exit)"
        return 0
    fi
    local initdb_bin pg_ctl_bin
    initdb_bin="$(pg_bin initdb)"
    pg_ctl_bin="$(pg_bin pg_ctl)"
    if [ -z "$initdb_bin" ] || [ -z "$pg_ctl_bin" ]; then
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
            echo "postgres: installing the PostgreSQL server (apt-get install postgresql)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
            initdb_bin="$(pg_bin initdb)"
            pg_ctl_bin="$(pg_bin pg_ctl)"
        fi
    fi
    if [ -z "$initdb_bin" ] || [ -z "$pg_ctl_bin" ]; then
        echo "error: PostgreSQL is required for the store contract tests: run 'apt-get install postgresql' (or set IOP_TEST_PG_URL)" >&2
        exit 1
    fi
    PG_PRIVATE_DIR="$(mktemp -d /tmp/iop-pg.XXXXXX)"
    chmod 755 "$PG_PRIVATE_DIR"
    [ "$(id -u)" = "0" ] && chown postgres "$PG_PRIVATE_DIR"
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    pg_run "$initdb_bin" -D "$PG_PRIVATE_DIR/data" -U postgres --auth=trust >/dev/null
    pg_run "$pg_ctl_bin" -D "$PG_PRIVATE_DIR/data" -l "$PG_PRIVATE_DIR/log" -w \
        -o "-p $port -k $PG_PRIVATE_DIR -c listen_addresses=127.0.0.1" start >/dev/null
    export IOP_PG_PORT="$port"
    export IOP_TEST_PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
    echo "postgres: private cluster on 127.0.0.1:$port (removed at exit)"
}
