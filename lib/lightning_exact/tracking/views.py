"""The runs view a sweep is reviewed in. MLflow's runs table shows no metric by default; its
UI keeps a view (its columns) as an experiment tag, ``mlflow.sharedViewState.<key>``, and opens
it from a link to the runs page (``?viewStateShareKey=<key>``, what its "Share" button makes). A
sweep saves one with its ``optimized_metric`` a column beside the models."""

import json
from typing import Any

from lightning_exact.tracking.store import ui_page

VIEW_TAG = "mlflow.sharedViewState."  # MLflow UI's prefix of a shared view's experiment tag


def sweep_view(metric: str | None) -> str:
    """The view's state as the UI reads it (its columns: a metric is ``metrics.`name```)."""
    columns = ["attributes.`Models`"] + ([f"metrics.`{metric}`"] if metric else [])
    return json.dumps({"selectedColumns": columns})


def save_sweep_view(client: Any, experiment_id: str, key: str, metric: str | None) -> None:
    """The view on the experiment, under ``key`` (the sweep folder's name)."""
    client.set_experiment_tag(experiment_id, VIEW_TAG + key, sweep_view(metric))


def view_page(tracking_uri: str, experiment_id: str, key: str) -> str:
    """The link that opens the view on the experiment's page."""
    route = f"experiments/{experiment_id}/runs"  # the experiment's page reads no shared view
    return ui_page(tracking_uri, route, f"viewStateShareKey={key}&")
