"""The guides' sweeps as the pages write them (README's DDP sweep, docs/sweeps.md's Optuna search
of DDP jobs), run on the example task's tiny job: each job its own world, every trial on every
rank. The sweeps' machinery on its own test task: lib/tests/test_sweeps.py.

Typed as a user types them: the sweep folder is Hydra's default,
``outputs/train/multiruns/<time>``."""

import itertools
from pathlib import Path

import optuna
import pytest
import torch
from lightning_exact.training.distributed import hparams_digest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from tests.conftest import HARNESS
from tests.template.test_readme import arguments, override, page_command, split_top_level

pytestmark = pytest.mark.slow
run_entry = HARNESS.run_entry


def sweep_overrides(tiny_root: Path) -> list[str]:
    # lr is what the sweeps vary, so it is left out of the shared tiny overrides.
    shared = HARNESS.tiny_overrides(tiny_root)
    shared = [o for o in shared if not o.startswith(("model.lr=", "trainer."))]
    return [*shared, "trainer.max_epochs=1"]


def sweep_folders(workdir: Path) -> list[Path]:
    """The sweeps launched from ``workdir``, in the default layout, oldest first."""
    return sorted((workdir / "outputs" / "train" / "multiruns").iterdir())


def runs_by_job(store: Path) -> dict[int, object]:
    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name(HARNESS.data_name).experiment_id])
    return {int(run.data.tags["sweep.job"]): run for run in runs if "sweep.job" in run.data.tags}


def rank_lines(job_dir: Path) -> list[str]:
    """What each rank of a job logged about the world and hyperparameters it trained with."""
    logs = [job_dir / "train.log", *sorted(job_dir.glob("train_ddp_process_*.log"))]
    return [line for log in logs for line in log.read_text().splitlines() if " fit: " in line]


def trained_lr(job_dir: Path) -> tuple[float, str]:
    """The lr in the job's checkpoint and the digest its ranks log of its hyperparameters."""
    saved = torch.load(job_dir / "checkpoints" / "last.ckpt", weights_only=True)
    hparams = saved["hyper_parameters"]
    return hparams["lr"], f"hyperparameters md5 {hparams_digest(hparams)}"


def test_the_guides_ddp_sweep_runs_every_job_once_with_its_own_world(
    tiny_root: Path, tmp_path: Path
) -> None:
    """The README's DDP sweep as written: devices x learning rates, each job its own world."""
    command = page_command("test_the_guides_ddp_sweep_runs_every_job_once_with_its_own_world")
    run_entry("train", *arguments(command), *sweep_overrides(tiny_root), cwd=tmp_path)
    worlds, lrs = (split_top_level(override(command, key)) for key in ("devices", "model.lr"))
    expected = dict(enumerate(itertools.product(worlds, lrs)))
    (sweep,) = sweep_folders(tmp_path)
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        [*map(str, expected), "jobs.csv", "mlflow_parent_run.json", "multirun.yaml"]
    )
    assert [p.name for p in (tmp_path / "outputs" / "train").iterdir()] == ["multiruns"], (
        "no rank ran a job or sweep of its own elsewhere"
    )
    runs = runs_by_job(tmp_path / "mlflow.db")
    assert {
        job: (r.data.params["world_size"], r.data.params["model.lr"]) for job, r in runs.items()
    } == expected
    assert len({run.data.tags["sweep.id"] for run in runs.values()}) == 1
    assert all(run.info.status == "FINISHED" for run in runs.values())
    # Each run is named for what its job varies (DDP jobs run as their own process tree too).
    assert {job: (r.info.run_name, r.data.tags["world_size"]) for job, r in runs.items()} == {
        job: (f"devices={world} lr={lr} convnet", world) for job, (world, lr) in expected.items()
    }
    for job, (world, lr) in expected.items():
        lines = rank_lines(sweep / str(job))
        assert len(lines) == int(world), "one line per rank, each in the job's own folder"
        trained, digest = trained_lr(sweep / str(job))
        assert trained == float(lr)
        for rank, line in enumerate(lines):
            assert f"rank {rank}/{world} " in line and digest in line
            assert f": lr={trained} " in line, "the lr, as docs/sweeps.md says"


def test_optuna_search_trains_each_trial_on_every_rank(tiny_root: Path, tmp_path: Path) -> None:
    """docs/sweeps.md's Optuna search of DDP jobs, as written (2 trials)."""
    command = page_command("test_optuna_search_trains_each_trial_on_every_rank")
    run_entry(
        "train",
        *arguments(command),
        *sweep_overrides(tiny_root),
        "hydra.sweeper.n_trials=2",
        cwd=tmp_path,
    )
    (sweep,) = sweep_folders(tmp_path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"  # the default: optuna.db in the launch folder
    runs = runs_by_job(tmp_path / "mlflow.db")
    assert sorted(runs) == [0, 1]
    for job, run in runs.items():
        assert run.data.params["world_size"] == "2"
        lines = rank_lines(sweep / str(job))
        assert len(lines) == 2
        trained, digest = trained_lr(sweep / str(job))
        assert trained == float(run.data.params["model.lr"])
        assert all(digest in line for line in lines), "both ranks train the trial's lr"
    result = OmegaConf.load(sweep / "optimization_results.yaml")
    best = max(run.data.metrics["val/acc_best"] for run in runs.values())
    assert result.best_value == pytest.approx(best)
    study_name = override(command, "hydra.sweeper.study_name")
    study = optuna.load_study(study_name=study_name, storage=storage)
    assert len(study.trials) == 2 and study.best_value == pytest.approx(best)
