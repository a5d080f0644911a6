#!/usr/bin/env bash
# The team's MLflow tracking service on one machine (docs/tracking-server.md):
#   PostgreSQL (runs and accounts) <- mlflow server (basic-auth, artifacts proxied to S3)
#   <- caddy (TLS, the only open port); supervisord keeps all three running.
#
#   bash server/tracking.sh start          # create (first time), start, print what clients set
#   bash server/tracking.sh stop           # stop all of it (the data stays)
#   bash server/tracking.sh status         # each part: RUNNING, its pid, its uptime
#   bash server/tracking.sh add-user NAME  # an account; prints its password once
#   bash server/tracking.sh grant NAME EXPERIMENT [READ|EDIT|MANAGE]  # rights on another's (EDIT)
#   bash server/tracking.sh backup FOLDER  # both databases, pg_dump's custom format
#   bash server/tracking.sh restore FOLDER # a backup into this service (replacing what it holds)
#   bash server/tracking.sh upgrade        # after a new MLflow: migrate the database, restart
#   bash server/tracking.sh run            # start in the foreground (server/mlflow-tracking.service)
#
# Settings (environment variables):
#   TRACKING_DATA       folder of the database, keys, certificates and logs ($HOME/mlflow-tracking)
#   TRACKING_HOST       the name clients reach this machine by (hostname -f)
#   TRACKING_PORT       the HTTPS port clients use (8443)
#   TRACKING_ARTIFACTS  where artifacts go, s3://bucket/prefix (required)
#   MLFLOW_S3_ENDPOINT_URL, AWS_*: the bucket's endpoint and credentials, for the server only
#   TRACKING_WORKERS    mlflow server worker processes (4)
#   PG_BIN              the folder of PostgreSQL's programs (Debian's newest)
#   MLFLOW_AUTH_ADMIN_PASSWORD  the admin's password (12+ characters); needed by the first start,
#                       add-user and grant; never written to a file
#   TRACKING_USER_PASSWORD  add-user: the new account's password (default: a random one)
set -euo pipefail

SERVER_DIR=$(cd "$(dirname "$0")" && pwd)
DATA=${TRACKING_DATA:-$HOME/mlflow-tracking}
HOST=${TRACKING_HOST:-$(hostname -f)}
PORT=${TRACKING_PORT:-8443}
WORKERS=${TRACKING_WORKERS:-4}
# PostgreSQL's programs: Debian's newest (apt-get install postgresql), or PG_BIN
PG_BIN=${PG_BIN:-$(find /usr/lib/postgresql -path '*/bin/postgres' 2>/dev/null | sort -V | tail -1 | xargs -r dirname || true)}
SUPERVISOR_CONF=$DATA/supervisord.conf
CA_CERT=$DATA/ca.crt

die() {
    echo "Error: $*" >&2
    exit 1
}

# PostgreSQL refuses to run as root: as root its processes run as the `postgres` user.
pg_user() {
    if [ "$(id -u)" = 0 ]; then echo postgres; else id -un; fi
}

as_pg_user() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# The one place a setting lands in a file: $DATA/settings.env (no secrets), read back by `run`,
# `stop`, `status` and `add-user`, so they act on the service `start` created.
save_settings() {
    printf 'HOST=%q\nPORT=%q\nWORKERS=%q\nARTIFACTS=%q\nMLFLOW_PORT=%q\n' \
        "$HOST" "$PORT" "$WORKERS" "$ARTIFACTS" "$MLFLOW_PORT" >"$DATA/settings.env"
}

load_settings() {
    [ -f "$DATA/settings.env" ] || die "no tracking service in $DATA: run 'bash server/tracking.sh start' (or set TRACKING_DATA to its folder)"
    # shellcheck source=/dev/null
    . "$DATA/settings.env"
}

