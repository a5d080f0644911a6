"""The tracking service's sign-in: server/basic_auth.ini's ``authorization_function``, which
MLflow's basic-auth app calls for every request it protects (docs/tracking-server.md: Threat
model).

* Wrong passwords are limited per account and per client address (the one caddy puts in
  ``X-Real-IP``): past the limit, sign-ins are refused until the window ends, the right password
  too, without checking it. The counts are kept in PostgreSQL, which every server worker shares.
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
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from flask import Response, after_this_request, g, make_response, request
from mlflow.exceptions import MlflowException
from mlflow.server.auth import (
    _authorize_logged_model_id,
    _authorize_run_id,
    authenticate_request_basic_auth,
    store,
)
from mlflow.server.handlers import _get_model_registry_store
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


class Limits(NamedTuple):
    per_account: int
    per_address: int
    window_s: int


def read_limits() -> Limits:
    """basic_auth.ini's [tracking] section (server/basic_auth.ini)."""
    config = configparser.ConfigParser()
    config.read(os.environ["MLFLOW_AUTH_CONFIG_PATH"])
    section = config["tracking"]
    return Limits(
        section.getint("wrong_passwords_per_account"),
        section.getint("wrong_passwords_per_address"),
        section.getint("window_s"),
    )


LIMITS = read_limits()


def authenticate() -> Authorization | Response:
    """The request's sign-in (MLflow asks several times per request: worked out once)."""
    if "tracking_sign_in" not in g:
        g.tracking_sign_in = sign_in()
        if isinstance(g.tracking_sign_in, Authorization):
            username = g.tracking_sign_in.username
            if not store.get_user(username).is_admin:
                g.tracking_sign_in = model_version_refusal(username) or g.tracking_sign_in
                if any(route in request.path for route in VERSION_ANSWERS):
                    after_this_request(lineage_withheld(username))
    return g.tracking_sign_in


def sign_in() -> Authorization | Response:
    """MLflow's password check, behind the limit on wrong passwords."""
    given = request.authorization
    if given is None or given.type != "basic":
        return authenticate_request_basic_auth()
    keys = {
        f"account:{given.username}": LIMITS.per_account,
        f"address:{request.headers.get('X-Real-IP', 'local')}": LIMITS.per_address,
    }
    if wait_s := seconds_refused(keys):
        return too_many_wrong_passwords(wait_s)
    answer = authenticate_request_basic_auth()
    if not isinstance(answer, Authorization):
        if not store.has_user(given.username or ""):
            check_password_hash(UNKNOWN_ACCOUNT_HASH, given.password or "")
        count_wrong_password(list(keys))
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


def seconds_refused(keys: dict[str, int]) -> int:
    """Seconds until sign-ins are taken again for the first of ``keys`` (key: its limit) that
    reached its limit in its window; 0 for none."""
    failures_table()
    over = " OR ".join(f"(key = :key{i} AND count >= :limit{i})" for i in range(len(keys)))
    values = {f"key{i}": key for i, key in enumerate(keys)}
    values |= {f"limit{i}": limit for i, limit in enumerate(keys.values())}
    with store.engine.begin() as db:
        wait = db.execute(
            text(
                "SELECT ceil(max(extract(epoch FROM window_end - now()))) "
                f"FROM {FAILURES} WHERE window_end > now() AND ({over})"
            ),
            values,
        ).scalar()
    return int(wait or 0)


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
        name, _, number = source.removeprefix("models:/").partition("/")
        copied = stored_version(name, number) if source.startswith("models:/") else None
        if copied is not None and not lineage_readable(copied.run_id, copied.model_id):
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
