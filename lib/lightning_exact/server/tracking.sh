#!/usr/bin/env bash
# The team's MLflow tracking service on one machine (docs/tracking-server.md):
#   PostgreSQL (runs and accounts) <- mlflow server (basic-auth, artifacts proxied to S3, on a
#   Unix socket) <- caddy (TLS, the only open port); supervisord keeps all three running, as the
#   service's own user.
#
# python -m lightning_exact.server COMMAND runs this script with its arguments:
#   start             create (first time), start, print what clients set
#   stop              stop all of it (the data stays)
#   status            each part: RUNNING, its pid, its uptime
#   add-user NAME     an account; prints its password once
#   grant NAME EXPERIMENT [READ|EDIT|MANAGE|NONE]   rights on another's experiment
#   grant others EXPERIMENT NONE|READ               private (or readable again)
#   backup FOLDER     both databases, pg_dump's custom format (an absolute folder of the
#                     caller's own)
#   restore FOLDER    a backup into this service (replacing what it holds)
#   upgrade           after a new MLflow: migrate the database, restart
#   run               start in the foreground (mlflow-tracking.service)
#
# Settings (environment variables):
#   TRACKING_DATA       folder of the database, keys, certificates and logs (as root:
#                       /var/lib/mlflow-tracking; otherwise $HOME/mlflow-tracking)
#   TRACKING_HOST       the name clients reach this machine by (hostname -f)
#   TRACKING_PORT       the HTTPS port clients use (443; started as root, one under 1024: a
#                       port any local user may bind could be taken while caddy restarts)
#   TRACKING_ARTIFACTS  where artifacts go, s3://bucket/prefix (required; a bucket, not a folder
#                       of this machine)
#   MLFLOW_S3_ENDPOINT_URL, AWS_*: the bucket's endpoint and credentials, for the server only
#   TRACKING_WORKERS    mlflow server worker processes (4)
#   TRACKING_UPLOAD_MB  the largest artifact upload, in MiB (1024); started as root, the MLflow
#                       server spools transfers in a file system of its own, twice that size
#   TRACKING_SERVICE_USER  started as root: the system user the service runs as (mlflow-tracking,
#                       made if missing); started by another user, the service is that user's
#   PG_BIN              the folder of PostgreSQL's programs (Debian's newest)
#   MLFLOW_AUTH_ADMIN_PASSWORD  the admin's password (12+ characters); needed by the first start
#                       only; never written to a file, never given to the service
#   TRACKING_USER_PASSWORD  add-user: the new account's password (default: a random one)
set -euo pipefail
umask 077 # every file this script writes is its owner's only

SERVER_DIR=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" = 0 ]; then DEFAULT_DATA=/var/lib/mlflow-tracking; else DEFAULT_DATA=$HOME/mlflow-tracking; fi
DATA=${TRACKING_DATA:-$DEFAULT_DATA}
DATA=${DATA%/}
SERVICE_USER=${TRACKING_SERVICE_USER:-mlflow-tracking}
HOST=${TRACKING_HOST:-$(hostname -f)}
PORT=${TRACKING_PORT:-443}
WORKERS=${TRACKING_WORKERS:-4}
UPLOAD_MB=${TRACKING_UPLOAD_MB:-1024}
# PostgreSQL's programs: Debian's newest (apt-get install postgresql), or PG_BIN
PG_BIN=${PG_BIN:-$(find /usr/lib/postgresql -path '*/bin/postgres' 2>/dev/null | sort -V | tail -1 | xargs -r dirname || true)}
SUPERVISOR_CONF=$DATA/supervisord.conf
# PostgreSQL's, the MLflow server's and supervisord's sockets: the folder is the service's only
SOCKETS=$DATA/sockets
CA_CERT=$DATA/ca.crt
# Where the MLflow server spools each artifact upload and download (its TMPDIR). Started as root,
# a file system of its own (tmpfs, twice TRACKING_UPLOAD_MB), mounted in a mount namespace of the
# service's processes only: no account's transfers can fill the disk the database is on.
SPOOL=$DATA/spool
# The passphrase MLflow encrypts AI-gateway secrets with (MLflow's default is public): the
# service's own, made at the first start, beside the data folder (root's only, as root), never in
# it nor in a backup (systemd reads it as an EnvironmentFile).
KEK_FILE=$DATA.kek
# Model versions may come from this server's runs and models only (and prompts' placeholders): a
# source naming a bucket path would be read with the server's credentials (MLflow's own check,
# off unless set).
MODEL_VERSION_SOURCES='^(runs:/|models:/|mlflow-artifacts:/|dummy-source$|prompt-template$)'

