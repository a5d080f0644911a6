"""The tracking service's sign-in: server/basic_auth.ini's ``authorization_function``, which
MLflow's basic-auth app calls for every request it protects (docs/tracking-server.md: Threat
model).

* Wrong passwords are limited per (account, client address) pair and per address (the one
  caddy puts in ``X-Real-IP``): past the pair's limit that pair is refused until the window ends,
  the right password too, without checking it; past the address's limit every account is refused
  from there but those that signed in from it before (so no one locks another out from an
  address the other uses). Credentials that are not Basic ones count against the address. The
  counts are kept in PostgreSQL, which every server worker shares.
* No account chooses an experiment's artifact location (MLflow's proxied default,
  ``mlflow-artifacts:/<id>``, in the bucket's prefix only), nor reaches an artifact root that is
  not in it (a run made before with a folder of this machine's): the server never reads or writes
  artifacts on its own disk. The artifact proxy is reached under an experiment's folder only (its
  root would list every experiment's).
* The list of accounts is the admin's only; an answer with HTTP 500 says no more than that (the
  server's log has the error: it may name the bucket).
* MLflow's own password check (with its credential cache), a wrong password for an unknown
  account costing the same hash as for a known one: the answer's time does not say which names
  exist.
* For an account other than the admin, a model version's files (``get-artifact``,
  ``get-download-uri``) and its lineage in any answer (run id, run link, source, logged model)
  only where the account may read the run and the logged model it was made from, and only from a
  source that is this server's (a run or a model, not a bucket path: the server's credentials
  would read any). MLflow checks neither here: everyone may read a registered model.
"""

import configparser
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from flask import Response, after_this_request, g, make_response, request
from mlflow.exceptions import MlflowException
from mlflow.server.auth import (
    _authorize_logged_model_id,
    _authorize_run_id,
    authenticate_request_basic_auth,
    make_basic_auth_response,
    store,
)
from mlflow.server.handlers import _get_model_registry_store, _get_tracking_store
from mlflow.store.artifact.utils.models import get_model_name_and_version
from sqlalchemy import text
from werkzeug.datastructures import Authorization
from werkzeug.security import check_password_hash, generate_password_hash

# The routes whose answer is a model version's files, and those that may name one's lineage.
VERSION_FILES = ("/model-versions/get-artifact", "/model-versions/get-download-uri")
VERSION_ANSWERS = ("/model-versions/", "/registered-models/", "/graphql")
# Where a model version sits in an answer (REST and GraphQL names), and its lineage fields.
VERSION_KEYS = {"model_version", "model_versions", "latest_versions", "modelVersions"}
LINEAGE = ("run_id", "runId", "run_link", "runLink", "source", "model_id", "modelId")
# The sources this server makes versions from (MLflow refuses others at creation:
# MLFLOW_CREATE_MODEL_VERSION_SOURCE_VALIDATION_REGEX in tracking.sh).
SERVER_SOURCES = ("runs:/", "models:/", "mlflow-artifacts:/")
# A hash of a password no one knows, checked for a name no account has: the same cost as a
# wrong password for a real account (werkzeug's default method, as MLflow's accounts).
UNKNOWN_ACCOUNT_HASH = generate_password_hash(os.urandom(16).hex())
FAILURES = "tracking_wrong_passwords"  # in the accounts' database
# Artifacts are the proxy's only (MLflow's default location of an experiment, in the bucket).
PROXIED = "mlflow-artifacts:/"
# The routes that read or write a run's artifacts by its run id, and the artifact proxy's.
RUN_ARTIFACTS = ("/get-artifact", "/upload-artifact", "/mlflow/artifacts/list")
PROXY = re.compile(r"/(?:ajax-)?api/2\.0/mlflow-artifacts/(?:artifacts|mpu|presigned)(?:/(.*))?")
# Where the proxy is reached: under an experiment's folder (its id, the path's first part).
EXPERIMENT_FOLDER = re.compile(r"[0-9]+(?:/.*)?")
USER_LISTS = ("/mlflow/users/list",)
_logger = logging.getLogger(__name__)


