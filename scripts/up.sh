#!/usr/bin/env bash
# Start the whole platform on the embedded default (or on DATABASE_URL/REDIS_URL when set):
# the ASGI server (web UI, admin, API, OIP v2, agent websocket), a Celery worker and beat, and
# one local serving agent. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-8000}"
# honcho hands every process its own $PORT, so the platform's port travels under another name.
export SWITCHYARD_PORT="$PORT"
PY=.venv/bin/python

$PY manage.py migrate --noinput -v0
$PY manage.py bootstrap_demo > var/bootstrap.log
creds=var/demo.json
get() { $PY -c "import json,sys; print(json.load(open('$creds'))[sys.argv[1]])" "$1"; }
get node_token > var/node-token
chmod 600 var/node-token

cat <<MSG

  Switchyard is starting on http://127.0.0.1:${PORT}
  Web UI:     http://127.0.0.1:${PORT}/   sign in as
                engineer / $(get engineer_password)   (engineer: canaries, promotion requests)
                admin / $(get admin_password)   (approver and Django admin at /admin/)
  API docs:   http://127.0.0.1:${PORT}/api/docs/
  Demo key:   $(get api_key)
  Try:        curl -s -H "Authorization: Bearer $(get api_key)" http://127.0.0.1:${PORT}/v2/models/fraud-detector

MSG
# Agent replicas the autoscaler started run in their own sessions: stop them when we stop.
trap '$PY manage.py stop_local_agents' EXIT
.venv/bin/honcho -f Procfile start