die() {
    echo "Error: $*" >&2
    exit 1
}

is_root() {
    [ "$(id -u)" = 0 ]
}

# Started as root, the service's programs and files are its own user's (switched to as systemd's
# User= does, by setpriv: no process in between); otherwise the caller's. With EXEC=exec, the
# command takes this shell's place; CAPS: capabilities it keeps (setpriv's options).
as_service() {
    if is_root; then
        # shellcheck disable=SC2086 # CAPS: setpriv's options, one word each
        ${EXEC:-} setpriv --reuid="$(id -u "$SERVICE_USER")" --regid="$(id -g "$SERVICE_USER")" \
            --init-groups ${CAPS:-} env HOME="$DATA" "$@"
    else
        ${EXEC:-} "$@"
    fi
}

# Standard input into FILE, the service's and readable by it only.
private_file() {
    as_service sh -c 'umask 077 && cat >"$1"' sh "$1"
}

# The database role MLflow signs in as owns its two databases, nothing more (no superuser).
database_uri() {
    printf 'postgresql+psycopg2://mlflow@/%s?host=%s\n' "$1" "$SOCKETS"
}

# The one origin whose pages may send requests with credentials: the service's own.
origin() {
    if [ "$PORT" = 443 ]; then echo "https://$HOST"; else echo "https://$HOST:$PORT"; fi
}

# The one place a setting lands in a file: $DATA/settings.env (no secrets), read back by `run`,
# `stop`, `status` and `add-user`, so they act on the service `start` created.
save_settings() {
    check_settings
    printf 'HOST=%s\nPORT=%s\nWORKERS=%s\nARTIFACTS=%s\nUPLOAD_MB=%s\n' "$HOST" "$PORT" "$WORKERS" \
        "$ARTIFACTS" "$UPLOAD_MB" | private_file "$DATA/settings.env"
}

# settings.env is the service's user's file, read by root's shell: read as data, never sourced
# (a line of it would run as root), each value checked before sed puts it into a configuration.
load_settings() {
    if [ -d "$DATA" ] && ! [ -x "$DATA" ]; then
        die "$DATA belongs to the service's user $(stat -c %U "$DATA"): run this command as root (sudo -i, the venv activated: python -m lightning_exact.server ...)"
    fi
    [ -f "$DATA/settings.env" ] || die "no tracking service in $DATA: run 'python -m lightning_exact.server start' (or set TRACKING_DATA to its folder)"
    local line name
    while IFS= read -r line || [ -n "$line" ]; do
        name=${line%%=*}
        case "$name" in
        HOST | PORT | WORKERS | ARTIFACTS | UPLOAD_MB) printf -v "$name" '%s' "${line#*=}" ;;
        *) die "$DATA/settings.env has a line that is not HOST, PORT, WORKERS, ARTIFACTS or UPLOAD_MB=value: remove it" ;;
        esac
    done <"$DATA/settings.env"
    check_settings
}

check_settings() {
    [[ $HOST =~ ^[A-Za-z0-9.-]+$ ]] || die "the host name '$HOST' is not one (letters, digits, dots, dashes): set TRACKING_HOST, or edit $DATA/settings.env"
    [[ $PORT =~ ^[1-9][0-9]{0,4}$ ]] || die "the port '$PORT' is not a number: set TRACKING_PORT, or edit $DATA/settings.env"
    [[ $WORKERS =~ ^[1-9][0-9]{0,2}$ ]] || die "TRACKING_WORKERS '$WORKERS' is not a number of workers, or edit $DATA/settings.env"
    [[ $UPLOAD_MB =~ ^[1-9][0-9]{0,6}$ ]] || die "TRACKING_UPLOAD_MB '$UPLOAD_MB' is not a size in MiB (the largest upload, e.g. 1024), or edit $DATA/settings.env"
    check_artifacts "$ARTIFACTS"
}