class Limits(NamedTuple):
    per_account_and_address: int
    per_address: int
    window_s: int
    known_address_s: int


def read_limits() -> Limits:
    """basic_auth.ini's [tracking] section (server/basic_auth.ini)."""
    config = configparser.ConfigParser()
    config.read(os.environ["MLFLOW_AUTH_CONFIG_PATH"])
    section = config["tracking"]
    return Limits(
        section.getint("wrong_passwords_per_account_and_address"),
        section.getint("wrong_passwords_per_address"),
        section.getint("window_s"),
        section.getint("known_address_days") * 86400,
    )


LIMITS = read_limits()


def authenticate() -> Authorization | Response:
    """The request's sign-in (MLflow asks several times per request: worked out once)."""
    if "tracking_sign_in" not in g:
        g.tracking_sign_in = sign_in()
        if isinstance(g.tracking_sign_in, Authorization):
            after_this_request(internal_error_withheld)
            username = g.tracking_sign_in.username
            g.tracking_sign_in = artifact_refusal() or g.tracking_sign_in
            if isinstance(g.tracking_sign_in, Authorization) and not is_admin(username):
                g.tracking_sign_in = account_refusal(username) or g.tracking_sign_in
                if any(route in request.path for route in VERSION_ANSWERS):
                    after_this_request(lineage_withheld(username))
    return g.tracking_sign_in


def is_admin(username: str) -> bool:
    return store.get_user(username).is_admin


def account_refusal(username: str) -> Response | None:
    """What an account other than the admin may not do here: list the accounts, reach the
    artifact proxy outside an experiment's folder, a model version of a run it may not read."""
    if request.path.endswith(USER_LISTS):
        return forbidden("the list of accounts is the admin's only")
    if (proxy := PROXY.fullmatch(request.path)) is not None:
        folder = proxy[1] if proxy[1] is not None else request.args.get("path", "")
        if not EXPERIMENT_FOLDER.fullmatch(folder):
            return forbidden("artifacts are reached under an experiment's folder (its id)")
    return model_version_refusal(username)


def artifact_refusal() -> Response | None:
    """Any account, the admin's too: an experiment with an artifact location of its own (a
    folder of this machine, another experiment's prefix), a run's artifacts outside the proxy."""
    if request.path.endswith("/experiments/create") and request.method == "POST":
        if (request.get_json(silent=True) or {}).get("artifact_location"):
            return forbidden(
                "an experiment's artifact location is the server's (leave artifact_location out)"
            )
    elif request.path.endswith(RUN_ARTIFACTS):
        run_id = request.args.get("run_id") or request.args.get("run_uuid") or ""
        if request.method == "POST":
            run_id = run_id or str((request.get_json(silent=True) or {}).get("run_id", ""))
        try:
            artifact_uri = _get_tracking_store().get_run(run_id).info.artifact_uri if run_id else ""
        except MlflowException:
            return None  # MLflow answers that it does not exist
        if artifact_uri and not artifact_uri.startswith(PROXIED):
            return forbidden("this run's artifacts are not in the server's artifact store")
    return None


def internal_error_withheld(response: Response) -> Response:
    """An answer with HTTP 500 says no more than that: its text (an error of the bucket, say,
    naming it) goes to the server's log."""
    if response.status_code == 500:
        _logger.error("HTTP 500 for %s %s: %s", request.method, request.path, response.get_data())
        response.set_data(json.dumps({"error_code": "INTERNAL_ERROR", "message": "Internal error"}))
        response.mimetype = "application/json"
    return response


