"""The tracking service's sign-in: basic_auth.ini's ``authorization_function``, which
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
* MLflow's own password check, a wrong password for an unknown account costing the same hash as
  for a known one: the answer's time does not say which names exist. A right password is checked
  again once per ``verified_password_s`` per worker, by one request: the others go on with the
  account it was checked for (MLflow's cache let every request that arrived during a check
  hash it again: dozens of hashes at once, each expiry).
* MLflow's checks of a request read the signed-in account (``store.get_user``, twice a request)
  from its sign-in, and a run's experiment (its permission check of a run request loads the
  whole run: a third of the request's CPU) from this worker's cache of run ids
  (``users_of_the_request``, ``run_lookups_cached``), each only while MLflow's code does what
  they assume (checked at start; otherwise MLflow's own lookups run, and the log says so).
* A client that signed in gets a signed cookie of that account (``tracking_device``): with it,
  wrong passwords count against that cookie, not against its address, and its address's limits
  do not refuse it (others' guesses from a shared address do not lock a running job out).
* A trace's locations (its data and attachments, an archive) are its own experiment's folder:
  no client sets or changes them (PostgreSQL keeps them so, on every route, OTLP's too:
  ``trace_locations_kept``), and ``get-trace-artifact`` serves a trace only from there.
* A body that is not a JSON object, and a GraphQL query that is missing or does not parse, get
  HTTP 400 (MLflow's handlers crashed on them: 500).
* An AI-gateway endpoint's usage is logged into an experiment only by an account that may write
  there (EDIT): MLflow asks for READ.
* For an account other than the admin, a model version's files (``get-artifact``,
  ``get-download-uri``) and its lineage in any answer (run id, run link, source, logged model)
  only where the account may read the run and the logged model it was made from, and only from a
  source that is this server's (a run or a model, not a bucket path: the server's credentials
  would read any). MLflow checks neither here: everyone may read a registered model.
"""

import configparser
import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import mlflow.server.auth
import sqlalchemy
from flask import Response, after_this_request, g, has_request_context, make_response, request
from graphql import GraphQLError, parse
from itsdangerous import BadSignature, URLSafeTimedSerializer
from mlflow.exceptions import MlflowException
from mlflow.server.auth import (
    _authenticate_cached,
    _authorize_logged_model_id,
    _authorize_run_id,
    _get_experiment_permission,
    make_basic_auth_response,
    store,
)
from mlflow.server.auth.entities import User
from mlflow.server.handlers import _get_model_registry_store, _get_tracking_store
from mlflow.store.artifact.utils.models import get_model_name_and_version
from mlflow.utils.uri import append_to_uri_path
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


# What clients may not set on a trace: where its data, attachments and archive are read from.
ARTIFACT_LOCATION = "mlflow.artifactLocation"
ARCHIVE_LOCATION = "mlflow.trace.archiveLocation"
SPANS_LOCATION = "mlflow.trace.spansLocation"
TRACE_LOCATIONS = {ARTIFACT_LOCATION, ARCHIVE_LOCATION, SPANS_LOCATION}
# The routes that write a trace's tags (start, end, set or delete a tag; v2 and v3), and the one
# that reads a trace's data and attachments with the server's credentials.
TRACE_WRITES = re.compile(r".*/mlflow/traces(?:/[^/]+)?(?:/tags)?")
TRACE_ARTIFACT = "/mlflow/get-trace-artifact"
# The routes whose body is a file (the artifact proxy's, a run's upload), not JSON.
UPLOADS = ("/upload-artifact",)
JSON_ROUTES = ("/api/", "/ajax-api/", "/graphql")
GATEWAY_ENDPOINT_WRITES = ("/gateway/endpoints/create", "/gateway/endpoints/update")
DEVICE_COOKIE = "tracking_device"


class Limits(NamedTuple):
    per_account_and_address: int
    per_address: int
    window_s: int
    known_address_s: int
    verified_password_s: int