# A bucket (s3://, gs://, ...), never a folder of this machine: a local user's folder there would
# let the server follow that user's links into its own files.
check_artifacts() {
    [[ $1 =~ ^(s3|gs|wasbs|abfss|oci|hdfs)://[A-Za-z0-9._-]+(/[A-Za-z0-9._/-]*)?$ ]] \
        || die "TRACKING_ARTIFACTS=$1 is not a bucket: set it to the bucket the server keeps artifacts in, e.g. TRACKING_ARTIFACTS=s3://team-bucket/mlflow (a folder of this machine is refused: the server would follow a local user's links there into its own files)"
}

# Started as root, caddy's port is one only root may bind (under 1024): a port any local user may
# bind could be taken while caddy restarts, and the service kept down.
check_port_is_privileged() {
    local unprivileged
    unprivileged=$(cat /proc/sys/net/ipv4/ip_unprivileged_port_start 2>/dev/null || echo 1024)
    [ "$PORT" -lt "$unprivileged" ] || die "port $PORT may be bound by any local user (this machine lets every user bind ports from $unprivileged up), who could take it while caddy restarts: choose a port under $unprivileged, e.g. TRACKING_PORT=443 (kept from the first start: stop, edit $DATA/settings.env, start)"
}

# A data folder made before the service had a user and a socket of its own (MLflow on a TCP
# port, as the database's superuser) is not started as it is: its data moves by backup/restore.
refuse_earlier_layout() {
    if [ -f "$DATA/settings.env" ] && grep -q '^MLFLOW_PORT=' "$DATA/settings.env"; then
        die "$DATA was made by an earlier tracking.sh (MLflow on a TCP port, as PostgreSQL's superuser): move its data to a new service: backup, stop, start one in a new TRACKING_DATA, restore (docs/tracking-server.md: Upgrades)"
    fi
}

# Started as root: the system user the service runs as, made the first time.
ensure_service_user() {
    id -u "$SERVICE_USER" >/dev/null 2>&1 && return
    useradd --system --user-group --home-dir /var/lib/mlflow-tracking --no-create-home \
        --shell /usr/sbin/nologin "$SERVICE_USER"
}

# Started as root: the service's user must enter the folders above the data, this project and
# the Python environment's interpreter (a pyenv under /root is closed to it, for one).
check_service_user_reaches() {
    local path closed folders=()
    for path in "$(dirname "$DATA")" "$SERVER_DIR" "$(dirname "$(readlink -f "$(command -v python)")")"; do
        while [ "$path" != / ]; do # from the top down: the first closed folder is named
            folders=("$path" "${folders[@]}")
            path=$(dirname "$path")
        done
    done
    # (a folder not made yet is made by `start`, enterable)
    closed=$(as_service bash -c 'for d; do test -e "$d" || continue; test -x "$d" || { echo "$d"; exit; }; done' _ "${folders[@]}")
    [ -z "$closed" ] || die "the service's user $SERVICE_USER cannot enter $closed (above the data folder, this project or its Python): install the project and its virtual environment where that user may read them, e.g. /opt (docs/tracking-server.md), or let it pass: setfacl -m u:$SERVICE_USER:x $closed"
}

# Started as root on a data folder of another user: the settings would not be its.
check_data_owner() {
    local owner
    owner=$(stat -c %U "$DATA")
    [ "$owner" = "$SERVICE_USER" ] || die "$DATA belongs to $owner, not to the service's user $SERVICE_USER: set TRACKING_SERVICE_USER=$owner, or choose another TRACKING_DATA"
}

# First start only, before anything is made: what it needs from this shell.
check_first_start_settings() {
    [ -n "${TRACKING_ARTIFACTS:-}" ] || die "TRACKING_ARTIFACTS is not set: set it to the bucket the server keeps artifacts in, e.g. TRACKING_ARTIFACTS=s3://team-bucket/mlflow"
    check_artifacts "$TRACKING_ARTIFACTS"
    if is_root; then check_port_is_privileged; fi
    local admin_password=${MLFLOW_AUTH_ADMIN_PASSWORD:-}
    [ "${#admin_password}" -ge 12 ] || die "MLFLOW_AUTH_ADMIN_PASSWORD is not set or under 12 characters: set the admin's password in the environment of the first start (it is never written to a file)"
    check_bucket_credentials "$TRACKING_ARTIFACTS"
}

# First start only: the folder, a PostgreSQL cluster with MLflow's role and its two databases, the
# Flask secret key, the admin account.
create() {
    if [ -d "$DATA" ] && [ -n "$(ls -A "$DATA")" ]; then
        die "$DATA holds files but no tracking service (no settings.env): set TRACKING_DATA to a new or empty folder"
    fi
    trap undo_create EXIT
    (umask 022 && mkdir -p "$DATA") # the folders above stay enterable
    chmod 700 "$DATA"
    if is_root; then chown "$SERVICE_USER:" "$DATA"; fi
    as_service mkdir -m 700 "$DATA/logs" "$DATA/postgres" "$SOCKETS" "$SPOOL"
    python -c 'import secrets; print(secrets.token_hex(32))' | private_file "$DATA/flask-secret-key"
    as_service "$PG_BIN/initdb" -D "$DATA/postgres" -U postgres --auth-local=trust --auth-host=reject \
        | private_file "$DATA/logs/initdb.log"
    as_service "$PG_BIN/pg_ctl" -D "$DATA/postgres" -l "$DATA/logs/first-start.log" -w start \
        -o "-c listen_addresses='' -k $SOCKETS -c unix_socket_permissions=0700" >/dev/null
    as_service "$PG_BIN/psql" -h "$SOCKETS" -U postgres -d postgres -q -v ON_ERROR_STOP=1 <<'SQL'
CREATE ROLE mlflow LOGIN;
CREATE DATABASE mlflow OWNER mlflow;
CREATE DATABASE mlflow_auth OWNER mlflow;
REVOKE ALL ON DATABASE postgres, template1 FROM PUBLIC;
SQL
    ARTIFACTS=$TRACKING_ARTIFACTS
    save_settings
    render
    # The admin's account, made here: the service itself never holds the admin's password.
    MLFLOW_AUTH_CONFIG_PATH=$DATA/basic_auth.ini as_service python -W ignore \
        -c 'from mlflow.server.auth import bootstrap_admin_user; bootstrap_admin_user()' 2>&1 \
        | private_file "$DATA/logs/first-start-accounts.log" \
        || die "the admin's account could not be made: see $DATA/logs/first-start-accounts.log"
    as_service "$PG_BIN/pg_ctl" -D "$DATA/postgres" -w stop >/dev/null
    trap - EXIT
}

# A first start that failed leaves nothing behind: PostgreSQL stopped, the data folder empty.
undo_create() {
    as_service "$PG_BIN/pg_ctl" -D "$DATA/postgres" -m fast -w stop >/dev/null 2>&1 || true
    find "$DATA" -mindepth 1 -delete
}

# The configuration files, rewritten at each start from settings.env and the templates here.
# PostgreSQL: peer authentication, root and the service's user as MLflow's role only (no one signs
# in as the cluster's superuser after the first start).
render() {
    printf 'local all all peer map=tracking\n' | private_file "$DATA/postgres/pg_hba.conf"
    printf 'tracking %s mlflow\n' root "$(as_service id -un)" | private_file "$DATA/postgres/pg_ident.conf"
    sed -e "s|@DATABASE@|$(database_uri mlflow_auth)|" "$SERVER_DIR/basic_auth.ini" \
        | private_file "$DATA/basic_auth.ini"
    sed -e "s|@HOST@|$HOST|g" -e "s|@PORT@|$PORT|g" -e "s|@ORIGIN@|$(origin)|g" \
        -e "s|@SOCKETS@|$SOCKETS|g" -e "s|@UPLOAD_MB@|$UPLOAD_MB|g" \
        -e "s|@UPLOAD_BYTES@|$((UPLOAD_MB * 1048576))|g" "$SERVER_DIR/Caddyfile" \
        | private_file "$DATA/Caddyfile"
    sed -e "s|@DATA@|$DATA|g" -e "s|@SOCKETS@|$SOCKETS|g" -e "s|@PG_BIN@|$PG_BIN|g" \
        -e "s|@CADDY@|$(command -v caddy)|g" -e "s|@SERVER_DIR@|$SERVER_DIR|g" \
        -e "s|@SETPRIV@|$(command -v setpriv)|g" \
        "$SERVER_DIR/supervisord.conf" | private_file "$SUPERVISOR_CONF"
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
    for name in HOST PORT WORKERS ARTIFACTS UPLOAD_MB; do
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
    refuse_earlier_layout
    if ! [ -f "$DATA/settings.env" ]; then check_first_start_settings; fi
    if is_root; then
        ensure_service_user
        check_service_user_reaches
    fi
    if [ -f "$DATA/settings.env" ]; then
        if is_root; then check_data_owner; fi
        load_settings
        if is_root; then check_port_is_privileged; fi
        say_kept_settings
        check_bucket_credentials "$ARTIFACTS"
    else
        create
        load_settings
    fi
    as_service mkdir -p -m 700 "$SPOOL" # a data folder made before it had one
    passphrase
    render
}

# A file root's (or the caller's) tools trust: a regular file, not a link, the caller's own,
# no one else's to write.
own_file() {
    [ -f "$1" ] && ! [ -L "$1" ] && [ "$(stat -c %u "$1")" = "$(id -u)" ] \
        && ! (($(stat -c '0%a' "$1") & 8#022))
}

# MLFLOW_CRYPTO_KEK_PASSPHRASE for the MLflow server: systemd's (its EnvironmentFile is the
# file below), or the file's, made at the first start that lacks it (noclobber: a link planted at
# its name is not followed). A service whose database already holds AI-gateway secrets, made
# under MLflow's default passphrase, keeps reading them only with that: docs/tracking-server.md.
passphrase() {
    if [ -n "${MLFLOW_CRYPTO_KEK_PASSPHRASE:-}" ]; then return; fi
    if ! [ -e "$KEK_FILE" ] && ! [ -L "$KEK_FILE" ]; then
        (set -o noclobber && umask 077 \
            && python -c 'import secrets; print("MLFLOW_CRYPTO_KEK_PASSPHRASE=" + secrets.token_hex(32))' >"$KEK_FILE") \
            || die "could not write $KEK_FILE (the service's key-encryption passphrase)"
    fi
    own_file "$KEK_FILE" && [ "$(stat -c %a "$KEK_FILE")" = 600 ] \
        || die "$KEK_FILE is not $(id -un)'s own file, mode 600 (it holds the passphrase of the AI-gateway secrets): remove it if you did not make it, or chmod 600 it"
    MLFLOW_CRYPTO_KEK_PASSPHRASE=$(sed -n 's/^MLFLOW_CRYPTO_KEK_PASSPHRASE=//p' "$KEK_FILE")
    [ -n "$MLFLOW_CRYPTO_KEK_PASSPHRASE" ] || die "$KEK_FILE has no MLFLOW_CRYPTO_KEK_PASSPHRASE= line: restore it from its copy (docs/tracking-server.md: Backups)"
    export MLFLOW_CRYPTO_KEK_PASSPHRASE
}

# Started as root, supervisord and what it starts run in a mount namespace of their own, where the
# spool folder is a tmpfs of twice TRACKING_UPLOAD_MB (gone with the service); otherwise the
# spool is a folder of the data's disk, unless systemd mounted one there (the unit's
# TemporaryFileSystem=), and start says so.
spooled() {
    if is_root; then
        local size=$((2 * UPLOAD_MB))m owner
        owner="uid=$(id -u "$SERVICE_USER"),gid=$(id -g "$SERVICE_USER")"
        # shellcheck disable=SC2016 # the inner shell expands them
        ${EXEC:-} unshare --mount --propagation private -- sh -c \
            'mount -t tmpfs -o "size=$1,mode=0700,$2,nosuid,nodev,noexec" tracking-spool "$3" && shift 3 && exec "$@"' \
            sh "$size" "$owner" "$SPOOL" "$@"
    else
        if ! findmnt --mountpoint "$SPOOL" >/dev/null 2>&1; then
            echo "Note: not started as root: the MLflow server spools artifact transfers in $SPOOL, on the data's disk, which an account's uploads can fill (start as root, or with the systemd unit: docs/tracking-server.md)." >&2
        fi
        ${EXEC:-} "$@"
    fi
}

# supervisord, as the service's user; `foreground` (systemd's unit): in place of this shell, so
# that systemd's signals reach it. It and the MLflow server get, of this shell's environment, the
# bucket's settings (AWS_*, MLFLOW_S3_*) and proxies, nothing else (the admin's password, a
# login of this shell's): `env -u NAME` for every other variable, so no value is on a command
# line. PostgreSQL and caddy start with an empty environment (supervisord.conf).
supervise() {
    local name unset=()
    for name in $(compgen -e); do
        case "$name" in
        PATH | LANG | LC_* | TZ | AWS_* | MLFLOW_S3_* | MLFLOW_CRYPTO_KEK_PASSPHRASE | \
            [Hh][Tt][Tt][Pp]_[Pp][Rr][Oo][Xx][Yy] | \
            [Hh][Tt][Tt][Pp][Ss]_[Pp][Rr][Oo][Xx][Yy] | [Nn][Oo]_[Pp][Rr][Oo][Xx][Yy]) ;;
        *) unset+=(-u "$name") ;;
        esac
    done
    local supervisord=(env "${unset[@]}" HOME="$DATA" TRACKING_DATA="$DATA" "$(command -v supervisord)" -c "$SUPERVISOR_CONF")
    # as root: the service's user (as as_service switches), with one capability, to bind caddy's
    # privileged port (PostgreSQL and MLflow drop it)
    local switch=()
    if is_root; then
        switch=(setpriv --reuid="$(id -u "$SERVICE_USER")" --regid="$(id -g "$SERVICE_USER")"
            --init-groups --inh-caps=+net_bind_service --ambient-caps=+net_bind_service)
    fi
    if [ "${1:-}" = foreground ]; then
        EXEC=exec spooled "${switch[@]}" "${supervisord[@]}" -n
    fi
    spooled "${switch[@]}" "${supervisord[@]}"
}

# supervisord's `mlflow` program. A SIGKILLed `mlflow server` leaves its uvicorn processes
# serving; they are in the process group of the one before, which is ended first, and the
# socket they bound is removed so that the new server binds it again.
serve_mlflow() {
    load_settings
    if [ -f "$DATA/mlflow.pgid" ]; then kill -KILL -- "-$(cat "$DATA/mlflow.pgid")" 2>/dev/null || true; fi
    echo $$ >"$DATA/mlflow.pgid"
    rm -f "$SOCKETS/mlflow.sock"
    # what the server before spooled (a SIGKILLed one leaves its transfers' files behind)
    find "$SPOOL" -mindepth 1 -delete
    export TMPDIR=$SPOOL
    MLFLOW_FLASK_SERVER_SECRET_KEY=$(cat "$DATA/flask-secret-key")
    export MLFLOW_FLASK_SERVER_SECRET_KEY
    export MLFLOW_AUTH_CONFIG_PATH=$DATA/basic_auth.ini
    export PYTHONPATH=$SERVER_DIR${PYTHONPATH:+:$PYTHONPATH} # tracking_auth, the sign-in it loads
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false          # tracking only: no GenAI job runners
    export MLFLOW_CREATE_MODEL_VERSION_SOURCE_VALIDATION_REGEX=$MODEL_VERSION_SOURCES
    export MLFLOW_BASIC_AUTH_FAIL_CLOSED=true # a route without a permission rule: 403
    exec mlflow server --workers "$WORKERS" \
        --backend-store-uri "$(database_uri mlflow)" \
        --artifacts-destination "$ARTIFACTS" \
        --app-name basic-auth \
        --allowed-hosts "$HOST:$PORT,$HOST" --cors-allowed-origins "$(origin)" \
        --uvicorn-opts "--uds $SOCKETS/mlflow.sock --timeout-keep-alive 120"
}

# Until the service answers through TLS (or 120 s): supervisord retries a part that fails.
wait_until_up() {
    local deadline=$((SECONDS + 120))
    until [ -f "$CA_CERT" ] && curl -sf --cacert "$CA_CERT" -o /dev/null "https://$HOST:$PORT/health"; do
        if [ $SECONDS -ge $deadline ]; then
            control status >&2 || true
            die "the service did not answer https://$HOST:$PORT/health in 120 s: see $DATA/logs"
        fi
        # caddy makes its certificate authority at its first start; clients get a copy of its root,
        # whole or not at all (a client reading it while cp writes would find no certificate)
        if [ -f "$DATA/caddy/pki/authorities/local/root.crt" ]; then
            as_service cp "$DATA/caddy/pki/authorities/local/root.crt" "$CA_CERT.tmp"
            as_service mv "$CA_CERT.tmp" "$CA_CERT"
        fi
        sleep 1
    done
}

# supervisorctl, as the service's user: its configuration is that user's file, not read by root.
control() {
    as_service supervisorctl -c "$SUPERVISOR_CONF" "$@"
}

running() {
    [ -S "$SOCKETS/supervisor.sock" ] && control pid >/dev/null 2>&1
}

start() {
    prepare
    if running; then
        echo "Already running (python -m lightning_exact.server status)."
    else
        supervise
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

# Whether process PID runs (a zombie has ended).
alive() {
    case $(ps -o stat= -p "$1" 2>/dev/null) in "" | Z*) return 1 ;; esac
}

# supervisord's pid as supervisord itself answers it (its pid file is the service's user's to
# write): stop waits for that process, one of the service's user, to end, 120 s at most.
stop() {
    load_settings
    local pid deadline=$((SECONDS + 120))
    if ! running; then
        echo "Not running."
        return
    fi
    pid=$(control pid 2>/dev/null || true)
    if ! [[ $pid =~ ^[1-9][0-9]*$ ]] || [ "$(stat -c %u "/proc/$pid" 2>/dev/null)" != "$(as_service id -u)" ]; then
        die "supervisord answered pid '$pid', not a process of the service's user $(as_service id -un): see $DATA/logs/supervisord.log"
    fi
    control shutdown >/dev/null
    while alive "$pid"; do
        [ $SECONDS -lt $deadline ] || die "supervisord (pid $pid) did not stop in 120 s: see $DATA/logs/supervisord.log"
        sleep 0.2
    done
    echo "Stopped (the data stays in $DATA)."
}

# accounts.py COMMAND, on the accounts' database through PostgreSQL's socket (root's and
# the service's user's only): no sign-in to the service, which local users' wrong passwords could
# refuse. A password travels in the environment, never on a command line (ps shows those).
accounts() {
    load_settings
    TRACKING_URL="https://$HOST:$PORT" ACCOUNTS_DATABASE=$(database_uri mlflow_auth) \
        RUNS_DATABASE=$(database_uri mlflow) python -W ignore "$SERVER_DIR/accounts.py" "$@"
}

add_user() {
    [ -n "$1" ] || die "add-user needs the account's name: python -m lightning_exact.server add-user NAME"
    accounts add-user "$1"
}

grant() {
    local name=$1 experiment=$2 permission=${3:-EDIT}
    [ -n "$name" ] && [ -n "$experiment" ] || die "grant needs an account (or others) and an experiment: python -m lightning_exact.server grant NAME EXPERIMENT [READ|EDIT|MANAGE|NONE]"
    case "$name:$permission" in
    others:NONE | others:READ) ;;
    others:*) die "grant others takes NONE (the experiment becomes private) or READ (readable again): python -m lightning_exact.server grant others EXPERIMENT NONE" ;;
    *:READ | *:EDIT | *:MANAGE | *:NONE) ;;
    *) die "grant: $permission is not a permission: READ, EDIT (write runs), MANAGE (also grant) or NONE (not even read)" ;;
    esac
    accounts grant "$name" "$experiment" "$permission"
}

