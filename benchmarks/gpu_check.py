"""Everything that needs a GPU, in one command for the first GPU lent:
``python -m benchmarks.gpu_check`` (``make gpu-check``), about 10 minutes on one GPU.

It runs, and prints as one table:

* every test that runs only where a GPU is (CPU machines skip them): the hot path's sync-debug
  test (the template's per-step code under ``torch.cuda.set_sync_debug_mode("error")``), the
  global-batch layers on the GPU (torch's SyncBatchNorm function; 2 gloo ranks share one GPU),
  in float64 against the CPU's BatchNorm on the whole batch, one GPU training the CPU's float64
  weights of the library's test task (``trainer.precision=64-true``), two GPUs training the
  weights of one (where 2 are visible), ``trainer=gpu`` and more GPUs than there are (the
  library's tests, run in lib/);
* the GPU rows of ``python -m benchmarks.run``, once each: 8 (resident data, bf16, compile; the
  time to 90 % Fashion-MNIST test accuracy where ``$TEMPLATE_DATA_DIR`` holds it), 11 (DDP
  against FSDP) and 12 (exact against per-rank training), on generated data.

It exits 1 if a test failed. Without a GPU it says so in one line and exits 0.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "lib/"  # the library's tests: run from lib/, on its own test task
GPU_TESTS = {
    "sync-debug: the template's step code never syncs the GPU": [
        "lib/tests/test_hot_path.py::test_the_templates_step_code_never_syncs_the_gpu"
    ],
    "exact: global-batch layers on CPU and GPU, 2 GPUs train 1 GPU's weights": [
        "lib/tests/test_exact.py::test_batchnorm_on_two_ranks_equals_one_batchnorm_on_the_whole_batch",
        "lib/tests/test_exact.py::test_dropout_masks_sliced_by_rank_are_the_whole_batchs",
        "lib/tests/test_exact.py::test_two_gpus_train_the_weights_of_one_gpu",
    ],
    "float64: SyncBatchNorm's kernels and 1 GPU's MLP equal the CPU's to 1e-12 / 1e-8": [
        "lib/tests/test_exact.py::test_in_float64_batchnorm_on_two_ranks_equals_the_cpus_on_the_whole_batch",
        "lib/tests/test_exact.py::test_one_gpu_in_float64_trains_the_weights_of_the_cpu",
    ],
    "trainer=gpu builds; more GPUs than there are is refused": [
        "lib/tests/test_config.py::test_group_option_composes_and_builds[train-trainer=gpu]",
        "lib/tests/test_config.py::test_group_option_composes_and_builds[eval-trainer=gpu]",
        "lib/tests/test_config.py::test_group_option_composes_and_builds[predict-trainer=gpu]",
        "lib/tests/test_bad_input.py::test_more_gpus_than_the_machine_has",
    ],
}
BENCHMARK_STEPS = 100  # steady-state steps of rows 8 (the full benchmark takes 150)


def run_tests(arguments: list[str]) -> tuple[str, float]:
    """pytest's summary line for ``arguments`` (slow tests included) and its seconds; the
    library's tests (``lib/...``) run in lib/, as its suite does."""
    start = time.monotonic()
    library = all(argument.startswith(LIBRARY) for argument in arguments)
    if library:
        arguments = [argument.removeprefix(LIBRARY) for argument in arguments]
    command = [sys.executable, "-m", "pytest", *arguments, "-q", "-p", "no:cacheprovider"]
    cwd = ROOT / LIBRARY if library else ROOT
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else proc.stderr[-200:]
    if proc.returncode not in (0, 5):  # 5: nothing collected
        print(proc.stdout[-5000:], proc.stderr[-3000:], sep="\n")
    return summary, time.monotonic() - start


def benchmark_rows(workdir: Path) -> dict[str, dict]:
    """Rows 8, 11 and 12 of ``python -m benchmarks.run``, once each (they measure the shipped
    image task: a project that replaced it, and its benchmark, runs the GPU tests alone)."""
    try:
        from benchmarks import exact, sharding
        from benchmarks.run import SHARED_DATA, accelerated_rows, has_real
        from src.task.data.mnist import MNISTDataModule
    except ModuleNotFoundError as missing:
        return {"benchmark rows 8, 11, 12": {"skipped": f"no image task's benchmark ({missing})"}}
    batch = 128
    real = has_real("FashionMNIST")
    data, overrides = benchmark_data(MNISTDataModule, workdir / "data", batch)
    rows = accelerated_rows(
        data.train_set, batch, BENCHMARK_STEPS, 1, overrides, workdir, real, tiny=False
    )
    if not real:
        rows["8. time to 90% Fashion-MNIST test accuracy"] = {
            "skipped": f"needs Fashion-MNIST in $TEMPLATE_DATA_DIR ({SHARED_DATA})"
        }
    return rows | sharding.measure(workdir, False, 1) | exact.measure(workdir, False, 1)


def benchmark_data(
    datamodule: type, root: Path, batch: int, steps: int = BENCHMARK_STEPS
) -> tuple[Any, list[str]]:
    """Generated MNIST-shaped data for ``steps`` steps of ``batch``, set up for fitting, and the
    overrides that train on it (a CPU test builds it: the rows themselves need a GPU)."""
    from tests.idx_data import make_dataset

    make_dataset(root, n_train=batch * (steps + 10) + 100, n_test=300)
    data = datamodule(name="mnist", root=str(root), download=False, batch_size=batch, val_size=100)
    data.setup("fit")
    return data, ["data=mnist", f"data.root={root}", "data.val_size=100"]


def main() -> None:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to run")
        return
    table = Table("check or figure", "result", "seconds", title="GPU check")
    failed = False
    for name, arguments in GPU_TESTS.items():
        summary, seconds = run_tests(arguments)
        failed |= "failed" in summary or "error" in summary
        table.add_row(name, summary, f"{seconds:.0f}")
        print(f"{name}: {summary} ({seconds:.0f} s)", flush=True)  # kept if a later row fails
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        rows = benchmark_rows(Path(workdir))
    for name, row in rows.items():
        figure = (
            row.get("skipped") or f"{row['median']:,.4g} ({row['min']:,.4g} - {row['max']:,.4g})"
        )
        table.add_row(name, figure, "")
    table.add_row("benchmark rows 8, 11, 12", "", f"{time.monotonic() - start:.0f}")
    console = Console(width=160)
    console.print(table)
    console.print(
        f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, "
        f"torch {torch.__version__}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
