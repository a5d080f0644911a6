"""The template adds no host sync to a training step (see issue #17), and no collective but
those that make it exact at any world size (issue #56).

Lightning's DDP loop itself calls one collective per step (its SIGTERM broadcast at each step's
start); the gradient all-reduce runs in DDP's C++ reducer and is not counted. Under
``strategy.exact`` (the default) each BatchNorm layer adds two: its forward gathers every rank's
batch statistics (an all-gather) and its backward sends their gradients back (a reduce-scatter): 2
per step for the test task's one BatchNorm (its MLP's), 3 in all. ``strategy.exact=false`` adds
none. Dropout adds none: each rank draws the global batch's mask itself. The training points'
syncs, once per ``trainer.log_every_n_steps`` window
(``lib/lightning_exact/training/train_points.py``) fall past these epochs' steps. Anything else
the template adds is a regression: on a GPU a step of this network takes about a millisecond."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import PROJECT, TESTS, run_entry, tiny_overrides

INSTRUMENT = TESTS / "count_collectives"
STRICT = TESTS / "sync_debug" / "train_strict.py"
LIGHTNING_PER_STEP = 1  # lightning 2.6: _TrainingEpochLoop._broadcast_sigterm_tensor
AGREEMENT = 2  # a stop check: Lightning's reduce_boolean_decision (all_reduce, barrier)
BATCH_NORMS = 1  # the test task's MLP's
PER_BATCH_NORM = 2  # the forward's all-gather of the statistics, the backward's reduce-scatter


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False])
def test_training_steps_call_only_lightnings_own_collectives_and_exact_batchnorms(
    exact: bool, tiny_root: Path, tmp_path: Path
):
    every = 5
    per_step = LIGHTNING_PER_STEP + (BATCH_NORMS * PER_BATCH_NORM if exact else 0)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INSTRUMENT), str(PROJECT)]),
        "COUNT_COLLECTIVES": str(tmp_path),
    }
    run_entry(
        "train",
        *tiny_overrides(tiny_root),
        "strategy=ddp",
        "accelerator=cpu",  # 2 gloo ranks, also on a machine with one GPU
        "devices=2",
        "data.batch_size=16",
        "trainer.max_epochs=3",  # 16 steps an epoch: 45 followed by a step of the same epoch
        f"callbacks.stop_check_every_n_steps={every}",
        f"strategy.exact={exact}",
        "hydra.run.dir=run",
        cwd=tmp_path,
        env=env,
    )
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Steps followed by another step of the same epoch: no epoch end in between.
        steady = [
            (batch, count)
            for (epoch, batch, count), (next_epoch, next_batch, _) in zip(
                steps, steps[1:], strict=False
            )
            if (next_epoch, next_batch) == (epoch, batch + 1)
        ]
        assert len(steady) >= 30, steps
        plain = {count for batch, count in steady if (batch + 1) % every}
        checks = {count for batch, count in steady if (batch + 1) % every == 0}
        assert plain == {per_step}, f"rank {rank}: {steps}"
        assert checks == {per_step + AGREEMENT}, f"rank {rank}: {steps}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_templates_step_code_never_syncs_the_gpu(tiny_root: Path, tmp_path: Path):
    """Steady-state steps of src.train with its per-step code (the model's training_step, the
    template callbacks' batch hooks) under ``set_sync_debug_mode("error")``."""
    args = [*tiny_overrides(tiny_root, logger="none"), "accelerator=gpu", "devices=1"]
    proc = subprocess.run(
        [sys.executable, str(STRICT), *args, "trainer.max_epochs=2", "hydra.run.dir=run"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    count = int(re.search(r"steps checked: (\d+)", proc.stdout).group(1))
    assert count >= 20, proc.stdout[-3000:]


def test_the_gpu_check_runs_on_cpu_machines_too():
    """The GPU test above is skipped wherever CI runs, so its script is checked here: it imports,
    finds the machinery's per-step callbacks, and calls an entry point that exists."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_strict", STRICT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    names = {callback.__name__ for callback in script.template_callbacks()}
    assert {"SeedEachBatch", "StopOnSignal", "SystemMetrics", "MidEpochState"} <= names
    assert callable(script.entry.main) and callable(script.stories.train)
