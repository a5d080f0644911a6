"""Every private API of a dependency the machinery uses, where no public one does the job, each
pinned by ``tests/test_private.py``: an upgrade that changes one fails there, loudly.

* Lightning's ``_SubprocessScriptLauncher``, subclassed (it has no hook to watch the processes it
  starts: ``launch``, ``_call_children_scripts()``, ``procs``) and installed by
  ``_configure_launcher()`` (of ``DDPStrategy`` and ``ModelParallelStrategy``) as ``_launcher``;
  ``_set_num_threads_if_needed``.
* Lightning's loop progress counters, read where a resumed epoch starts and whether an epoch ran
  to its end (``lib/lightning_exact/checkpoints/resume.py``):
  ``fit_loop.epoch_progress.current.started|processed`` and
  ``fit_loop.epoch_loop.batch_progress.current.processed`` (public names, no stable API).
* Lightning's fit loop's training loader (``fit_loop._combined_loader`` and the
  ``fit_loop._data_fetcher`` iterating it), dropped by :func:`forget_train_loader` when
  ``Trainer.estimated_stepping_batches`` built it before a checkpoint's loop state was restored
  (Lightning#20550; ``lib/lightning_exact/training/trainer.py``).
* Lightning's own decision to send a training step's values to the loggers
  (``trainer._logger_connector.should_update_logs``, which its ``LearningRateMonitor`` reads as
  well), and whether a batch only accumulates gradients (``fit_loop._should_accumulate()``):
  :mod:`lightning_exact.training.steps` counts a job's steps as Lightning counts them for its
  loggers; and
  the batches a job has trained (``fit_loop.epoch_loop.batch_progress.total.processed``, public
  names, no stable API): a model that steps its own optimizers counts a batch as a step.
* Lightning's result collection of the training loop (``fit_loop.epoch_loop._results``: its
  ``valid_items()``, each ``_ResultMetric``'s ``meta``, ``compute()``, ``reset()``,
  ``_forward_cache`` and ``has_reset``), where :mod:`lightning_exact.training.train_points` closes
  the window of the values a task logs at epoch level every ``log_every_n_steps`` steps; and
  ``_logger_connector.update_train_step_metrics()``, which a stop at a logging step calls to send
  that step's values before it ends the job (Lightning sends them after every batch-end hook).
* Lightning's ``RichProgressBar._get_train_description``, whose "Epoch N/max" reads "Epoch 0/-2"
  for a job counted in steps: ``trainer.RichBar`` drops the "/-2".
* Lightning's ``TensorBoardLogger._experiment`` (the writer, ``None`` until opened), read by
  ``tracking.OneFileTensorBoardLogger``: its public ``experiment`` opens a writer, and so an
  events file, on a job that fails before logging anything.
* Lightning's layout of a sharded checkpoint folder (``ModelParallelStrategy.save_checkpoint``
  with ``save_distributed_checkpoint``): ``meta.pt`` (``lightning.fabric.utilities.load.
  _METADATA_FILENAME``) beside torch's shards of ``state_dict`` and ``optimizer_<n>``, read by
  ``lib/lightning_exact/training/sharded.py``; and the entries of torch's
  ``FileSystemReader.read_metadata(). storage_data`` (``_StorageInfo``: ``relative_path``,
  ``offset``, ``length``), which say what each shard file must hold.
* MLflow's ``SystemMetricsMonitor`` samplers without its loop, which stops at a failed request
  (``collect_metrics()``, ``aggregate_metrics()``, ``monitors``, ``clear_metrics()``).
* MLflow's run-context tag registry (``resolve_tags``): an offline run is created by src.sync,
  elsewhere, so its source tags are taken when the job runs, as ``mlflow.start_run`` takes them.
* LitData, for ``s3://`` shards (``src/task/data/shards.py``): ``_OBSTORE_CLIENT_OPTIONS`` of
  ``downloader`` (``http://``), ``StreamingDataset._create_cache(worker_env=_WorkerEnv.detect())``
  and ``on_demand_bytes = False`` (whole shards into the cache, not a request per sample);
  ``litdata.utilities.format._convert_bytes_to_int`` (``data.max_cache_size`` as LitData reads it).
* torch's differentiable all-gather, ``torch.distributed._functional_collectives.
  all_gather_single`` (its backward reduce-scatters the gradient), to which torch 2.13's deprecation
  of the public ``torch.distributed.nn.functional`` collectives points; and the autograd function of
  ``nn.SyncBatchNorm``'s training forward, ``torch.nn.modules._functions.SyncBatchNorm``, which the
  global-batch BatchNorm (``lib/lightning_exact/training/exact.py``) applies on GPUs without taking
  the class ``nn.SyncBatchNorm`` (whose modules are no ``nn.BatchNorm2d``: FSDP's sharded blocks
  name that class).
* Lightning's ``_ForwardRedirection`` (how ``DDPStrategy`` runs ``training_step`` through the
  DDP wrapper): it calls the module with ``forward`` replaced on the instance, so the first-batch
  check of ``lib/lightning_exact/training/exact.py`` tells a training step from a forward
  (:func:`forward_redirected`).
* torch's schema of an aten op (``OpOverload._schema.arguments``: each argument's ``name``,
  ``has_default_value()``, ``default_value``), by which the first-batch check of
  ``lib/lightning_exact/training/exact.py`` reads a random op's ``dropout_p``, ``p`` or ``train``
  (the CPU's fused attention op is tagged random whatever its ``dropout_p``): :func:`op_arguments`.
"""

