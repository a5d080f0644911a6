"""Test instrument: every process records the samples of each training batch it trains on.

Put this folder on ``PYTHONPATH`` and set ``RECORD_BATCHES=<file>``: each call of the task
model's ``training_step`` (``TASK.model_class``) appends one JSON line ``{"epoch", "batch",
"indices"}`` (the batch's positions in the official training file) to that file, so a test can
see which batches each epoch really trained on.

``RECORD_METRICS=<file>`` instead: each call appends ``{"rank", "epoch", "batch", "added"}``,
what the step added to each torchmetrics state of the model (``{module: {state: value}}``, sum
states), so a test can compute any window of steps' values from the batches themselves.
"""

import json
import os

TARGET = "src.task"  # its TASK names the model class


def patch(module) -> None:
    original = module.TASK.model_class.training_step
    path = os.environ["RECORD_BATCHES"]

    def training_step(self, batch, batch_idx):
        record = {"epoch": self.current_epoch, "batch": batch_idx}
        record["indices"] = batch.indices.tolist()
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
        return original(self, batch, batch_idx)

    module.TASK.model_class.training_step = training_step


def metric_states(model) -> dict[str, dict[str, float]]:
    from torchmetrics import Metric

    return {
        name: {key: float(value) for key, value in sub.metric_state.items()}
        for name, sub in model.named_modules()
        if isinstance(sub, Metric)
    }


def patch_metrics(module) -> None:
    original = module.TASK.model_class.training_step
    path = os.environ["RECORD_METRICS"]

    def training_step(self, batch, batch_idx):
        before = metric_states(self)
        output = original(self, batch, batch_idx)
        after = metric_states(self)
        added = {
            name: {key: value - before[name][key] for key, value in states.items()}
            for name, states in after.items()
            if states != before[name]
        }
        record = {"rank": self.global_rank, "epoch": self.current_epoch, "batch": batch_idx}
        with open(path, "a") as out:
            out.write(json.dumps({**record, "added": added}) + "\n")
        return output

    module.TASK.model_class.training_step = training_step


if os.environ.get("RECORD_BATCHES") or os.environ.get("RECORD_METRICS"):
    from lightning_exact.testing.instruments.patch_after_import import patch_after_import

    patch_after_import(TARGET, patch if os.environ.get("RECORD_BATCHES") else patch_metrics)
