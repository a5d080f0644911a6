"""SLURM for real: ``slurm/train.sbatch`` and SLURM sweeps on a live local cluster
(``slurm/local-cluster.sh``: two nodes, both this machine)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning_exact.testing.instruments import SIGNAL_AT_STEP
from lightning_exact.testing.processes import processes_with_env, wait_for_file
from lightning_exact.testing.records import assert_same_metrics, read_metrics
from mlflow import MlflowClient

from tests.conftest import HARNESS, PROJECT
from tests.template.launchers import assert_rank_logs, wait_for_job
from tests.template.test_readme import arguments, page_command

epoch_ends = HARNESS.epoch_ends


def only_run(store, experiment=HARNESS.data_name, task="train"):
    from lightning_exact.testing.records import only_run as only_run_in

    return only_run_in(store, experiment, task)


run_entry = HARNESS.run_entry
tiny_overrides = HARNESS.tiny_overrides

SBATCH = PROJECT / "slurm" / "train.sbatch"
EVAL_SBATCH = PROJECT / "slurm" / "eval.sbatch"
INSTRUMENT = SIGNAL_AT_STEP
# In parallel runs (-n), one worker runs these, and the README's sbatch commands: they share the
# cluster's two nodes and its queue, and the time limits below assume a job starts at once.
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Start the local cluster once per test run (root and apt, or SLURM already installed)."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurm/local-cluster.sh)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no SLURM here and no apt-get to install it (slurm/local-cluster.sh)")
    script = PROJECT / "slurm" / "local-cluster.sh"
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def submit(workdir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``sbatch`` from ``workdir`` with this project's Python (or ``env``): the job's id."""
    env = env or {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(PROJECT)}
    proc = subprocess.run(
        ["sbatch", *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=60
    )
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout + proc.stderr
    return job.group(1)


def sbatch(workdir: Path, *args: str) -> tuple[str, str]:
    """:func:`submit`, then wait for the job: (job id, its final state). Not ``sbatch --wait``:
    it polls after 2, 8 and then every 32 s, which made a 12 s job take 42 s."""
    job = submit(workdir, *args)
    return job, wait_for_job(job).rsplit(" -> ", 1)[-1].split("/")[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "per_node", "strategy"), [(1, 2, "ddp"), (2, 1, "ddp"), (2, 1, "fsdp")]
)
def test_sbatch_from_a_fresh_store_matches_two_devices(
    nodes: int,
    per_node: int,
    strategy: str,
    slurm_cluster: None,
    two_devices: dict[str, float],
    tiny_root: Path,
    tmp_path: Path,
) -> None:
    # As docs/clusters.md shows it, on CPU nodes; srun starts both ranks at once on a fresh
    # mlflow.db. Sharded over 2 nodes, FSDP trains what DDP on 2 devices trains.
    job, state = sbatch(
        tmp_path,
        f"--nodes={nodes}",
        f"--ntasks-per-node={per_node}",
        "--gpus-per-node=0",
        str(SBATCH),
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=1",
        f"strategy={strategy}",
    )
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", output[-5000:]
    assert "Traceback" not in output
    run_dir = tmp_path / "outputs" / "train" / "slurm" / job
    assert_same_metrics(run_dir, two_devices)
    node, local = (1, 0) if nodes == 2 else (0, 1)
    assert_rank_logs(run_dir, node, local)  # srun's tasks are the ranks
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    if nodes == 1 or strategy == "fsdp":
        return  # eval.sbatch on one node: tests/test_readme.py runs the command docs show
    # slurm/eval.sbatch across the nodes gives the test metrics training reported.
    ckpt = next(p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt")
    job, state = sbatch(
        tmp_path,
        f"--nodes={nodes}",
        f"--ntasks-per-node={per_node}",
        "--gpus-per-node=0",
        str(EVAL_SBATCH),
        f"ckpt_path={ckpt}",
        f"data.root={tiny_root}",
    )
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED" and "Traceback" not in output, output[-5000:]
    evaluated = read_metrics(tmp_path / "outputs" / "eval" / "slurm" / job)
    trained = read_metrics(run_dir)
    assert evaluated.keys() and all(k.startswith("test/") for k in evaluated)
    assert {k: trained[k] for k in evaluated} == pytest.approx(evaluated, abs=1e-6)
    _, evaluation = only_run(tmp_path / "mlflow.db", task="eval")
    assert evaluation.info.status == "FINISHED" and evaluation.data.params["world_size"] == "2"


@pytest.mark.slow
def test_sbatch_takes_hydra_run_dir_from_its_arguments(
    slurm_cluster: None, tiny_root: Path, tmp_path: Path
) -> None:
    job, state = sbatch(
        tmp_path,
        "--gpus-per-node=0",
        "--ntasks-per-node=1",
        str(SBATCH),
        *tiny_overrides(tiny_root, logger="none"),
        "trainer.max_epochs=1",
        "hydra.run.dir=mine",
    )
    assert state == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-5000:]
    assert read_metrics(tmp_path / "mine")["val/samples"] > 0
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_dead_rank_ends_the_srun_job_within_seconds(
    slurm_cluster: None, tiny_root: Path, tmp_path: Path
) -> None:
    args = [*tiny_overrides(tiny_root), "trainer.max_epochs=500", "hydra.run.dir=run"]
    job = submit(tmp_path, "--gpus-per-node=0", str(SBATCH), *args)
    try:
        wait_for_file(tmp_path / "run/checkpoints/last.ckpt")
        (rank1,) = processes_with_env(SLURM_JOB_ID=job, SLURM_PROCID="1")
        rank1.kill()
        start = time.monotonic()
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout:
            assert time.monotonic() - start < 30, "the job outlived its dead rank by 30 s"
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job])
    assert not processes_with_env(SLURM_JOB_ID=job), "a rank outlived the job"
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert "task 1: Killed" in output, output[-3000:]
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FAILED"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["training", "training-fsdp", "before-training"])
def test_usr1_requeues_and_the_job_resumes_into_the_same_run(
    when: str, slurm_cluster: None, tiny_root: Path, tmp_path: Path
) -> None:
    """``training``: the stop checkpoints at its step and the requeued job resumes from it
    (``-fsdp``: the sharded folder each rank wrote its part of). ``before-training``: the run is
    open but no step ran (every rank pauses in ``setup``, see tests/signal_at_step); the
    requeued job starts over in that same run."""
    epochs = 4
    strategy = "fsdp" if when.endswith("fsdp") else "ddp"
    job = [f"trainer.max_epochs={epochs}", f"strategy={strategy}"]
    args = [*tiny_overrides(tiny_root), *job]
    reference = tmp_path / "reference"
    reference.mkdir()
    run_entry(
        "train",
        *tiny_overrides(tiny_root, logger="none"),
        *job,
        "devices=2",
        "hydra.run.dir=run",
        cwd=reference,
    )
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(PROJECT)}
    if when == "before-training":
        env |= {"PYTHONPATH": f"{INSTRUMENT}:{PROJECT}", "PAUSE_IN_SETUP": "120"}
    job = submit(tmp_path, "--gpus-per-node=0", str(SBATCH), *args, env=env)
    run_dir = tmp_path / "outputs" / "train" / "slurm" / job
    under_way = "mlflow_run_id.txt" if when == "before-training" else "checkpoints/last.ckpt"
    try:
        wait_for_file(run_dir / under_way)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # as --signal=USR1@90
        state = wait_for_job(job)
    finally:
        subprocess.run(["scancel", job])
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"requeueing job {job}" in output, output[-5000:]
    assert state.endswith("COMPLETED/None/1"), f"job states: {state}\n{output[-3000:]}"
    assert_same_metrics(run_dir, read_metrics(reference / "run"))
    client, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    for key in ("train/loss", "val/acc"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == epoch_ends(epochs), key


def mlflow_runs(store: Path) -> list:
    """The jobs' runs, not their sweep's parent run (checked by the sweep tests)."""
    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    return [run for run in runs if "sweep.parent" not in run.data.tags]


@pytest.mark.slow
def test_sweep_jobs_run_as_slurm_jobs_whose_tasks_are_the_ranks(
    slurm_cluster: None, tiny_root: Path, tmp_path: Path
) -> None:
    # The command of README and docs/clusters.md as written, on a fresh store; both jobs start
    # together on the 4-CPU node.
    command = page_command("test_sweep_jobs_run_as_slurm_jobs_whose_tasks_are_the_ranks")
    overrides = [o for o in tiny_overrides(tiny_root) if not o.startswith("model.lr=")]
    proc = run_entry("train", *arguments(command), *overrides, "trainer.max_epochs=1", cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    runs = mlflow_runs(tmp_path / "mlflow.db")
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1, "the SLURM jobs nest under one parent run"
    assert sorted((r.data.params["model.lr"], r.data.tags["sweep.job"]) for r in runs) == [
        ("0.01", "0"),
        ("0.02", "1"),
    ]
    assert all(r.info.status == "FINISHED" and r.data.params["world_size"] == "2" for r in runs)
    (sweep,) = (tmp_path / "outputs/train/multiruns").iterdir()
    for job in ("0", "1"):
        assert_rank_logs(sweep / job, node=0, local=1)  # the job's SLURM tasks are its ranks
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "--ntasks-per-node=2" in script and "--gpus-per-node=0" in script


@pytest.mark.slow
def test_optuna_trials_run_as_slurm_jobs(slurm_cluster: None, tiny_root: Path, tmp_path: Path):
    """docs/clusters.md's Optuna search on SLURM as written (2 trials)."""
    run_entry(
        "train",
        *arguments(page_command("test_optuna_trials_run_as_slurm_jobs")),
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=1",
        "hydra.sweeper.n_trials=2",
        cwd=tmp_path,
    )
    runs = mlflow_runs(tmp_path / "mlflow.db")
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.params["world_size"] for r in runs} == {"2"}


@pytest.mark.slow
def test_a_preempted_slurm_sweep_job_resumes_from_its_checkpoint(
    slurm_cluster: None, tiny_root: Path, tmp_path: Path
) -> None:
    """submitit's warning before preemption or the time limit (SIGUSR2, ``--signal=USR2@90``)
    stops the job's ranks at a step with ``last.ckpt``; submitit then requeues the job, which
    resumes from that checkpoint into the same run: the result of an uninterrupted job."""
    epochs = 4
    job = [f"trainer.max_epochs={epochs}", "strategy=ddp", "devices=2"]
    args = [*tiny_overrides(tiny_root), *job]
    reference = tmp_path / "reference"
    reference.mkdir()
    unlogged = [*tiny_overrides(tiny_root, logger="none"), *job]
    run_entry("train", *unlogged, "hydra.run.dir=run", cwd=reference)
    command = [sys.executable, "-m", "src.train", "-m", "hydra/launcher=slurm", "accelerator=cpu"]
    sweep = subprocess.Popen(
        [*command, *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    checkpoint = "outputs/train/multiruns/*/0/checkpoints/last.ckpt"
    job = None
    try:
        deadline = time.monotonic() + 180
        while not (found := list(tmp_path.glob(checkpoint))):
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.2)
        folder = found[0].parents[2]
        (job,) = [p.name for p in (folder / ".submitit").iterdir() if p.name.isdigit()]
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        out, err = sweep.communicate(timeout=400)
    finally:
        if job:
            subprocess.run(["scancel", job])
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 0, out[-3000:] + err[-5000:]
    logs = "".join(p.read_text() for p in (folder / ".submitit" / job).glob("*_log.*"))
    assert "Restored all states from the checkpoint" in logs, "resumed, not started over"
    # The ranks stopped at a step with its checkpoint first; then submitit requeued the job
    # (its own handler alone would requeue at once, losing the steps since the last checkpoint),
    # which started again. Not submitit's "Requeued job" line: it is written once `scontrol
    # requeue` returns, and SLURM may end the requeued job's processes before that.
    log = (folder / "0" / "train.log").read_text()
    stopping = log.find("SIGUSR2 received: stopping after the current training step")
    preempted = log.find("this job is preempted")
    started_again = log.find("rank 0/2 (node 0, local 0) fit:", preempted)
    assert -1 < stopping < preempted < started_again, log
    assert_same_metrics(folder / "0", read_metrics(reference / "run"))
    (run,) = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
