"""The project's own code (src/: the entry points and the task a forker edits) uses only what the
library makes public, says so in docs/make-it-yours.md, and stays small, shallow and free of
cycles (the library's own layout: lib/tests/test_layout.py)."""

import ast
from pathlib import Path

import lightning_exact
from lightning_exact.testing.code_shape import (
    import_cycles,
    long_and_deep_functions,
    module_name,
    packed_assignments,
)
from lightning_exact.testing.public_api import private_methods, private_uses

from tests.conftest import PROJECT

LIBRARY = Path(lightning_exact.__file__).resolve().parent
TASK_PACKAGE = PROJECT / "src" / "task"


SOURCES = {module_name(path, PROJECT): path for path in sorted((PROJECT / "src").rglob("*.py"))}


def where(path: Path) -> Path:
    return path.relative_to(PROJECT)


def test_no_module_of_the_project_imports_itself_back() -> None:
    """No import cycle, counting imports inside functions too (a deferred import is still a
    cycle: neither module can be read, tested or replaced without the other)."""
    assert len(SOURCES) >= 8, "the project's modules were found"
    assert not import_cycles(SOURCES)


def test_the_task_uses_only_public_names_of_the_machinery() -> None:
    """What the task imports from the library, the methods it calls on or overrides of the
    machinery's classes: public names only, the ones docs/make-it-yours.md documents. A private
    name would be a door a forker cannot see and an upgrade can move."""
    assert "_resident" in private_methods(), "the machinery's private methods were found"
    assert not private_uses(TASK_PACKAGE, PROJECT)


def test_make_it_yours_documents_every_machinery_name_the_task_uses() -> None:
    """Each name src/task imports from the library, and each TensorDataModule method the
    shipped data modules call or override, is named in docs/make-it-yours.md."""
    page = (PROJECT / "docs" / "make-it-yours.md").read_text()
    imported = {
        alias.name
        for path in TASK_PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_exact")
        for alias in node.names
    }
    contract = {"read", "check", "transform", "read_checked", "load_train", "load_test"}
    contract |= {"world_and_rank", "loader", "eval_loader", "train_dataloader"}
    assert not {name for name in imported | contract if f"`{name}" not in page}


def test_one_assignment_per_line() -> None:
    """``a, b = x, y`` packs two statements into one line to save a line; the code reads better
    one name at a time (unpacking a function's tuple, ``a, b = f()``, is not this)."""
    packed = packed_assignments(SOURCES, where)
    assert not packed, f"split these into one assignment each: {packed}"


def test_functions_are_short_and_shallow() -> None:
    """No function of src/ is over 40 lines (its docstring included) or nests blocks more than 4
    deep: a reader holds one in view. Longer ones split into named steps."""
    long, deep = long_and_deep_functions(SOURCES, where)
    assert not long, f"over 40 lines: {long}"
    assert not deep, f"nested over 4 deep: {deep}"
