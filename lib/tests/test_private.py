"""Every private API of a dependency that the machinery uses (lib/lightning_exact/private.py),
pinned:
an upgrade that renames or reshapes one fails here, loudly, not in a job."""

import inspect
import warnings
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning_exact.private import (
    SubprocessScriptLauncher,
    SyncBatchNormFunction,
    accumulating,
    batches_done,
    differentiable_all_gather,
    epoch_level_training_results,
    forget_step_values,
    forget_train_loader,
    forward_redirected,
    op_arguments,
    reset_window,
    run_context_tags,
    send_step_values,
    sends_step_values,
    set_num_threads_if_needed,
)


def test_lightnings_subprocess_launcher_has_what_the_watched_launcher_uses() -> None:
    assert callable(SubprocessScriptLauncher._call_children_scripts)
    assert list(inspect.signature(SubprocessScriptLauncher.launch).parameters)[:3] == [
        "self",
        "function",
        "args",
    ]
    launcher = SubprocessScriptLauncher.__new__(SubprocessScriptLauncher)
    launcher.__init__(cluster_environment=None, num_processes=2, num_nodes=1)
    assert launcher.procs == [], "the started rank processes are read from .procs"
    for strategy in (DDPStrategy, ModelParallelStrategy):  # the watched DDP and FSDP
        assert callable(strategy._configure_launcher)
        assert "_launcher" in inspect.getsource(strategy._configure_launcher)


def test_lightnings_thread_setting_takes_the_process_count() -> None:
    assert list(inspect.signature(set_num_threads_if_needed).parameters) == ["num_processes"]


def test_lightnings_loop_progress_counts_what_resume_reads() -> None:
    import lightning.pytorch as L

    loop = L.Trainer(logger=False, enable_checkpointing=False).fit_loop
    epochs, batches = loop.epoch_progress.current, loop.epoch_loop.batch_progress.current
    assert (epochs.started, epochs.processed, batches.processed) == (0, 0, 0)


def test_lightnings_fit_loop_builds_its_train_loader_once_and_again_when_forgotten() -> None:
    """The template's Trainer drops a train loader that estimated_stepping_batches built before
    a checkpoint's position was restored; the fit loop must then build it anew."""
    import lightning.pytorch as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loops.fit_loop import _FitLoop

    assert "self.fit_loop.setup_data()" in inspect.getsource(
        L.Trainer.estimated_stepping_batches.fget
    ), "estimated_stepping_batches builds the loader (Lightning#20550)"
    assert "if self._combined_loader is not None and not self._should_reload_train_dl:" in (
        inspect.getsource(_FitLoop.setup_data)
    ), "a built loader is kept"
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(BoringModel())
    trainer._data_connector.attach_data(trainer.lightning_module)
    trainer.state.fn = "fit"
    assert trainer.fit_loop._combined_loader is None and trainer.fit_loop._data_fetcher is None
    trainer.fit_loop.setup_data()
    built = trainer.fit_loop._combined_loader
    assert built is not None and trainer.fit_loop._data_fetcher is not None
    forget_train_loader(trainer)
    assert trainer.train_dataloader is None
    trainer.fit_loop.setup_data()
    assert trainer.fit_loop._combined_loader not in (None, built), "built anew"


def test_lightnings_rich_bar_describes_the_epoch_as_the_rich_bar_edits_it() -> None:
    from lightning.pytorch.callbacks import RichProgressBar

    source = inspect.getsource(RichProgressBar._get_train_description)
    assert 'f"Epoch {current_epoch}"' in source and 'f"/{self.trainer.max_epochs - 1}"' in source


