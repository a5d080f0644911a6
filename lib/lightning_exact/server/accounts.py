"""The service's account commands (``python -m lightning_exact.server add-user|grant``), written
into the accounts' database through MLflow's own store of accounts (docs/tracking-server.md:
Accounts). They do not sign in to the service: no
wrong password of a local user, counted against the address they share, can refuse them, and they
need no password (PostgreSQL's socket is root's and the service's user's only):

    python accounts.py add-user NAME                          # as tracking.sh runs them
    python accounts.py grant NAME EXPERIMENT READ|EDIT|MANAGE|NONE
    python accounts.py grant others EXPERIMENT NONE|READ

``others`` is every account without a permission of its own on the experiment, now and added
later: the private experiments are kept in the accounts' database, and add-user denies each new
account every one of them. tracking.sh gives the settings: TRACKING_URL (for the messages),
ACCOUNTS_DATABASE, RUNS_DATABASE, TRACKING_USER_PASSWORD (add-user: the new account's password;
else a random one, printed once).
"""

import contextlib
import os
import secrets
import sys

import sqlalchemy
from mlflow.exceptions import MlflowException
from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore as AccountsStore
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as RunsStore

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


def add_user(accounts: AccountsStore, url: str, name: str) -> None:
    if name == OTHERS:
        sys.exit(f"Error: {OTHERS} is the name grant gives every other account: choose another")
    chosen = os.environ.get("TRACKING_USER_PASSWORD")
    password = chosen or secrets.token_urlsafe(18)
    accounts.create_user(name, password)
    with private_experiments().begin() as db:
        closed = db.execute(sqlalchemy.text(f"SELECT id FROM {PRIVATE}")).scalars().all()
    for experiment_id in closed:
        accounts.create_experiment_permission(experiment_id, name, PERMISSIONS["NONE"])
    print(
        f"Account {name} created on {url} (it may create experiments of its own and read others' "
        "that are not private; to write into another's: grant)."
    )
    if not chosen:
        print(f"Its password (shown once, give it to {name}): {password}")


def own_permission(accounts: AccountsStore, name: str, experiment_id: str) -> str | None:
    """The permission ``name`` was given on the experiment itself (None: the default's)."""
    try:
        return accounts.get_experiment_permission(experiment_id, name).permission
    except MlflowException:
        return None


def give(accounts: AccountsStore, name: str, experiment_id: str, permission: str) -> None:
    """``name``'s permission on the experiment becomes ``permission`` (one given is replaced)."""
    accounts.get_user(name)  # an account that does not exist is named
    with contextlib.suppress(MlflowException):  # none given yet
        accounts.delete_experiment_permission(experiment_id, name)
    accounts.create_experiment_permission(experiment_id, name, permission)


def set_others(accounts: AccountsStore, experiment_id: str, permission: str) -> None:
    """NONE: every account without a permission of its own may not read the experiment, nor any
    account added later; READ: every account denied it may read it again (MLflow's default)."""
    names = [user.username for user in accounts.list_users() if not user.is_admin]
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
            accounts.delete_experiment_permission(experiment_id, name)


def grant(accounts: AccountsStore, url: str, name: str, experiment: str, permission: str):
    runs = RunsStore(os.environ["RUNS_DATABASE"], "mlflow-artifacts:/")
    found = runs.get_experiment_by_name(experiment)
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
    accounts = AccountsStore()
    accounts.init_db(os.environ["ACCOUNTS_DATABASE"])
    try:
        if argv[0] == "add-user":
            add_user(accounts, url, argv[1])
        else:
            grant(accounts, url, *argv[1:4])
    except MlflowException as error:
        what = "account" if argv[0] == "add-user" else "grant"
        sys.exit(f"Error: the {what} was refused: {error.message.splitlines()[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