def read_limits() -> Limits:
    """basic_auth.ini's [tracking] section (basic_auth.ini, beside this file)."""
    config = configparser.ConfigParser()
    config.read(os.environ["MLFLOW_AUTH_CONFIG_PATH"])
    section = config["tracking"]
    return Limits(
        section.getint("wrong_passwords_per_account_and_address"),
        section.getint("wrong_passwords_per_address"),
        section.getint("window_s"),
        section.getint("known_address_days") * 86400,
        section.getint("verified_password_s"),
    )


LIMITS = read_limits()


def authenticate() -> Authorization | Response:
    """The request's sign-in (MLflow asks several times per request: worked out once)."""
    if "tracking_sign_in" not in g:
        g.tracking_sign_in = sign_in()
        if isinstance(g.tracking_sign_in, Authorization):
            after_this_request(internal_error_withheld)
            username = g.tracking_sign_in.username
            g.tracking_sign_in = (
                malformed_refusal() or artifact_refusal() or trace_refusal() or g.tracking_sign_in
            )
            if isinstance(g.tracking_sign_in, Authorization) and not g.tracking_user.is_admin:
                g.tracking_sign_in = account_refusal(username) or g.tracking_sign_in
                if any(route in request.path for route in VERSION_ANSWERS):
                    after_this_request(lineage_withheld(username))
    return g.tracking_sign_in


def json_body() -> dict[str, Any]:
    """The request's JSON object ({} for none: malformed_refusal answered any other body)."""
    body = request.get_json(force=True, silent=True)
    return body if isinstance(body, dict) else {}


def json_object_sent() -> bool:
    return isinstance(request.get_json(force=True, silent=True), dict)


def malformed_refusal() -> Response | None:
    """HTTP 400 for what MLflow's handlers would crash on (500): an API request whose body is not
    a JSON object (a JSON string, say), a GraphQL query that is missing or does not parse. (An
    upload's size is caddy's to limit: MLflow's upload route never shows this hook its length.)"""
    path = request.path
    if PROXY.fullmatch(path) is not None or path.endswith(UPLOADS):
        return None  # a file, not JSON
    has_body = request.method in ("POST", "PATCH", "PUT", "DELETE") and path.startswith(JSON_ROUTES)
    if has_body and request.get_data(cache=True).strip() and not json_object_sent():
        return refused(400, "Bad request: the body is not a JSON object")
    if path.endswith("/graphql"):
        query = request.args.get("query") if request.method == "GET" else json_body().get("query")
        if not isinstance(query, str) or not query.strip():
            return refused(400, "Bad request: a GraphQL request needs a query")
        try:
            parse(query)
        except GraphQLError as error:
            return refused(400, f"Bad request: the GraphQL query does not parse: {error.message}")
    return None


def account_refusal(username: str) -> Response | None:
    """What an account other than the admin may not do here: list the accounts, reach the
    artifact proxy outside an experiment's folder, log an AI-gateway endpoint's usage into an
    experiment it may not write, a model version of a run it may not read."""
    if request.path.endswith(USER_LISTS):
        return forbidden("the list of accounts is the admin's only")
    if (proxy := PROXY.fullmatch(request.path)) is not None:
        folder = proxy[1] if proxy[1] is not None else request.args.get("path", "")
        if not EXPERIMENT_FOLDER.fullmatch(folder):
            return forbidden("artifacts are reached under an experiment's folder (its id)")
    if request.path.endswith(GATEWAY_ENDPOINT_WRITES) and request.method == "POST":
        body = json_body()
        experiment_id = str(body.get("experiment_id") or body.get("experimentId") or "")
        if experiment_id and not _get_experiment_permission(experiment_id, username).can_update:
            return forbidden(
                f"{username} may not write into experiment {experiment_id} (an endpoint's usage "
                "is logged there: EDIT is needed)"
            )
    return model_version_refusal(username)


