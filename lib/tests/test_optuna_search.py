"""Resuming an Optuna search (``hydra_plugins/optuna_search``), run for real on tiny data: new
trials never repeat a finished trial's parameters, a search with other fixed settings does not
join the study, and a resume with nothing left to run says so and writes nothing."""

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import run_entry
from tests.test_sweeps import runs_by_job, sweep_folders, sweep_overrides

# In parallel runs (-n), one worker runs this module: its tests share the resumed search.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("optuna-search")]

STUDY = "mlp-synthetic"  # the test project's search: mlp-${data.name}


def search(workdir: Path, tiny_root: Path, n_trials: int, *extra: str, check: bool = True):
    """``python -m src.train -m hparams_search=mlp_optuna`` with tiny-data sizes, 1 epoch."""
    return run_entry(
        "train",
        "-m",
        "hparams_search=mlp_optuna",
        *sweep_overrides(tiny_root),
        f"hydra.sweeper.n_trials={n_trials}",
        *extra,
        cwd=workdir,
        check=check,
    )


def load_study(workdir: Path, name: str = STUDY) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{workdir / 'optuna.db'}")


@pytest.fixture(scope="module")
def resumed(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A search of 2 trials, then the same command asking for 3: the launch folder."""
    workdir = tmp_path_factory.mktemp("resumed")
    search(workdir, tiny_root, 2)
    search(workdir, tiny_root, 3)
    return workdir


def test_a_resume_adds_trials_with_new_parameters(resumed: Path) -> None:
    trials = load_study(resumed).trials
    assert [t.number for t in trials] == [0, 1, 2]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    # The resumed run's sampler started from the same seed before the fix: trial 2 was trial 0.
    assert trials[2].params not in (trials[0].params, trials[1].params)
    assert not any("same_params_as_trial" in t.user_attrs for t in trials), "all were trained"
    _, second = sweep_folders(resumed)
    assert sorted(p.name for p in second.iterdir() if p.is_dir()) == ["2"]
    runs = runs_by_job(resumed / "mlflow.db")
    assert sorted(runs) == [0, 1, 2]
    assert len({run.data.params["model.lr"] for run in runs.values()}) == 3, "3 trained points"


def test_a_resume_with_nothing_left_says_so_and_writes_nothing(
    resumed: Path, tiny_root: Path
) -> None:
    before = sweep_folders(resumed)
    proc = search(resumed, tiny_root, 3)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"study {STUDY} already holds 3 finished trials" in lines[0]
    assert "raise n_trials to add trials" in lines[0]
    assert sweep_folders(resumed) == before, "no new sweep folder"
    assert len(load_study(resumed).trials) == 3
    assert sorted(runs_by_job(resumed / "mlflow.db")) == [0, 1, 2], "no new MLflow run"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["strategy=ddp", "devices=2"], "devices: 1 in the study, 2 here"),
        (["trainer.max_epochs=2"], "trainer.max_epochs: 1 in the study, 2 here"),
    ],
)
def test_a_search_with_other_fixed_settings_is_refused(
    resumed: Path, tiny_root: Path, overrides: list[str], named: str
) -> None:
    before = sweep_folders(resumed)
    proc = search(resumed, tiny_root, 4, *overrides, check=False)
    assert proc.returncode == 1
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: study {STUDY} in sqlite:///"), lines
    assert named in lines[0] and f"hydra.sweeper.study_name={STUDY}-2" in lines[0]
    if "devices=2" in overrides:
        assert "world_size: 1 in the study, 2 here" in lines[0]
    assert sweep_folders(resumed) == before and len(load_study(resumed).trials) == 3


def test_a_proposal_equal_to_a_finished_trial_is_not_trained_again(
    tiny_root: Path, tmp_path: Path
) -> None:
    # A search space of one point: the second proposal can only repeat the first.
    conf = tmp_path / "conf" / "hparams_search"
    conf.mkdir(parents=True)
    (conf / "one_point.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /hydra/sweeper: optuna_search\n"
        "hydra:\n  sweeper:\n    study_name: one-point\n    storage: sqlite:///optuna.db\n"
        "    seed: 0\n    params:\n      model.lr: {type: categorical, choices: [0.01]}\n"
    )
    run_entry(
        "train",
        "-m",
        "hparams_search=one_point",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        *sweep_overrides(tiny_root),
        "hydra.sweeper.n_trials=2",
        cwd=tmp_path,
    )
    first, second = load_study(tmp_path, "one-point").trials
    assert first.params == second.params and second.value == first.value
    assert second.user_attrs["same_params_as_trial"] == 0
    (sweep,) = sweep_folders(tmp_path)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"], "trained once"
    assert sorted(runs_by_job(tmp_path / "mlflow.db")) == [0]
