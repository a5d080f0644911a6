"""The template's machinery: distributed training, shutdown, checkpoints, tracking, reporting,
Trainer assembly and config checks. It never imports a dataset, network or LightningModule by
name (``tests/test_layout.py`` checks): it takes them from config or as arguments, through the
data contract in :mod:`src.template.data`."""
