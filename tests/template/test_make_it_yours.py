"""The "Make it yours" steps (docs/make-it-yours.md), followed for real: a small RGB image folder
trained with both shipped networks on 2 ranks, evaluated on 3 ranks exactly as on 1, predicted,
with colour figures; then a network added as one module and one config file, and an IDX dataset
added as one DATASETS entry and one config file, each copied from the page's own code blocks
into a copy of the project, trained and evaluated there."""

import csv
import re
import shutil
from pathlib import Path

import pytest
from lightning_exact.testing.records import read_metrics
from PIL import Image

from tests.conftest import HARNESS, PROJECT
from tests.idx_data import make_dataset
from tests.image_data import make_image_folder
from tests.template.test_readme import page_command

run_entry = HARNESS.run_entry

pytestmark = pytest.mark.slow

N_TRAIN, N_TEST, VAL = 20, 7, 20  # per class (5 classes), and the validation samples
TEST_SAMPLES = 5 * N_TEST  # 35: splits unevenly over 2 and 3 ranks


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("my_images"), N_TRAIN, N_TEST)


def tiny(images: Path) -> list[str]:
    return [
        "data=image_folder",
        f"data.root={images}",
        f"data.val_size={VAL}",
        "data.batch_size=20",
        "trainer.max_epochs=2",
        "callbacks.progress_bar=none",
    ]


PAGE = PROJECT / "docs" / "make-it-yours.md"
NETWORK_FILES = {"src/task/nets/mlp.py", "conf/model/mlp.yaml"}
DATASET_FILE = "conf/data/my_mnist.yaml"
LEFT_OUT = {".git", ".venv", "outputs", "data", "mlruns", "mlartifacts", "wheelhouse", "mlflow.db"}


def readme_files() -> dict[str, str]:
    """The code blocks of docs/make-it-yours.md whose first line names their file."""
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return {path: f"# {path}\n{body}" for path, body in blocks}


def readme_entry(path: str, table: str) -> str:
    """The code block of docs/make-it-yours.md that is an entry of ``table`` in ``path``."""
    pattern = rf"```python\n# {re.escape(path)}: an entry of {table}\n(.*?)```"
    (body,) = re.findall(pattern, PAGE.read_text(), re.DOTALL)
    return body


def project_copy(tmp_path: Path) -> Path:
    """The project without its outputs, data, stores and environment, to edit as a forker."""

    def leave_out(folder: str, names: list[str]) -> list[str]:
        at_top = Path(folder) == PROJECT
        return [n for n in names if (at_top and n in LEFT_OUT) or n == "__pycache__"]

    copy = tmp_path / "project"
    shutil.copytree(PROJECT, copy, ignore=leave_out)
    (copy / "conf" / "local" / "default.yaml").unlink(missing_ok=True)  # this machine's
    return copy