def sign_in() -> Authorization | Response:
    """MLflow's password check, behind the limits on wrong passwords."""
    given = request.authorization
    address = f"address:{request.headers.get('X-Real-IP', 'local')}"
    if given is None:
        return authenticate_request_basic_auth()  # 401: the client asks for a password
    if given.type != "basic" or not given.username:
        if wait_s := seconds_refused(None, address, None):
            return too_many_wrong_passwords(wait_s)
        count_wrong_password([address])
        return make_basic_auth_response()
    pair = f"pair:{given.username} {address}"
    known = f"known:{given.username} {address}"
    if wait_s := seconds_refused(pair, address, known):
        return too_many_wrong_passwords(wait_s)
    answer = authenticate_request_basic_auth()
    if isinstance(answer, Authorization):
        remember_known(known)
    else:
        if not store.has_user(given.username):
            check_password_hash(UNKNOWN_ACCOUNT_HASH, given.password or "")
        count_wrong_password([pair, address])
    return answer


def too_many_wrong_passwords(wait_s: int) -> Response:
    """HTTP 429, the wait in words only: MLflow's client sleeps as long as a Retry-After header
    says before it tries again, and a job would hang for minutes instead of saying why."""
    response = make_response(
        "Too many wrong passwords for this account or from this address: sign-ins are refused "
        f"for {wait_s} s more (docs/tracking-server.md: Threat model)\n"
    )
    response.status_code = 429
    return response


@functools.cache
def failures_table() -> None:
    """The table of wrong passwords, made by the first worker that needs it (the others wait on
    the same lock); once per process."""
    with store.engine.begin() as db:
        db.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": FAILURES})
        db.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {FAILURES} (key text PRIMARY KEY, "
                "count integer NOT NULL, window_end timestamptz NOT NULL)"
            )
        )


def seconds_refused(pair: str | None, address: str, known: str | None) -> int:
    """Seconds until sign-ins are taken again: the (account, address) ``pair`` past its limit,
    or the ``address`` past its own unless the account signed in from there before (``known``);
    0 for neither."""
    failures_table()
    with store.engine.begin() as db:
        wait = db.execute(
            text(
                "SELECT ceil(max(extract(epoch FROM window_end - now()))) "
                f"FROM {FAILURES} WHERE window_end > now() AND ((key = :pair AND count >= "
                ":per_pair) OR (key = :address AND count >= :per_address AND NOT EXISTS "
                f"(SELECT 1 FROM {FAILURES} WHERE key = :known AND window_end > now())))"
            ),
            {
                "pair": pair or "",
                "address": address,
                "known": known or "",
                "per_pair": LIMITS.per_account_and_address,
                "per_address": LIMITS.per_address,
            },
        ).scalar()
    return int(wait or 0)


_REMEMBERED: dict[str, float] = {}  # known pairs this worker wrote, and when


def remember_known(known: str) -> None:
    """The account signed in from this address: its address's limit no longer refuses it (for
    known_address_days; written at most once a minute per worker)."""
    if time.monotonic() - _REMEMBERED.get(known, -3600.0) < 60:
        return
    with store.engine.begin() as db:
        db.execute(
            text(
                f"INSERT INTO {FAILURES} AS f (key, count, window_end) VALUES (:key, 0, now() + "
                "make_interval(secs => :keep)) ON CONFLICT (key) DO UPDATE SET window_end = "
                "excluded.window_end"
            ),
            {"key": known, "keep": LIMITS.known_address_s},
        )
    _REMEMBERED[known] = time.monotonic()


def count_wrong_password(keys: list[str]) -> None:
    """One more wrong password for each key, in a window that starts with the first one; windows
    that ended are dropped."""
    failures_table()
    with store.engine.begin() as db:
        db.execute(text(f"DELETE FROM {FAILURES} WHERE window_end <= now()"))
        for key in keys:
            db.execute(
                text(
                    f"INSERT INTO {FAILURES} AS f (key, count, window_end) VALUES "
                    "(:key, 1, now() + make_interval(secs => :window)) ON CONFLICT (key) DO "
                    "UPDATE SET count = f.count + 1"
                ),
                {"key": key, "window": LIMITS.window_s},
            )


