#!/usr/bin/env bash
# What an idle client costs, in one run: pgcache in transaction mode
# against PgBouncer in transaction mode. CLIENTS plaintext clients (default
# 900) each log in, run one simple query and stay idle; after 2 s of
# idleness the proxy's RSS growth divided by the clients is the cost of
# one. Then the same with TLS clients, on a second pgcache of its own (a
# process does not give freed memory back, so one run would lend the next
# what the first freed); PgBouncer's TLS is not set up here. pgcache runs
# with one worker thread, as PgBouncer does.
#   bench/idle.sh [CLIENTS]
source "$(dirname "$0")/lib.sh"
CLIENTS=${1:-900}
ulimit -n 65536 2>/dev/null || true

build_pgcache
start_postgres

openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost \
    -keyout "$RUNDIR/key.pem" -out "$RUNDIR/cert.pem" >/dev/null 2>&1
cat >"$RUNDIR/tx.toml" <<TOML
[pool]
mode = "transaction"
default_pool_size = 4
[server]
max_client_connections = $((CLIENTS + 100))
[tls]
ssl_mode = "allow"
cert_file = "$RUNDIR/cert.pem"
key_file = "$RUNDIR/key.pem"
TOML
PORT=$(free_port)
start_pgcache "$PORT" --config "$RUNDIR/tx.toml" --workers 1
CACHE_PID=$PGCACHE_PID
TLS_PORT=$(free_port)
start_pgcache "$TLS_PORT" --config "$RUNDIR/tx.toml" --workers 1
TLS_PID=$PGCACHE_PID
BOUNCER_MODE=transaction BOUNCER_POOL_SIZE=4 BOUNCER_MAX_CLIENTS=$((CLIENTS + 100)) start_pgbouncer
BOUNCER_PID=$(cat "$RUNDIR/pgbouncer/pgbouncer.pid")

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# per_client PID PORT TLS: KB of RSS per idle client.
per_client() {
    local pid=$1 port=$2 tls=$3 before after
    # One client first: buffers and pools that every proxy sets up once.
    python3 "$RUNDIR/idle.py" "$port" 1 "$tls" "$RUNDIR/ready" &
    local warm=$!
    while [ ! -e "$RUNDIR/ready" ]; do sleep 0.1; done
    kill "$warm"; wait "$warm" 2>/dev/null || true
    rm -f "$RUNDIR/ready"
    sleep 1
    before=$(rss_kb "$pid")
    python3 "$RUNDIR/idle.py" "$port" "$CLIENTS" "$tls" "$RUNDIR/ready" &
    local idle=$!
    while [ ! -e "$RUNDIR/ready" ]; do sleep 0.1; done
    sleep 2
    after=$(rss_kb "$pid")
    kill "$idle"; wait "$idle" 2>/dev/null || true
    rm -f "$RUNDIR/ready"
    python3 -c "print(f'{($after - $before) / $CLIENTS:.1f}')"
}

cat >"$RUNDIR/idle.py" <<'PY'
# Opens N clients that log in as postgres (trust), run SELECT 1 and stay
# idle; touches READY once all are idle, then waits to be killed.
import socket, ssl, struct, sys, time
port, n, tls, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE

def until_ready(s):
    buf = b""
    while True:
        while len(buf) >= 5:
            tag, size = buf[0:1], struct.unpack("!I", buf[1:5])[0]
            if len(buf) < 1 + size:
                break
            if tag == b"E":
                raise SystemExit(f"error: {buf[5:1 + size]!r}")
            buf = buf[1 + size:]
            if tag == b"Z":
                return
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit("closed")
        buf += chunk

clients = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    if tls:
        s.sendall(struct.pack("!II", 8, 80877103))
        assert s.recv(1) == b"S"
        s = ctx.wrap_socket(s)
    params = b"user\0postgres\0database\0postgres\0\0"
    s.sendall(struct.pack("!II", 8 + len(params), 196608) + params)
    until_ready(s)
    s.sendall(b"Q" + struct.pack("!I", 13) + b"SELECT 1\0")
    until_ready(s)
    clients.append(s)
open(ready, "w").close()
time.sleep(3600)
PY

CACHE_PLAIN=$(per_client "$CACHE_PID" "$PORT" 0)
BOUNCER_PLAIN=$(per_client "$BOUNCER_PID" "$BOUNCER_PORT" 0)
CACHE_TLS=$(per_client "$TLS_PID" "$TLS_PORT" 1)

echo "Idle clients: $CLIENTS, transaction mode, RSS growth per client after 2 s idle ($(date +%F))"
echo
echo "| proxy | plaintext KB/client | TLS KB/client |"
echo "|---|---:|---:|"
echo "| pgcache | $CACHE_PLAIN | $CACHE_TLS |"
echo "| PgBouncer | $BOUNCER_PLAIN | n/a |"