def only(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(pattern)
    return path


@pytest.mark.parametrize("net", ["convnet", "resnet"])
def test_rgb_images_with_each_network(net: str, images: Path, tmp_path: Path) -> None:
    run_entry("train", *tiny(images), f"model={net}", "strategy=ddp", "devices=2", cwd=tmp_path)
    run = only(tmp_path / "outputs" / "train" / "runs", "*")
    assert read_metrics(run)["test/samples"] == TEST_SAMPLES
    ckpt = run / "checkpoints" / "last.ckpt"
    evals = {}
    for devices in (1, 3):
        run_entry(
            "eval",
            *tiny(images),
            f"ckpt_path={ckpt}",
            "strategy=ddp",
            f"devices={devices}",
            "logger=none",
            f"hydra.run.dir={tmp_path / f'eval{devices}'}",
            cwd=tmp_path,
        )
        evals[devices] = read_metrics(tmp_path / f"eval{devices}")
    assert evals[3]["test/samples"] == evals[1]["test/samples"] == TEST_SAMPLES
    assert evals[3]["test/acc"] == evals[1]["test/acc"]
    assert evals[3]["test/loss"] == pytest.approx(evals[1]["test/loss"], abs=1e-6)
    if net != "convnet":
        return  # what follows does not depend on the network: once is enough
    # The checkpoint alone says what the data is and where it was.
    only_ckpt = tmp_path / "eval-ckpt-only"
    run_entry(
        "eval", f"ckpt_path={ckpt}", "logger=none", f"hydra.run.dir={only_ckpt}", cwd=tmp_path
    )
    assert read_metrics(only_ckpt) == evals[1]
    other = run_entry(
        "eval",
        f"ckpt_path={ckpt}",
        "data=image_folder",
        "data.image_size=[24,40]",
        cwd=tmp_path,
        check=False,
    )
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "last.ckpt was trained with data.image_size=[32, 32] (here [24, 40])" in other.stderr
    run_entry("predict", *tiny(images), f"ckpt_path={ckpt}", cwd=tmp_path)
    with only(tmp_path / "outputs" / "predict" / "runs", "*/predictions_test.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [int(row["index"]) for row in rows] == list(range(TEST_SAMPLES))
    for figure in ("confusion_matrix_test.png", "misclassified_test.png"):
        assert Image.open(run / "figures" / figure).size[0] > 500  # colour: task/test_reporting


def test_a_new_network_is_one_module_and_one_config(images: Path, tmp_path: Path) -> None:
    copy = project_copy(tmp_path)
    files = readme_files()
    assert set(files) == {*NETWORK_FILES, DATASET_FILE}, files
    for path in NETWORK_FILES:
        (copy / path).write_text(files[path])
    env = {"PYTHONPATH": str(copy)}
    run_entry(
        "train",
        *tiny(images),
        "model=mlp",
        "model.net.hidden=32",
        "logger=none",
        "strategy=ddp",
        "devices=2",
        cwd=copy,
        env=env,
    )
    run = only(copy / "outputs" / "train" / "runs", "*")
    metrics = read_metrics(run)
    run_entry(
        "eval",
        *tiny(images),
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'eval'}",
        cwd=copy,
        env=env,
    )
    assert read_metrics(tmp_path / "eval")["test/samples"] == metrics["test/samples"]
    proc = run_entry(
        "train", *tiny(images), "model=mlp", "+model.net.depth=3", cwd=copy, env=env, check=False
    )
    assert proc.returncode == 1
    assert "model.net.depth is not a setting of model.net (MLP); valid keys: model.net.hidden" in (
        " ".join(proc.stderr.split())
    )


def test_another_idx_dataset_is_one_entry_and_one_config(tmp_path: Path) -> None:
    """Step 3's IDX dataset: the page's DATASETS entry and conf/data file, and its command, in a
    copy of the project; trained, then evaluated from the checkpoint alone."""
    copy = project_copy(tmp_path)
    mnist = copy / "src" / "task" / "data" / "mnist.py"
    table = "DATASETS: dict[str, DatasetSpec] = {\n"
    assert table in mnist.read_text()
    mnist.write_text(
        mnist.read_text().replace(table, table + readme_entry("src/task/data/mnist.py", "DATASETS"))
    )
    (copy / DATASET_FILE).write_text(readme_files()[DATASET_FILE])
    root = tmp_path / "datasets"
    make_dataset(root, folder="MyMNIST", n_train=120, n_test=31, seed=3, learnable=True)
    command = page_command("test_another_idx_dataset_is_one_entry_and_one_config")
    assert command[:3] == ["python", "-m", "src.train"] and "data=my_mnist" in command, command
    as_typed = [f"data.root={root}" if t.startswith("data.root=") else t for t in command[3:]]
    tiny = ["data.val_size=20", "data.batch_size=20", "trainer.max_epochs=1", "logger=none"]
    env = {"PYTHONPATH": str(copy)}
    run_dir = tmp_path / "run"
    run_entry(
        "train",
        *as_typed,
        *tiny,
        "callbacks.progress_bar=none",
        f"hydra.run.dir={run_dir}",
        cwd=copy,
        env=env,
    )
    assert read_metrics(run_dir)["test/samples"] == 31
    run_entry(
        "eval",
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'eval'}",
        cwd=copy,
        env=env,
    )
    assert read_metrics(tmp_path / "eval")["test/acc"] == read_metrics(run_dir)["test/acc"]