def lineage_readable(run_id: str | None, model_id: str | None) -> bool:
    """Whether the signed-in account may read the run and the logged model a version was made
    from (MLflow's permissions on their experiments)."""
    run_readable = not run_id or _authorize_run_id(run_id, "read")
    return run_readable and (not model_id or _authorize_logged_model_id(model_id, "read"))


def forbidden(why: str) -> Response:
    response = make_response(f"Permission denied: {why}\n")
    response.status_code = 403
    return response


def model_version_refusal(username: str) -> Response | None:
    """A model version's files for an account that may not read its run (or from a source that
    is not this server's), and a copy of such a version, are refused; anything else: None."""
    if request.path.endswith(VERSION_FILES):
        version = stored_version(request.args.get("name", ""), request.args.get("version", ""))
        if version is None:
            return None  # MLflow answers that it does not exist
        if not version.source.startswith(SERVER_SOURCES):
            return forbidden("this model version's source is not a run or model of this server")
        if not lineage_readable(version.run_id, version.model_id):
            return forbidden(f"{username} may not read the run this model version was made from")
    elif request.path.endswith("/model-versions/create") and request.method == "POST":
        source = str((request.get_json(silent=True) or {}).get("source", ""))
        if source.lower().startswith("models:"):
            return copy_refusal(username, source)
    return None


def copy_refusal(username: str, source: str) -> Response | None:
    """A version copied from ``source`` (models:/NAME/VERSION, /latest, /STAGE, NAME@ALIAS,
    models:/MODEL_ID, any spelling MLflow's own parser takes), resolved as MLflow resolves it,
    is refused where the account may not read its run or logged model; a source MLflow cannot
    resolve is refused too."""
    try:
        resolved = get_model_name_and_version(_get_model_registry_store(), source)
    except Exception:
        return forbidden(f"{source} is not a model version of this server")
    if len(resolved) == 1:  # a logged model's id
        readable = lineage_readable(None, resolved[0])
    else:
        copied = stored_version(*resolved)
        readable = copied is not None and lineage_readable(copied.run_id, copied.model_id)
    if not readable:
        return forbidden(f"{username} may not read the run the copied version was made from")
    return None


def stored_version(name: str, version: str) -> Any | None:
    """The registry's model version ``name``/``version``, or None if there is none."""
    try:
        return _get_model_registry_store().get_model_version(name, version)
    except MlflowException:
        return None


def lineage_withheld(username: str) -> Callable[[Response], Response]:
    """The answer, with each model version's lineage that the account may not read left out."""

    def withhold(response: Response) -> Response:
        if response.status_code >= 400 or not response.is_json:
            return response
        answer = response.get_json(silent=True)
        readable: dict[tuple[str, str], bool] = {}

        def may_read(run_id: str, model_id: str) -> bool:
            if (run_id, model_id) not in readable:
                readable[run_id, model_id] = lineage_readable(run_id, model_id)
            return readable[run_id, model_id]

        if withheld(answer, may_read):
            response.set_data(json.dumps(answer))
        return response

    return withhold


def withheld(node: Any, may_read: Callable[[str, str], bool], in_version: bool = False) -> bool:
    """Leave out the lineage fields of every model version under ``node`` whose run or logged
    model ``may_read`` refuses; whether any was."""
    changed = False
    if isinstance(node, list):
        for item in node:
            changed |= withheld(item, may_read, in_version)
        return changed
    if not isinstance(node, dict):
        return False
    if in_version:
        run_id = node.get("run_id") or node.get("runId") or ""
        model_id = node.get("model_id") or node.get("modelId") or ""
        if (run_id or model_id) and not may_read(run_id, model_id):
            for field in LINEAGE:
                changed |= node.pop(field, None) is not None
    for key, value in node.items():
        changed |= withheld(value, may_read, key in VERSION_KEYS)
    return changed
