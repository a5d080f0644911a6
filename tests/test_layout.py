"""The template's machinery (src/template/) never imports what a forker edits (src/task/):
datasets, networks and the LightningModule reach it as config or arguments."""

import ast
from pathlib import Path

from tests.conftest import PROJECT

MACHINERY = PROJECT / "src" / "template"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_machinery_imports_nothing_of_the_task_package() -> None:
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith("src.task"))
        for path in sorted(MACHINERY.glob("*.py"))
    }
    assert not {name: mods for name, mods in offenders.items() if mods}
    assert len(offenders) >= 8, "the machinery modules were found"
