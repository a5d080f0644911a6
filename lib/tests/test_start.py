"""Where a training job starts (lib/lightning_exact/job/start.py): what ckpt_path=auto says in a new
folder, and when a checkpoint's job counts as finished. The whole sequence (stop, refused resume,
resume as printed, read back, lengthened) runs in tests/test_resume.py."""

import json
from pathlib import Path

import pytest
from lightning_exact.job.settings import JobSettings
from lightning_exact.job.start import finished_job_run, say_auto_started_fresh, say_world_change
from mlflow import MlflowClient

from tests.test_config import compose_config


def test_ckpt_path_auto_in_a_new_folder_says_it_started_fresh_and_how_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = compose_config("train", ["ckpt_path=auto"], tmp_path)
    say_auto_started_fresh(Path(cfg.paths.output_dir))
    (line,) = capsys.readouterr().out.splitlines()
    out = cfg.paths.output_dir
    assert f"{out} is a new folder, with no last.ckpt: this job starts fresh" in line
    assert f"hydra.run.dir={out} ckpt_path=auto" in line
    compose_config("train", ["ckpt_path=auto", f"hydra.run.dir={tmp_path}"], tmp_path)
    say_auto_started_fresh(tmp_path)  # a folder of the user's choosing: nothing to say
    assert capsys.readouterr().out == ""


def test_a_job_finished_when_its_job_json_says_so_not_when_lightning_ended_its_run(
    tmp_path: Path,
) -> None:
    cfg = compose_config("train", [], tmp_path)
    client = MlflowClient(cfg.logger.tracking_uri)
    run_id = client.create_run(client.create_experiment("mnist")).info.run_id
    client.set_terminated(run_id, "FINISHED")  # as Lightning ends it after fit, before testing
    saved = {"mlflow": {"run_id": run_id, "tracking_uri": cfg.logger.tracking_uri}}
    folder = tmp_path / "job"
    last = str(folder / "checkpoints" / "last.ckpt")
    settings = JobSettings.from_config(cfg)
    # No job.json: the run's status says.
    assert finished_job_run(saved, cfg.logger, settings, last) == run_id
    folder.mkdir()
    (folder / "job.json").write_text(json.dumps({"overrides": []}))
    # Killed before its result: it goes on.
    assert finished_job_run(saved, cfg.logger, settings, last) is None
    (folder / "job.json").write_text(json.dumps({"overrides": [], "result": 0.9}))
    assert finished_job_run(saved, cfg.logger, settings, last) == run_id


def world(world_size: int, num_nodes: int = 1) -> dict:
    """A checkpoint's record of the world its job ran on (``checkpoint.JobRecord``)."""
    return {"job": {"world": {"world_size": world_size, "num_nodes": num_nodes}}}


@pytest.mark.parametrize(
    ("before", "overrides", "said"),
    [
        (
            world(2),
            [],
            "Resuming a job of 2 ranks on 1 rank: the same global batches "
            "(data.batch_size=64: 64 a rank, was 32), so the same result as on 2 ranks",
        ),
        (
            world(1),
            ["devices=4", "data.batch_size=64"],
            "Resuming a job of 1 rank on 4 ranks: "
            "the same global batches (data.batch_size=64: 16 a rank, was 64)",
        ),
        (world(4, num_nodes=2), ["devices=2"], "Resuming a job of 4 ranks (2 nodes) on 2 ranks:"),
        (
            world(2),
            ["strategy.exact=false"],
            "Resuming a job of 2 ranks on 1 rank: "
            "strategy.exact=false: BatchNorm statistics and dropout masks per rank "
            "(data.batch_size=64: 64 a rank, was 32), so not the result it would have had on 2",
        ),
    ],
    ids=["2-to-1", "1-to-4", "nodes", "not-exact"],
)
def test_a_resume_on_another_world_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, before: dict, overrides: list, said: str
) -> None:
    """Spot capacity: a job stopped on N ranks resumed on M says so, and what it means for the
    result (issue 60); the same world, or a checkpoint without the record, says nothing."""
    cfg = compose_config("train", ["data.batch_size=64", "accelerator=cpu", *overrides], tmp_path)
    settings = JobSettings.from_config(cfg)
    say_world_change(before, cfg, settings)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(said) and line.endswith("(docs/resuming.md#on-another-number-of-ranks)")
    for same in (world(settings.world_size), {"job": {"settings": {}}}, {}):
        say_world_change(same, cfg, settings)
        assert capsys.readouterr().out == ""
