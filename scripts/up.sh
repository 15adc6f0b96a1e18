#!/usr/bin/env bash
# Start the whole platform on the embedded default (or on DATABASE_URL/REDIS_URL when set):
# the ASGI server (web UI, admin, API, OIP v2, agent websocket), a Celery worker and beat, and
# one local serving agent, each under supervisord (deploy/supervisord.conf), which restarts a
# process that dies and leaves the others running. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# What this script and the platform create under var/ (the database, demo.json, node-token,
# bootstrap.log, logs) is readable by this user only: some of it holds passwords and tokens.
umask 077
PORT="${PORT:-8000}"
# deploy/supervisord.conf reads these from the environment (%(ENV_X)s).
export SWITCHYARD_PORT="$PORT"
export PY="$PWD/.venv/bin/python"
export SWITCHYARD_VAR_DIR="${SWITCHYARD_VAR_DIR:-$PWD/var}"
# OIP v2 over gRPC: every web worker serves it on this port too (SO_REUSEPORT), on loopback
# like the HTTP port.
export SWITCHYARD_GRPC_PORT="${SWITCHYARD_GRPC_PORT:-8001}"
export SWITCHYARD_GRPC_HOST="${SWITCHYARD_GRPC_HOST:-127.0.0.1}"

$PY manage.py migrate --noinput -v0
var="$SWITCHYARD_VAR_DIR"
mkdir -p "$var"
$PY manage.py bootstrap_demo > "$var/bootstrap.log"
creds="$var/demo.json"
get() { $PY -c "import json,sys; print(json.load(open('$creds'))[sys.argv[1]])" "$1"; }
get node_token > "$var/node-token"
chmod 600 "$var/node-token"

cat <<MSG

  Switchyard is starting on http://127.0.0.1:${PORT}
  Web UI:     http://127.0.0.1:${PORT}/   sign in as
                engineer / $(get engineer_password)   (engineer: canaries, promotion requests)
                admin / $(get admin_password)   (approver and Django admin at /admin/)
  API docs:   http://127.0.0.1:${PORT}/api/docs/
  Demo key:   $(get api_key)
  Try:        curl -s -H "Authorization: Bearer $(get api_key)" http://127.0.0.1:${PORT}/v2/models/fraud-detector
  Embeddings: curl -s -H "Authorization: Bearer $(get api_key)" -H "Content-Type: application/json" \
                -d '{"model": "minilm", "input": "hello"}' http://127.0.0.1:${PORT}/v1/embeddings
  gRPC:       ${SWITCHYARD_GRPC_HOST}:${SWITCHYARD_GRPC_PORT}   (OIP v2: tritonclient.grpc, KServe clients)

MSG
# With Redis, several gateway processes share agents (each agent links to every one of them),
# so the web server runs one worker per CPU, at most 4; the embedded default's in-memory channel
# layer lives inside one process, so it runs one. Their metrics go to one directory, emptied
# here, so a scrape of /metrics sums them.
if [ -n "${REDIS_URL:-}" ]; then
  cpus=$(nproc)
  export WEB_WORKERS="${WEB_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}"
else
  export WEB_WORKERS=1
fi
if [ "$WEB_WORKERS" -gt 1 ] && [ -z "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
  export PROMETHEUS_MULTIPROC_DIR="$var/prometheus"
fi
if [ -n "${PROMETHEUS_MULTIPROC_DIR:-}" ]; then
  rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
fi

# Agent replicas the autoscaler started run in their own sessions: stop them when we stop.
trap '$PY manage.py stop_local_agents' EXIT
# Not exec: the trap above runs once supervisord has stopped its programs (Ctrl-C, SIGTERM).
.venv/bin/supervisord -c deploy/supervisord.conf
