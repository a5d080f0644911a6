"""Yours: what a forker edits. Datasets (``data/``), networks (``nets/``), the LightningModule
(``model.py``), what the served model is (``export.py``) and what is reported (``report.py``).

``TASK`` is the one contract with the template's machinery (``lib/lightning_exact/task.py``): the
entry points hand it over, and the machinery never imports this package. Another kind of task (a
regression, segmentation, text) is another ``TASK``, not a machinery edit."""

from lightning_exact import Task

from src.task import export, model, report
from src.task.data import DATAMODULES
from src.task.nets import UnknownNetwork
from src.task.predict_images import predict_images

TASK = Task(
    datamodules=DATAMODULES,
    model_class=model.ImageClassifier,
    build_model=model.build,
    config_targets=model.config_targets,
    monitor="val/acc",  # its best so far, val/acc_best, is what a sweep job returns
    mode="max",
    errors=(UnknownNetwork,),
    sharded_blocks=model.SHARDED_BLOCKS,
    export=export.export,
    figures=report.figures,
    predictions=report.predictions,
    predict_inputs=predict_images,  # src.predict inputs=... (or images=...): image files
)