free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# First start only: the folder, a PostgreSQL cluster with the two databases, the Flask secret key.
create() {
    [ -n "${TRACKING_ARTIFACTS:-}" ] || die "TRACKING_ARTIFACTS is not set: set it to the bucket the server keeps artifacts in, e.g. TRACKING_ARTIFACTS=s3://team-bucket/mlflow"
    local admin_password=${MLFLOW_AUTH_ADMIN_PASSWORD:-}
    [ "${#admin_password}" -ge 12 ] || die "MLFLOW_AUTH_ADMIN_PASSWORD is not set or under 12 characters: set the admin's password in the environment of the first start (it is never written to a file)"
    check_bucket_credentials "$TRACKING_ARTIFACTS"
    mkdir -p "$DATA/logs"
    chmod 711 "$DATA" # PostgreSQL's user may pass through to its own folders, not list the rest
    as_pg_user test -x "$DATA" || die "user $(pg_user) cannot reach $DATA (PostgreSQL runs as it): choose a TRACKING_DATA whose parent folders it may enter (chmod o+x)"
    (umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' >"$DATA/flask-secret-key")
    mkdir -p "$DATA/postgres" "$DATA/postgres-socket"
    chown "$(pg_user)" "$DATA/postgres" "$DATA/postgres-socket"
    chmod 700 "$DATA/postgres" "$DATA/postgres-socket"
    as_pg_user "$PG_BIN/initdb" -D "$DATA/postgres" -U postgres --auth-local=trust --auth-host=reject >"$DATA/logs/initdb.log"
    as_pg_user "$PG_BIN/pg_ctl" -D "$DATA/postgres" -l "$DATA/postgres/first-start.log" -w start \
        -o "-c listen_addresses='' -k $DATA/postgres-socket" >/dev/null
    for database in mlflow mlflow_auth; do
        as_pg_user "$PG_BIN/createdb" -h "$DATA/postgres-socket" -U postgres "$database"
    done
    as_pg_user "$PG_BIN/pg_ctl" -D "$DATA/postgres" -w stop >/dev/null
    ARTIFACTS=$TRACKING_ARTIFACTS
    MLFLOW_PORT=$(free_port)
    save_settings
}

# The configuration files, rewritten at each start from settings.env and the templates here.
render() {
    local database="postgresql+psycopg2://postgres@/mlflow?host=$DATA/postgres-socket"
    sed -e "s|@DATABASE@|postgresql+psycopg2://postgres@/mlflow_auth?host=$DATA/postgres-socket|" \
        "$SERVER_DIR/basic_auth.ini" >"$DATA/basic_auth.ini"
    sed -e "s|@HOST@|$HOST|g" -e "s|@PORT@|$PORT|g" -e "s|@MLFLOW_PORT@|$MLFLOW_PORT|g" \
        -e "s|@DATA@|$DATA|g" "$SERVER_DIR/Caddyfile" >"$DATA/Caddyfile"
    sed -e "s|@DATA@|$DATA|g" -e "s|@PG_BIN@|$PG_BIN|g" -e "s|@PG_USER@|$(pg_user)|g" \
        -e "s|@SERVER_DIR@|$SERVER_DIR|g" \
        "$SERVER_DIR/supervisord.conf" >"$SUPERVISOR_CONF"
    printf '%s\n' "$database" >"$DATA/database-uri"
}

# The server writes artifacts with the credentials of the environment it starts in: started
# without them it would serve, then answer every upload with HTTP 500.
check_bucket_credentials() {
    case "$1" in s3://*) ;; *) return 0 ;; esac
    python -c 'import sys, boto3; sys.exit(boto3.Session().get_credentials() is None)' \
        || die "no credentials for the bucket of $1 in this environment: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or give the VM a role), and MLFLOW_S3_ENDPOINT_URL for an S3-compatible store, as at the first start"
}

# A setting given again after the first start is not applied: say so, once each.
say_kept_settings() {
    local name given kept
    for name in HOST PORT WORKERS ARTIFACTS; do
        given=$(printenv "TRACKING_$name" || true)
        kept=${!name}
        if [ -n "$given" ] && [ "$given" != "$kept" ]; then
            echo "Note: TRACKING_$name=$given is not applied: this service keeps $kept from its first start (to change it: stop, edit $DATA/settings.env, start)." >&2
        fi
    done
}

prepare() {
    [ -x "$PG_BIN/postgres" ] || die "PostgreSQL is not installed: apt-get install postgresql (or set PG_BIN to the folder of its postgres program)"
    command -v caddy >/dev/null || die "caddy is not installed: apt-get install caddy"
    command -v supervisord >/dev/null || die "supervisord is not on PATH: pip install -e '.[server]' -c constraints.txt in the environment on PATH"
    if [ -f "$DATA/settings.env" ]; then
        load_settings
        say_kept_settings
        check_bucket_credentials "$ARTIFACTS"
    else
        create
        load_settings
    fi
    render
}

# supervisord's `mlflow` program. A SIGKILLed `mlflow server` leaves its uvicorn processes
# holding the port; they are in the process group of the one before, which is ended first.
serve_mlflow() {
    load_settings
    if [ -f "$DATA/mlflow.pgid" ]; then kill -KILL -- "-$(cat "$DATA/mlflow.pgid")" 2>/dev/null || true; fi
    echo $$ >"$DATA/mlflow.pgid"
    MLFLOW_FLASK_SERVER_SECRET_KEY=$(cat "$DATA/flask-secret-key")
    export MLFLOW_FLASK_SERVER_SECRET_KEY
    export MLFLOW_AUTH_CONFIG_PATH=$DATA/basic_auth.ini
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false # tracking only: no GenAI job runners
    exec mlflow server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers "$WORKERS" \
        --backend-store-uri "$(cat "$DATA/database-uri")" \
        --artifacts-destination "$ARTIFACTS" \
        --app-name basic-auth \
        --allowed-hosts "$HOST:$PORT,$HOST" --cors-allowed-origins "https://$HOST:$PORT" \
        --uvicorn-opts "--timeout-keep-alive 120"
}

# Until the service answers through TLS (or 120 s): supervisord retries a part that fails.
wait_until_up() {
    local deadline=$((SECONDS + 120))
    until [ -f "$CA_CERT" ] && curl -sf --cacert "$CA_CERT" -o /dev/null "https://$HOST:$PORT/health"; do
        if [ $SECONDS -ge $deadline ]; then
            supervisorctl -c "$SUPERVISOR_CONF" status >&2 || true
            die "the service did not answer https://$HOST:$PORT/health in 120 s: see $DATA/logs"
        fi
        # caddy makes its certificate authority at its first start; clients get a copy of its root,
        # whole or not at all (a client reading it while cp writes would find no certificate)
        if [ -f "$DATA/caddy/pki/authorities/local/root.crt" ]; then
            cp "$DATA/caddy/pki/authorities/local/root.crt" "$CA_CERT.tmp" && mv "$CA_CERT.tmp" "$CA_CERT"
        fi
        sleep 1
    done
}

start() {
    prepare
    if [ -S "$DATA/supervisor.sock" ] && supervisorctl -c "$SUPERVISOR_CONF" pid >/dev/null 2>&1; then
        echo "Already running (bash server/tracking.sh status)."
    else
        supervisord -c "$SUPERVISOR_CONF"
    fi
    wait_until_up
    cat <<EOF
MLflow tracking service: https://$HOST:$PORT (data: $DATA)
Each client (copy $CA_CERT to it) sets:
  export MLFLOW_TRACKING_SERVER_CERT_PATH=$CA_CERT
  export MLFLOW_TRACKING_USERNAME=<name from add-user>
  export MLFLOW_TRACKING_PASSWORD=<its password>
  python -m src.train logger.tracking_uri=https://$HOST:$PORT
EOF
}

stop() {
    load_settings
    local pid
    pid=$(cat "$DATA/supervisord.pid" 2>/dev/null || true)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        echo "Not running."
        return
    fi
    supervisorctl -c "$SUPERVISOR_CONF" shutdown >/dev/null
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    echo "Stopped (the data stays in $DATA)."
}

# The Python program on standard input, signed in to the service as the admin (for COMMAND,
# which the refusal names). Passwords travel in the environment, never on a command line (ps
# shows those).
as_admin() {
    [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ] || die "MLFLOW_AUTH_ADMIN_PASSWORD is not set: $1 signs in as the admin; set it in the environment"
    MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD=$MLFLOW_AUTH_ADMIN_PASSWORD \
        MLFLOW_TRACKING_SERVER_CERT_PATH=$CA_CERT TRACKING_URL="https://$HOST:$PORT" \
        python -W ignore -
}

add_user() {
    local name=$1
    [ -n "$name" ] || die "add-user needs the account's name: bash server/tracking.sh add-user NAME"
    load_settings
    local password=${TRACKING_USER_PASSWORD:-$(python -c 'import secrets; print(secrets.token_urlsafe(18))')}
    NEW_USER=$name NEW_PASSWORD=$password as_admin add-user <<'PY' || exit 1
import os
import sys

from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient

try:
    AuthServiceClient(os.environ["TRACKING_URL"]).create_user(
        os.environ["NEW_USER"], os.environ["NEW_PASSWORD"]
    )
except MlflowException as error:
    sys.exit(f"Error: the server refused the account: {error.message.splitlines()[0]}")
PY
    echo "Account $name created on https://$HOST:$PORT (it may create experiments of its own and read others'; to write into another's: grant)."
    if [ -z "${TRACKING_USER_PASSWORD:-}" ]; then echo "Its password (shown once, give it to $name): $password"; fi
}

# An account's rights on an experiment it does not own, as the admin (MLflow's REST API:
# a permission already given is replaced).
grant() {
    local name=$1 experiment=$2 permission=${3:-EDIT}
    [ -n "$name" ] && [ -n "$experiment" ] || die "grant needs an account and an experiment: bash server/tracking.sh grant NAME EXPERIMENT [READ|EDIT|MANAGE]"
    case "$permission" in READ | EDIT | MANAGE) ;; *) die "grant: $permission is not a permission: READ, EDIT (write runs) or MANAGE (also grant)" ;; esac
    load_settings
    ACCOUNT=$name EXPERIMENT=$experiment PERMISSION=$permission as_admin grant <<'PY' || exit 1
