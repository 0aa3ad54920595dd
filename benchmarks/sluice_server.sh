# Sourced by benchmarks that start `sluice serve` once per configuration (agents.sh,
# tpot_target.sh): start_server LOG FLAGS... starts it on $PORT and waits for /health
# (exits if the server dies first); stop_server stops it (also on exit).
SERVER=
stop_server() {
    [ -n "$SERVER" ] || return 0
    kill -TERM "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=
}
trap stop_server EXIT
start_server() {  # LOG FLAGS...
    local logf=$1; shift
    .venv/bin/sluice serve --port "$PORT" "$@" > "$logf" 2>&1 &
    SERVER=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
        kill -0 "$SERVER" 2>/dev/null || { echo "server failed: $logf" >&2; exit 1; }
        sleep 1
    done
}