# PostgreSQL's socket folder: this layout's, or that of a data folder made by an earlier
# tracking.sh (whose data `backup` moves to a new service).
database_sockets() {
    if [ -d "$SOCKETS" ]; then echo "$SOCKETS"; else echo "$DATA/postgres-socket"; fi
}

# A folder (or file) root's backup writes into and restore reads: the caller's own, no one
# else's to write, not a link (another user's folder could hold a link at a dump's name, or a
# dump of theirs to restore).
check_own() {
    local path=$1 kind=$2
    if [ -L "$path" ]; then die "$path is a link: give the $kind itself"; fi
    [ "$(stat -c %u "$path")" = "$(id -u)" ] || die "$path belongs to $(stat -c %U "$path"), not to $(id -un): backup and restore use a $kind of their caller's own (another user could swap what is in it)"
    ! (($(stat -c '0%a' "$path") & 8#022)) || die "$path may be written by others (mode $(stat -c %a "$path")): chmod go-w $path"
}

# Both databases (runs, accounts) while the service runs, for `restore`. The accounts' dump
# holds password hashes: the files are the owner's only; a failed dump leaves the last one. Each
# dump goes into a new file (mktemp), then takes the dump's name (rename: a link there is
# replaced, never followed).
backup() {
    local folder=$1 database role=mlflow dump
    [ -n "$folder" ] || die "backup needs a folder: python -m lightning_exact.server backup /var/backups/mlflow-tracking"
    [[ $folder == /* ]] || die "backup needs an absolute folder (a relative one lands wherever this shell is): python -m lightning_exact.server backup /var/backups/mlflow-tracking"
    load_settings
    [ -d "$SOCKETS" ] || role=postgres # an earlier layout's (local trust)
    if [ -e "$folder" ] || [ -L "$folder" ]; then
        [ -d "$folder" ] || [ -L "$folder" ] || die "$folder is not a folder"
        check_own "$folder" folder
    else
        mkdir -p -m 700 -- "$folder"
    fi
    for database in mlflow mlflow_auth; do
        dump=$(mktemp "$folder/.$database.dump.XXXXXXXX")
        "$PG_BIN/pg_dump" -h "$(database_sockets)" -U "$role" -Fc -f "$dump" "$database" \
            || { rm -f -- "$dump" && die "the dump of $database failed (above); $folder keeps the last one"; }
        mv -fT -- "$dump" "$folder/$database.dump"
    done
    echo "Backed up to $folder/mlflow.dump and $folder/mlflow_auth.dump (the artifacts are in $ARTIFACTS)."
}

# A backup into this running service (a new VM: start, then restore): both databases replaced,
# owned by MLflow's role, with the MLflow server stopped meanwhile so that no request sees half
# of them. The folder and its dumps are the caller's own (check_own).
restore() {
    local folder=$1 database
    [ -n "$folder" ] || die "restore needs the folder of a backup: python -m lightning_exact.server restore /var/backups/mlflow-tracking"
    [ -e "$folder/mlflow.dump" ] && [ -e "$folder/mlflow_auth.dump" ] || die "$folder holds no backup (mlflow.dump and mlflow_auth.dump): give the folder 'backup' wrote"
    check_own "$folder" folder
    for database in mlflow mlflow_auth; do
        check_own "$folder/$database.dump" file
        [ -f "$folder/$database.dump" ] || die "$folder/$database.dump is not a file"
    done
    load_settings
    control status postgres >/dev/null 2>&1 || die "the service is not running: python -m lightning_exact.server start, then restore"
    control stop mlflow >/dev/null
    for database in mlflow mlflow_auth; do
        "$PG_BIN/pg_restore" -h "$SOCKETS" -U mlflow --no-owner --clean --if-exists \
            --single-transaction -d "$database" "$folder/$database.dump" \
            || die "restoring $database failed (above); the server stays stopped: fix the cause and run restore again"
    done
    control start mlflow >/dev/null || die "the server did not start: see $DATA/logs/mlflow.log"
    wait_until_up
    echo "Restored $folder into https://$HOST:$PORT (the accounts and passwords are the backup's)."
}

# After installing a new MLflow: its schema migrations on the runs database (the accounts
# database migrates itself when the server starts), with the server stopped meanwhile.
upgrade() {
    load_settings
    control stop mlflow >/dev/null
    PYTHONWARNINGS=ignore as_service mlflow db upgrade "$(database_uri mlflow)" \
        || die "the database migration failed (above); the server stays stopped: restore the backup into it (docs/tracking-server.md), or fix the cause and run upgrade again"
    control start mlflow >/dev/null \
        || die "the upgraded server did not start: see $DATA/logs/mlflow.log"
    wait_until_up
    echo "Upgraded: mlflow $(mlflow --version | awk '{print $NF}') serves https://$HOST:$PORT."
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) load_settings && control status ;;
add-user) add_user "${2:-}" ;;
grant) grant "${2:-}" "${3:-}" "${4:-}" ;;
backup) backup "${2:-}" ;;
restore) restore "${2:-}" ;;
upgrade) upgrade ;;
run) prepare && supervise foreground ;;
serve-mlflow) serve_mlflow ;;
*) die "usage: python -m lightning_exact.server start|stop|status|add-user NAME|grant NAME EXPERIMENT|backup FOLDER|restore FOLDER|upgrade|run" ;;
esac