def artifact_refusal() -> Response | None:
    """Any account, the admin's too: an experiment with an artifact location of its own (a
    folder of this machine, another experiment's prefix), a run's artifacts outside the proxy."""
    if request.path.endswith("/experiments/create") and request.method == "POST":
        if json_body().get("artifact_location"):
            return forbidden(
                "an experiment's artifact location is the server's (leave artifact_location out)"
            )
    elif request.path.endswith(RUN_ARTIFACTS):
        run_id = request.args.get("run_id") or request.args.get("run_uuid") or ""
        if request.method == "POST":
            run_id = run_id or str(json_body().get("run_id", ""))
        try:
            artifact_uri = _get_tracking_store().get_run(run_id).info.artifact_uri if run_id else ""
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None  # MLflow answers that it does not exist
            return forbidden("this trace could not be checked")  # closed, not open
        if artifact_uri and not artifact_uri.startswith(PROXIED):
            return forbidden("this run's artifacts are not in the server's artifact store")
    return None


def trace_refusal() -> Response | None:
    """Any account, the admin's too: a trace's location tags set or deleted by a request, and a
    trace's data or attachment read from anywhere but its own experiment's folder (a trace made
    before PostgreSQL kept its locations, say)."""
    if request.path.endswith(TRACE_ARTIFACT) and request.method == "GET":
        try:
            info = _get_tracking_store().get_trace_info(request.args.get("request_id", ""))
            experiment = _get_tracking_store().get_experiment(info.experiment_id)
        except MlflowException:
            return None  # MLflow answers that it does not exist
        own = own_trace_folder(experiment.artifact_location, info.trace_id)
        archived = info.tags.get(SPANS_LOCATION) == "ARCHIVE_REPO"
        if info.tags.get(ARTIFACT_LOCATION) != own or (
            archived and info.tags.get(ARCHIVE_LOCATION) != own
        ):
            return forbidden("this trace's data is not in its experiment's folder")
    elif sets_trace_locations():
        return forbidden(
            "a trace's locations are the server's: leave "
            f"{', '.join(sorted(TRACE_LOCATIONS))} out of its tags"
        )
    return None


def sets_trace_locations() -> bool:
    """Whether the request writes a trace's location tags (any route that writes its tags)."""
    if not TRACE_WRITES.fullmatch(request.path) or request.method not in (
        "POST",
        "PATCH",
        "DELETE",
    ):
        return False
    keys = trace_tag_keys(json_body()) | {request.args.get("key", "")}
    return bool(keys & TRACE_LOCATIONS)


def own_trace_folder(experiment_location: str, trace_id: str) -> str:
    """Where MLflow's store puts a trace's data: its experiment's artifact location's
    ``traces/<trace id>/artifacts`` (SqlAlchemyStore._get_trace_artifact_location_tag)."""
    return append_to_uri_path(experiment_location, "traces", trace_id, "artifacts")


def trace_tag_keys(body: dict[str, Any]) -> set[str]:
    """The tag keys a trace request's body sets or deletes: a tag's ``key``, ``tags`` (a list of
    key/value pairs, v2), a trace's ``trace_info.tags`` (a map, v3)."""

    def keys(tags: Any) -> set[str]:
        if isinstance(tags, dict):
            return set(map(str, tags))
        if isinstance(tags, list):
            return {str(tag.get("key")) for tag in tags if isinstance(tag, dict)}
        return set()

    found = keys(body.get("tags")) | {str(body.get("key", ""))}
    trace = body.get("trace")
    if isinstance(trace, dict):
        for name in ("trace_info", "traceInfo"):
            if isinstance(trace.get(name), dict):
                found |= keys(trace[name].get("tags"))
    return found


def internal_error_withheld(response: Response) -> Response:
    """An answer with HTTP 500 says no more than that: its text (an error of the bucket, say,
    naming it) goes to the server's log."""
    if response.status_code == 500:
        _logger.error("HTTP 500 for %s %s: %s", request.method, request.path, response.get_data())
        response.set_data(json.dumps({"error_code": "INTERNAL_ERROR", "message": "Internal error"}))
        response.mimetype = "application/json"
    return response