import contextlib
import os
import sys

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient

url, name = os.environ["TRACKING_URL"], os.environ["EXPERIMENT"]
try:
    found = MlflowClient(url).get_experiment_by_name(name)
    if found is None:
        sys.exit(f"Error: {url} has no experiment {name}: give the name jobs log into")
    accounts = AuthServiceClient(url)
    account, experiment_id = os.environ["ACCOUNT"], found.experiment_id
    with contextlib.suppress(MlflowException):  # none given yet
        accounts.revoke_user_permission(account, "experiment", experiment_id)
    accounts.grant_user_permission(account, "experiment", experiment_id, os.environ["PERMISSION"])
except MlflowException as error:
    sys.exit(f"Error: the server refused the grant: {error.message.splitlines()[0]}")
PY
    echo "$name has $permission on experiment $experiment of https://$HOST:$PORT."
}

# Both databases (runs, accounts) while the service runs, for `restore`. The accounts' dump
# holds password hashes: the files are the owner's only.
backup() {
    local folder=$1
    [ -n "$folder" ] || die "backup needs a folder: bash server/tracking.sh backup FOLDER"
    load_settings
    (umask 077 && mkdir -p "$folder")
    for database in mlflow mlflow_auth; do
        (umask 077 && "$PG_BIN/pg_dump" -h "$DATA/postgres-socket" -U postgres -Fc -f "$folder/$database.dump" "$database")
    done
    echo "Backed up to $folder/mlflow.dump and $folder/mlflow_auth.dump (the artifacts are in $ARTIFACTS)."
}

