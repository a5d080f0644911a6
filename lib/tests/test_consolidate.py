"""``python -m src.consolidate``: one file from a sharded folder, refusals in one line."""

from pathlib import Path

import pytest
import torch
from lightning_exact.checkpoints.consolidate import main

from tests.test_sharded import trained_pair, write_sharded


def test_a_folder_becomes_one_file_beside_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    net, optimizer = trained_pair()
    write_sharded(tmp_path / "last.ckpt", net, optimizer)
    assert main([str(tmp_path / "last.ckpt")]) == 0
    target = tmp_path / "last.consolidated.ckpt"
    assert capsys.readouterr().out.startswith(f"wrote {target}: eval, predict, weights_from=")
    assert torch.load(target, weights_only=True)["state_dict"].keys() == net.state_dict().keys()
    assert main([str(tmp_path / "last.ckpt")]) == 1  # never over a file already there
    assert capsys.readouterr().err == (
        f"Error: {target} exists; remove it or choose another with --output FILE\n"
    )


@pytest.mark.parametrize("what", ["file", "folder", "missing"])
def test_what_is_not_a_sharded_folder_is_refused_in_one_line(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "x.ckpt"
    if what == "file":
        torch.save({"state_dict": {}}, path)
    elif what == "folder":
        path.mkdir()
    assert main([str(path)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    expected = {
        "file": "is one file already",
        "folder": "is not a sharded checkpoint folder",
        "missing": ": no such folder",
    }[what]
    assert error.startswith(f"Error: {path}{'' if what == 'missing' else ' '}{expected}"), error
    assert sorted(tmp_path.iterdir()) == ([path] if what != "missing" else [])
