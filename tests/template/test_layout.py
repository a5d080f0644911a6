"""The project's own code (src/: the entry points and the task a forker edits) uses only what the
library makes public, says so in docs/make-it-yours.md, and stays small, shallow and free of
cycles (the library's own layout: lib/tests/test_layout.py)."""

import ast
from pathlib import Path

import lightning_exact
from lightning_exact.testing.public_api import private_methods, private_uses

from tests.conftest import PROJECT

LIBRARY = Path(lightning_exact.__file__).resolve().parent
TASK_PACKAGE = PROJECT / "src" / "task"


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


SOURCES = {module_name(path, PROJECT): path for path in sorted((PROJECT / "src").rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it: ``from src.task import nets`` counts as
    ``src.task.nets`` (a submodule), not as the package ``src.task``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & SOURCES.keys()
            names |= submodules or {node.module}
    return names


def test_no_module_of_the_project_imports_itself_back() -> None:
    """No import cycle, counting imports inside functions too (a deferred import is still a
    cycle: neither module can be read, tested or replaced without the other)."""
    imports = {name: imported_modules(path) & SOURCES.keys() for name, path in SOURCES.items()}

    def cycle(path: list[str]) -> list[str]:
        for module in sorted(imports[path[-1]]):
            if module == path[0]:
                return [*path, module]
            if module not in path and (found := cycle([*path, module])):
                return found
        return []

    assert len(SOURCES) >= 8, "the project's modules were found"
    assert not [found for name in SOURCES if (found := cycle([name]))]


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
    packed = [
        f"{path.relative_to(PROJECT)}:{node.lineno}"
        for path in SOURCES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Tuple)
        and isinstance(node.value, ast.Tuple)
    ]
    assert not packed, f"split these into one assignment each: {packed}"


def test_functions_are_short_and_shallow() -> None:
    """No function of src/ is over 40 lines (its docstring included) or nests blocks more than 4
    deep: a reader holds one in view. Longer ones split into named steps."""
    blocks = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.Match)

    def depth(node: ast.AST) -> int:
        inner = [depth(child) for child in ast.iter_child_nodes(node)]
        return max(inner, default=0) + isinstance(node, blocks)

    long, deep = [], []
    for path in SOURCES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                place = f"{path.relative_to(PROJECT)}:{node.lineno} {node.name}"
                if node.end_lineno - node.lineno + 1 > 40:
                    long.append(place)
                if max(depth(statement) for statement in node.body) > 4:
                    deep.append(place)
    assert not long, f"over 40 lines: {long}"
    assert not deep, f"nested over 4 deep: {deep}"