from typing import Any

from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from torch.distributed._functional_collectives import (
    all_gather_single as differentiable_all_gather,
)
from torch.nn.modules._functions import SyncBatchNorm as SyncBatchNormFunction

__all__ = [
    "SubprocessScriptLauncher",
    "SyncBatchNormFunction",
    "differentiable_all_gather",
    "accumulating",
    "batches_done",
    "epoch_level_training_results",
    "forget_step_values",
    "forget_train_loader",
    "forward_redirected",
    "logged_as_tensor",
    "op_arguments",
    "reset_window",
    "run_context_tags",
    "send_step_values",
    "sends_step_values",
    "set_num_threads_if_needed",
]


def forget_train_loader(trainer: Any) -> None:
    """Drop the fit loop's training loader and stop its iterator (and its loader workers): the
    fit loop builds and iterates it again when fitting starts (``_FitLoop.setup_data``)."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
    loop._combined_loader = None


def sends_step_values(trainer: Any) -> bool:
    """Whether Lightning sends this training step's values to the loggers: every
    ``trainer.log_every_n_steps``-th of the batches that step the optimizers (Lightning's count
    for its loggers: a batch, however many optimizers it steps; under gradient accumulation
    also the batches that accumulate towards such a step), and when the job is to stop."""
    return trainer._logger_connector.should_update_logs


def accumulating(trainer: Any) -> bool:
    """Whether this training batch only accumulates gradients (``accumulate_grad_batches``):
    the optimizers step at a later batch."""
    return trainer.fit_loop._should_accumulate()


def batches_done(trainer: Any) -> int:
    """The training batches the job has trained, this one included while its hooks run (and
    across a resume: Lightning's loop state travels in checkpoints)."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.processed


def epoch_level_training_results(trainer: Any) -> list[Any]:
    """The training loop's results logged at epoch level (for the loggers) since their last
    reset: Lightning's ``_ResultMetric`` of each, wrapping a torchmetrics ``Metric`` or a
    tensor's running reduction."""
    results = trainer.fit_loop.epoch_loop._results
    return [r for _, r in results.valid_items() if r.meta.on_epoch and r.meta.logger]


def logged_as_tensor(result: Any) -> bool:
    """Whether a result of :func:`epoch_level_training_results` is a tensor's running reduction
    (Lightning's own state), not a torchmetrics ``Metric`` of the model."""
    return result.is_tensor


def reset_window(result: Any) -> None:
    """Reset a result of :func:`epoch_level_training_results` (a metric's states, or a tensor's
    reduction) for the next window; one also logged at each step keeps this step's value."""
    step_value = result._forward_cache
    result.reset()
    if result.meta.on_step:
        result._forward_cache = step_value
        result.has_reset = False


def forget_step_values(trainer: Any, fx: str, names: set[str]) -> None:
    """Drop ``names``, logged in hook ``fx`` for one step only, at an earlier step: Lightning
    keeps such a value and sends it again at every logging step of the epoch."""
    for result in trainer.fit_loop.epoch_loop._results.values():
        meta = result.meta
        if meta.fx == fx and meta.name in names and not meta.on_epoch and not result.has_reset:
            result.reset()


def send_step_values(trainer: Any) -> None:
    """Send this training step's values to the loggers now, as Lightning does once every
    batch-end hook has run (at a logging step; at the others it sends nothing)."""
    trainer._logger_connector.update_train_step_metrics()


def run_context_tags(tags: dict[str, str]) -> dict[str, str]:
    """``tags`` with MLflow's own of this process: source name and type, user, git commit."""
    from mlflow.tracking.context.registry import resolve_tags  # mlflow loads slowly: not here

    return resolve_tags(tags)


def forward_redirected(module: Any) -> bool:
    """Whether a call of ``module`` runs another of its methods than its forward: Lightning's
    ``_ForwardRedirection`` sets ``forward`` on the instance for the call (a training step
    through the DDP wrapper), then its own bound ``forward`` back."""
    own = vars(module).get("forward")
    return own is not None and getattr(own, "__func__", None) is not type(module).forward


def op_arguments(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of aten op ``op`` by name, their defaults filled in."""
    schema = op._schema.arguments
    defaults = {arg.name: arg.default_value for arg in schema if arg.has_default_value()}
    return defaults | {arg.name: value for arg, value in zip(schema, args, strict=False)} | kwargs