def sign_in() -> Authorization | Response:
    """MLflow's password check, behind the limits on wrong passwords. A client with the cookie
    of this account (given at a sign-in) is counted by its cookie, not by its address."""
    given = request.authorization
    address = f"address:{request.headers.get('X-Real-IP', 'local')}"
    if given is None:
        return make_basic_auth_response()  # 401: the client asks for a password
    if given.type != "basic" or not given.username:
        if wait_s := seconds_refused(None, address, None):
            return too_many_wrong_passwords(wait_s)
        count_wrong_password([address])
        return make_basic_auth_response()
    device = device_of(given.username)
    if device is not None:
        pair = f"device:{device}"
        counted = [pair]
        known = None
    else:
        pair = f"pair:{given.username} {address}"
        counted = [pair, address]
        known = f"known:{given.username} {address}"
    if wait_s := seconds_refused(pair, address if device is None else None, known):
        return too_many_wrong_passwords(wait_s)
    user = verified_user(given.username, given.password or "")
    if user is None:
        if not store.has_user(given.username):
            check_password_hash(UNKNOWN_ACCOUNT_HASH, given.password or "")
        count_wrong_password(counted)
        return make_basic_auth_response()
    g.tracking_user = user
    g.tracking_users = {user.username: user}  # MLflow's own get_user calls: users_of_the_request
    if known is not None:
        remember_known(known)
        after_this_request(device_cookie_given(user.username))
    return given


_VERIFIED: dict[tuple[str, bytes], tuple[float, User]] = {}  # right passwords: when checked
_CHECKING: dict[tuple[str, bytes], threading.Event] = {}  # the checks in flight
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_KEY = secrets.token_bytes(32)  # this process's: no digest outlives it


def verified_user(username: str, password: str) -> User | None:
    """The account if the password is its own (MLflow's check: ``_authenticate_cached``, whose
    cache is off), checked again once per ``verified_password_s`` by one request: the requests
    that arrive meanwhile wait for that check, or go on with the account while it was checked
    less than ``verified_password_s`` ago (MLflow's cache let each of them hash the password)."""
    key = (username, hmac.new(_VERIFIED_KEY, password.encode(), hashlib.sha256).digest())
    keep_s = LIMITS.verified_password_s
    while True:
        with _VERIFIED_LOCK:
            checked_at, user = _VERIFIED.get(key, (-float("inf"), None))
            age_s = time.monotonic() - checked_at
            if age_s < 0.8 * keep_s:
                return user
            in_flight = _CHECKING.get(key)
            if in_flight is None:
                in_flight = _CHECKING[key] = threading.Event()
                break  # this request checks it
        if age_s < keep_s:
            return user  # still good while another request checks it again
        in_flight.wait()
    user = None
    try:
        user = _authenticate_cached(username, password)
    finally:
        with _VERIFIED_LOCK:
            now = time.monotonic()
            for stale in [k for k, (at, _) in _VERIFIED.items() if now - at > keep_s]:
                del _VERIFIED[stale]
            if user is not None:
                _VERIFIED[key] = (now, user)
            del _CHECKING[key]
            in_flight.set()
    return user


@functools.cache
def device_signer() -> URLSafeTimedSerializer:
    """Signs the cookie a client gets at a sign-in (the server's Flask secret key)."""
    return URLSafeTimedSerializer(os.environ["MLFLOW_FLASK_SERVER_SECRET_KEY"], "tracking-device")


def device_of(username: str) -> str | None:
    """The id of the client's cookie, if it is this account's and younger than
    known_address_days; None otherwise."""
    cookie = request.cookies.get(DEVICE_COOKIE)
    if not cookie:
        return None
    try:
        name, device = device_signer().loads(cookie, max_age=LIMITS.known_address_s)
    except (BadSignature, ValueError, TypeError):
        return None
    return device if name == username and isinstance(device, str) else None


