"""server/tracking.sh's account commands, signed in to the service as the admin through its REST
API (docs/tracking-server.md: Accounts):

    python server/accounts.py add-user NAME
    python server/accounts.py grant NAME EXPERIMENT READ|EDIT|MANAGE|NONE
    python server/accounts.py grant others EXPERIMENT NONE|READ

``others`` is every account without a permission of its own on the experiment, now and added
later: the private experiments are kept in the accounts' database, and add-user denies each new
account every one of them. tracking.sh gives the settings: TRACKING_URL, ACCOUNTS_DATABASE,
MLflow's sign-in variables (the admin's), TRACKING_USER_PASSWORD (add-user: the new account's
password; else a random one, printed once).
"""

import contextlib
import os
import secrets
import sys

import sqlalchemy
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient
from mlflow.server.auth.routes import LIST_USER_PERMISSIONS, LIST_USERS

OTHERS = "others"  # not an account: every account without a permission of its own
# grant's words for MLflow's permissions: NONE vetoes even reading (MLflow's DENY)
PERMISSIONS = {"READ": "READ", "EDIT": "EDIT", "MANAGE": "MANAGE", "NONE": "DENY"}
PRIVATE = "tracking_private_experiments"  # in the accounts' database


def private_experiments() -> sqlalchemy.Engine:
    """The accounts' database, holding the table of private experiments."""
    engine = sqlalchemy.create_engine(os.environ["ACCOUNTS_DATABASE"])
    with engine.begin() as db:
        db.execute(sqlalchemy.text(f"CREATE TABLE IF NOT EXISTS {PRIVATE} (id text PRIMARY KEY)"))
    return engine


def add_user(accounts: AuthServiceClient, url: str, name: str) -> None:
    if name == OTHERS:
        sys.exit(f"Error: {OTHERS} is the name grant gives every other account: choose another")
    chosen = os.environ.get("TRACKING_USER_PASSWORD")
    password = chosen or secrets.token_urlsafe(18)
    accounts.create_user(name, password)
    with private_experiments().begin() as db:
        closed = db.execute(sqlalchemy.text(f"SELECT id FROM {PRIVATE}")).scalars().all()
    for experiment_id in closed:
        accounts.grant_user_permission(name, "experiment", experiment_id, PERMISSIONS["NONE"])
    print(
        f"Account {name} created on {url} (it may create experiments of its own and read others' "
        "that are not private; to write into another's: grant)."
    )
    if not chosen:
        print(f"Its password (shown once, give it to {name}): {password}")


def own_permission(accounts: AuthServiceClient, name: str, experiment_id: str) -> str | None:
    """The permission ``name`` was given on the experiment itself (None: the default's)."""
    rows = accounts._request(LIST_USER_PERMISSIONS, "GET", params={"username": name})
    for row in rows["permissions"]:
        if row["resource_type"] == "experiment" and row["resource_pattern"] == experiment_id:
            return row["permission"]
    return None


def give(accounts: AuthServiceClient, name: str, experiment_id: str, permission: str) -> None:
    """``name``'s permission on the experiment becomes ``permission`` (one given is replaced)."""
    with contextlib.suppress(MlflowException):  # none given yet
        accounts.revoke_user_permission(name, "experiment", experiment_id)
    accounts.grant_user_permission(name, "experiment", experiment_id, permission)


def set_others(accounts: AuthServiceClient, experiment_id: str, permission: str) -> None:
    """NONE: every account without a permission of its own may not read the experiment, nor any
    account added later; READ: every account denied it may read it again (MLflow's default)."""
    users = accounts._request(LIST_USERS, "GET")["users"]
    names = [user["username"] for user in users if not user["is_admin"]]
    marked = (
        f"INSERT INTO {PRIVATE} VALUES (:id) ON CONFLICT DO NOTHING"
        if permission == "NONE"
        else f"DELETE FROM {PRIVATE} WHERE id = :id"
    )
    with private_experiments().begin() as db:
        db.execute(sqlalchemy.text(marked), {"id": experiment_id})
    for name in names:
        held = own_permission(accounts, name, experiment_id)
        if permission == "NONE" and held is None:
            give(accounts, name, experiment_id, PERMISSIONS["NONE"])
        elif permission == "READ" and held == PERMISSIONS["NONE"]:
            accounts.revoke_user_permission(name, "experiment", experiment_id)


def grant(accounts: AuthServiceClient, url: str, name: str, experiment: str, permission: str):
    found = MlflowClient(url).get_experiment_by_name(experiment)
    if found is None:
        sys.exit(f"Error: {url} has no experiment {experiment}: give the name jobs log into")
    if name == OTHERS:
        set_others(accounts, found.experiment_id, permission)
        print(
            f"Experiment {experiment} of {url} is private: only accounts with a permission of "
            "their own on it (its owner, those granted one) may read it; accounts added later may "
            "not."
            if permission == "NONE"
            else f"Experiment {experiment} of {url} is readable by every account again."
        )
    else:
        give(accounts, name, found.experiment_id, PERMISSIONS[permission])
        print(f"{name} has {permission} on experiment {experiment} of {url}.")


def main(argv: list[str]) -> None:
    url = os.environ["TRACKING_URL"]
    accounts = AuthServiceClient(url)
    try:
        if argv[0] == "add-user":
            add_user(accounts, url, argv[1])
        else:
            grant(accounts, url, *argv[1:4])
    except MlflowException as error:
        what = "account" if argv[0] == "add-user" else "grant"
        sys.exit(f"Error: the server refused the {what}: {error.message.splitlines()[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