# A backup into this running service (a new VM: start, then restore): both databases replaced,
# with the MLflow server stopped meanwhile so that no request sees half of them.
restore() {
    local folder=$1
    [ -n "$folder" ] || die "restore needs the folder of a backup: bash server/tracking.sh restore FOLDER"
    [ -f "$folder/mlflow.dump" ] && [ -f "$folder/mlflow_auth.dump" ] || die "$folder holds no backup (mlflow.dump and mlflow_auth.dump): give the folder 'backup' wrote"
    load_settings
    supervisorctl -c "$SUPERVISOR_CONF" status postgres >/dev/null 2>&1 || die "the service is not running: bash server/tracking.sh start, then restore"
    supervisorctl -c "$SUPERVISOR_CONF" stop mlflow >/dev/null
    for database in mlflow mlflow_auth; do
        "$PG_BIN/pg_restore" -h "$DATA/postgres-socket" -U postgres --clean --if-exists \
            --single-transaction -d "$database" "$folder/$database.dump" \
            || die "restoring $database failed (above); the server stays stopped: fix the cause and run restore again"
    done
    supervisorctl -c "$SUPERVISOR_CONF" start mlflow >/dev/null || die "the server did not start: see $DATA/logs/mlflow.log"
    wait_until_up
    echo "Restored $folder into https://$HOST:$PORT (the accounts and passwords are the backup's)."
}

# After installing a new MLflow: its schema migrations on the runs database (the accounts
# database migrates itself when the server starts), with the server stopped meanwhile.
upgrade() {
    load_settings
    supervisorctl -c "$SUPERVISOR_CONF" stop mlflow >/dev/null
    PYTHONWARNINGS=ignore mlflow db upgrade "$(cat "$DATA/database-uri")" \
        || die "the database migration failed (above); the server stays stopped: restore the backup into it (docs/tracking-server.md), or fix the cause and run upgrade again"
    supervisorctl -c "$SUPERVISOR_CONF" start mlflow >/dev/null \
        || die "the upgraded server did not start: see $DATA/logs/mlflow.log"
    wait_until_up
    echo "Upgraded: mlflow $(mlflow --version | awk '{print $NF}') serves https://$HOST:$PORT."
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) load_settings && supervisorctl -c "$SUPERVISOR_CONF" status ;;
add-user) add_user "${2:-}" ;;
grant) grant "${2:-}" "${3:-}" "${4:-}" ;;
backup) backup "${2:-}" ;;
restore) restore "${2:-}" ;;
upgrade) upgrade ;;
run) prepare && exec supervisord -n -c "$SUPERVISOR_CONF" ;;
serve-mlflow) serve_mlflow ;;
*) die "usage: bash server/tracking.sh start|stop|status|add-user NAME|grant NAME EXPERIMENT|backup FOLDER|restore FOLDER|upgrade|run" ;;
esac