def device_cookie_given(username: str) -> Callable[[Response], Response]:
    """The answer to a sign-in without this account's cookie, with one (a client that keeps
    cookies, as MLflow's does within a process, is then counted by it)."""

    def give(response: Response) -> Response:
        if response.status_code < 400:
            cookie = device_signer().dumps([username, secrets.token_urlsafe(12)])
            response.set_cookie(
                DEVICE_COOKIE,
                cookie,
                max_age=LIMITS.known_address_s,
                secure=True,
                httponly=True,
                samesite="Strict",
            )
        return response

    return give


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


# Seconds until the pair, or the address (but for an account known there), is taken again.
REFUSED_FOR = text(
    "SELECT ceil(max(extract(epoch FROM window_end - now()))) "
    f"FROM {FAILURES} WHERE window_end > now() AND ((key = :pair AND count >= "
    ":per_pair) OR (key = :address AND count >= :per_address AND NOT EXISTS "
    f"(SELECT 1 FROM {FAILURES} WHERE key = :known AND window_end > now())))"
)


@functools.cache
def limits_database() -> sqlalchemy.Engine:
    """The accounts' database for the one query each request makes: a pool of its own, in
    autocommit, without the check MLflow's pool makes before each use (a round trip); a
    connection PostgreSQL dropped (its restart) is opened again once. Eight connections at most
    per worker (PostgreSQL takes 100 in all, MLflow's pools most of them)."""
    return sqlalchemy.create_engine(
        store.engine.url, isolation_level="AUTOCOMMIT", pool_size=2, max_overflow=6
    )


def seconds_refused(pair: str | None, address: str | None, known: str | None) -> int:
    """Seconds until sign-ins are taken again: the (account, address) or cookie ``pair`` past its
    limit, or the ``address`` past its own unless the account signed in from there before
    (``known``); 0 for neither."""
    failures_table()
    values = {
        "pair": pair or "",
        "address": address or "",
        "known": known or "",
        "per_pair": LIMITS.per_account_and_address,
        "per_address": LIMITS.per_address,
    }
    for attempt in (1, 2):
        try:
            with limits_database().connect() as db:
                return int(db.execute(REFUSED_FOR, values).scalar() or 0)
        except sqlalchemy.exc.DBAPIError as error:
            if attempt == 2 or not error.connection_invalidated:
                raise
    raise AssertionError("unreachable")


# PostgreSQL keeps each trace's data location and archive location its own experiment's folder,
# whatever a request writes (a tag, a trace's start, OTLP's mlflow.traceTag.* attributes):
# MLflow's SqlAlchemyStore writes the same value itself. The service archives no trace
# (MLFLOW_TRACE_ARCHIVAL_CONFIG is not set), so an archive location is the same folder too.
# Rows written before are set so at once.
TRACE_LOCATIONS_KEPT = f"""
CREATE OR REPLACE FUNCTION tracking_trace_locations() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.key IN ('{ARTIFACT_LOCATION}', '{ARCHIVE_LOCATION}') THEN
        SELECT rtrim(e.artifact_location, '/') || '/traces/' || NEW.request_id || '/artifacts'
          INTO NEW.value
          FROM trace_info t JOIN experiments e ON e.experiment_id = t.experiment_id
         WHERE t.request_id = NEW.request_id;
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER tracking_trace_locations BEFORE INSERT OR UPDATE ON trace_tags
    FOR EACH ROW EXECUTE FUNCTION tracking_trace_locations();
UPDATE trace_tags tt SET value = tt.value FROM trace_info t JOIN experiments e
    ON e.experiment_id = t.experiment_id
 WHERE tt.request_id = t.request_id AND tt.key IN ('{ARTIFACT_LOCATION}', '{ARCHIVE_LOCATION}')
   AND tt.value IS DISTINCT FROM
       rtrim(e.artifact_location, '/') || '/traces/' || tt.request_id || '/artifacts';
"""


