"""Test instrument: every process records the samples of each training batch it trains on.

Put this folder on ``PYTHONPATH`` and set ``RECORD_BATCHES=<file>``: each call of the task
model's ``training_step`` (``TASK.model_class``) appends one JSON line ``{"epoch", "batch",
"indices"}`` (the batch's positions in the official training file) to that file, so a test can
see which batches each epoch really trained on.
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


if os.environ.get("RECORD_BATCHES"):
    from tests.patch_after_import import patch_after_import  # the project is on PYTHONPATH too

    patch_after_import(TARGET, patch)