def test_lightnings_tensorboard_writer_is_none_until_opened(tmp_path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    assert logger._experiment is None
    assert logger.experiment is logger._experiment is not None
    assert list(tmp_path.rglob("events.out.tfevents.*")), "opening it makes the events file"


def test_mlflows_system_metrics_samplers_are_usable_without_its_loop() -> None:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor("", sampling_interval=1, tracking_uri="sqlite:///:memory:")
    monitor.collect_metrics()
    readings = monitor.aggregate_metrics()
    assert any(key.startswith("cpu_utilization") for key in readings), readings
    for sampler in monitor.monitors:
        sampler.clear_metrics()
    assert monitor.sampling_interval == 1


def test_mlflows_run_context_tags_are_those_a_started_run_gets() -> None:
    tags = run_context_tags({"team": "vision"})
    assert tags["team"] == "vision"
    # and the git commit, where the entry script is in a checkout (test_train.py checks a job's)
    assert {"mlflow.source.name", "mlflow.source.type", "mlflow.user"} <= set(tags), tags


def test_litdatas_internals_that_data_shards_uses_for_remote_reads() -> None:
    """src/task/data/shards.py, reading s3:// shards (LitData is pinned in constraints.txt)."""
    from litdata import StreamingDataset
    from litdata.streaming import downloader
    from litdata.utilities.env import _WorkerEnv
    from litdata.utilities.format import _convert_bytes_to_int

    assert isinstance(downloader._OBSTORE_CLIENT_OPTIONS, dict), "allow_http is set there"
    assert callable(_WorkerEnv.detect)
    assert list(inspect.signature(StreamingDataset._create_cache).parameters) == [
        "self",
        "worker_env",
    ]
    assert "self.on_demand_bytes" in inspect.getsource(StreamingDataset)
    assert _convert_bytes_to_int("10GB") == 10**10 and _convert_bytes_to_int("1.5MB") == 1_500_000


def test_lightnings_sharded_checkpoint_layout_is_the_one_sharded_reads() -> None:
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from lightning_exact.training.sharded import META_FILE

    assert _METADATA_FILENAME == META_FILE
    source = inspect.getsource(ModelParallelStrategy.save_checkpoint)
    assert '{"state_dict": checkpoint.pop("state_dict")}' in source
    assert 'f"optimizer_{idx}": optim_state' in source


def test_torchs_shard_index_names_each_file_and_its_extent(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    (where,) = dcp.FileSystemReader(tmp_path).read_metadata().storage_data.values()
    assert (tmp_path / where.relative_path).stat().st_size >= where.offset + where.length > 0


def test_torchs_differentiable_all_gather_carries_gradients() -> None:
    """On a real (one-rank) gloo group: the rows gathered along dimension 0, and a backward that
    reaches the input. Two ranks, their gradients summed: tests/test_exact.py."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        values = torch.tensor([[1.0, 2.0]], requires_grad=True)
        gathered = differentiable_all_gather(values * 3, 0, dist.group.WORLD)
        (gathered * torch.tensor([1.0, 10.0])).sum().backward()
        assert torch.equal(gathered.detach(), torch.tensor([[3.0, 6.0]]))
        assert torch.equal(values.grad, torch.tensor([[3.0, 30.0]]))
    finally:
        dist.destroy_process_group()


def test_torchs_sync_batchnorm_function_takes_what_the_global_batchnorm_passes() -> None:
    assert list(inspect.signature(SyncBatchNormFunction.forward).parameters) == [
        "self",
        "input",
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "eps",
        "momentum",
        "process_group",
        "world_size",
    ]
    assert callable(SyncBatchNormFunction.apply)


def test_lightnings_training_results_have_what_training_points_use() -> None:
    """lightning_exact.training.train_points reads and resets the training loop's results (its
    test in
    tests/test_steps.py runs them in a real Trainer)."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (
        _LoggerConnector,
    )
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    results = trainer.fit_loop.epoch_loop._results
    assert isinstance(results, _ResultCollection) and results.training
    results.log("training_step", "both", torch.tensor(2.0), on_step=True, on_epoch=True)
    results.log("training_step", "epoch", torch.tensor(3.0), on_step=False, on_epoch=True)
    results.log("on_train_batch_end", "step", torch.tensor(4.0), on_step=True, on_epoch=False)
    found = {r.meta.forked_name(on_step=False): r for r in epoch_level_training_results(trainer)}
    assert found.keys() == {"both_epoch", "epoch"}
    assert [float(r.compute()) for r in found.values()] == [2.0, 3.0]
    for result in found.values():
        reset_window(result)
    assert float(found["both_epoch"]._forward_cache) == 2.0, "the step's value kept"
    assert not found["both_epoch"].has_reset and found["epoch"].has_reset
    forget_step_values(trainer, "on_train_batch_end", {"step"})
    assert results["on_train_batch_end.step"].has_reset
    assert send_step_values.__doc__ and callable(_LoggerConnector.update_train_step_metrics)


def test_torchs_op_schema_names_what_the_first_batch_check_reads() -> None:
    """The CPU's fused attention op, tagged random whatever its dropout_p, and a dropout op."""
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.zeros(1, 1, 2, 4)
    assert op_arguments(attention, (q, q, q), {})["dropout_p"] == 0.0
    assert op_arguments(attention, (q, q, q, 0.1, True), {})["dropout_p"] == 0.1
    dropout = torch.ops.aten.native_dropout.default
    assert op_arguments(dropout, (q, 0.0, False), {}) | {"input": None} == {
        "input": None,
        "p": 0.0,
        "train": False,
    }


def test_lightnings_counts_of_batches_and_steps_for_its_loggers() -> None:
    """Two batches a step, a step's values sent every 2nd step (and at the batches that
    accumulate towards it): the job's batches, whether each only accumulates, whether Lightning
    sends its values, as lib/lightning_exact/training/steps.py reads them at a batch's end."""
    import lightning.pytorch as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = []

    class CountsEachBatch(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            seen.append((batches_done(trainer), accumulating(trainer), sends_step_values(trainer)))

    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CountsEachBatch()],
    )
    trainer.fit(BoringModel())
    assert seen == [
        (1, True, False),
        (2, False, False),
        (3, True, True),
        (4, False, True),
        (5, True, False),
        (6, False, False),
    ]


def test_lightnings_ddp_runs_the_training_step_as_the_modules_forward() -> None:
    """DDPStrategy.training_step calls the DDP wrapper, whose forward calls the module with its
    ``forward`` replaced on the instance by the training step (_ForwardRedirection)."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    module = BoringModel()
    seen = []

    class Wrapper(torch.nn.Module):
        def forward(self, *args: object) -> object:
            seen.append(forward_redirected(module))
            return module(*args)

    module.training_step = lambda *args: seen.append(forward_redirected(module)) or "step"
    assert _ForwardRedirection()(Wrapper(), module, "training_step", 1) == "step"
    assert seen == [True, False], "redirected around the call; its own forward inside it"
    assert not forward_redirected(module), "restored after it"