def trace_locations_kept() -> None:
    """PostgreSQL's trigger on MLflow's table of trace tags (made by the first worker; the others
    wait on the same lock): no request sets a trace's locations, OTLP's included (its body never
    reaches this module)."""
    with _get_tracking_store().engine.begin() as db:
        db.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": "traces"})
        if db.execute(text("SELECT to_regclass('trace_tags')")).scalar() is not None:
            db.exec_driver_sql(TRACE_LOCATIONS_KEPT)


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
    return refused(403, f"Permission denied: {why}")


def refused(status: int, why: str) -> Response:
    response = make_response(f"{why}\n")
    response.status_code = status
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


trace_locations_kept()


def users_of_the_request() -> None:
    """MLflow's ``store.get_user`` for the signed-in account, within a request, answered with
    the account its sign-in checked (MLflow asks for it twice a request: whether it is the
    admin, and its id for the grants), at most ``verified_password_s`` old; any other name, and
    any call outside a request, goes to the database."""
    get_user = store.get_user

    def signed_in_first(username: str) -> User:
        if has_request_context() and username in g.get("tracking_users", {}):
            return g.tracking_users[username]
        return get_user(username)

    store.get_user = signed_in_first


_RUN_EXPERIMENTS: OrderedDict[str, str] = OrderedDict()  # run id -> its experiment's id
_RUN_EXPERIMENTS_LOCK = threading.Lock()
RUN_EXPERIMENTS_KEPT = 100_000  # run ids per worker (a few MB)


def run_experiment(run_id: str) -> SimpleNamespace | None:
    """What MLflow's permission check reads of a run, ``info.experiment_id``, from this
    worker's cache (a run never changes experiment), else one query; None for no such run."""
    with _RUN_EXPERIMENTS_LOCK:
        experiment_id = _RUN_EXPERIMENTS.get(run_id)
        if experiment_id is not None:
            _RUN_EXPERIMENTS.move_to_end(run_id)
    if experiment_id is None:
        with _get_tracking_store().engine.connect() as db:
            found = db.execute(
                text("SELECT experiment_id FROM runs WHERE run_uuid = :id"), {"id": run_id}
            ).scalar()
        if found is None:
            return None
        experiment_id = str(found)
        with _RUN_EXPERIMENTS_LOCK:
            _RUN_EXPERIMENTS[run_id] = experiment_id
            if len(_RUN_EXPERIMENTS) > RUN_EXPERIMENTS_KEPT:
                _RUN_EXPERIMENTS.popitem(last=False)
    return SimpleNamespace(info=SimpleNamespace(experiment_id=experiment_id))


def run_lookups_cached() -> None:
    """MLflow's permission check of a request on a run (``_run_requirement``: log-batch, the
    load's every request) loads the whole run, its metrics, params, tags and inputs, seven
    queries and a third of the request's CPU, to read its experiment's id: that lookup is
    answered by ``run_experiment``. Only while MLflow's check reads nothing else of the run, as
    its source says, and while no other code of MLflow's auth module fetches a run that way
    (it would get the id alone): an MLflow that changes either keeps its own lookup (and the log
    says so)."""
    checked = mlflow.server.auth._run_requirement
    source = inspect.getsource(checked)
    fetch = "_fetch_or_none(_get_tracking_store().get_run, run_id)"
    module = inspect.getsource(mlflow.server.auth)
    if (
        source.count(fetch) != 1
        or len(re.findall(r"_fetch_or_none\(\s*_get_tracking_store\(\)\.get_run\b", module)) != 1
        or set(re.findall(r"\brun\.[\w.]+", source)) != {"run.info.experiment_id"}
    ):
        _logger.warning("MLflow's run permission check changed: its own run lookup is kept")
        return
    fetch_or_none = mlflow.server.auth._fetch_or_none

    def experiment_of_run_first(fetch: Callable[[str], Any], resource_id: str) -> Any | None:
        runs = _get_tracking_store()
        if getattr(fetch, "__self__", None) is runs and fetch.__name__ == "get_run":
            return run_experiment(resource_id)
        return fetch_or_none(fetch, resource_id)

    mlflow.server.auth._fetch_or_none = experiment_of_run_first


users_of_the_request()
run_lookups_cached()
