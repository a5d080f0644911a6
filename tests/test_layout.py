"""The template's machinery (src/template/) never imports what a forker edits (src/task/):
datasets, networks and the LightningModule reach it as config or arguments."""

import ast
import re
from pathlib import Path

from tests.conftest import PROJECT

MACHINERY = PROJECT / "src" / "template"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PROJECT).with_suffix("").parts).removesuffix(".__init__")


SOURCES = {module_name(path): path for path in sorted((PROJECT / "src").rglob("*.py"))}


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


def test_machinery_imports_nothing_of_the_task_package() -> None:
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith("src.task"))
        for path in sorted(MACHINERY.rglob("*.py"))
    }
    assert not {name: mods for name, mods in offenders.items() if mods}
    assert len(offenders) >= 8, "the machinery modules were found"


# Words of image classification, as whole words (``a_b`` counts as two): "accelerator" is fine.
TASK_WORDS = re.compile(
    r"(?<![a-z])(images?|labels?|pixels?|acc|accuracy|mnist|convnet|logits?|classes|classifiers?)"
    r"(?![a-z])",
    re.IGNORECASE,
)


def code_words(path: Path) -> set[str]:
    """Identifiers, attribute names and string constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words |= set() if id(node) in docstrings else {node.value}
    return words


def test_the_machinery_knows_nothing_of_image_classification() -> None:
    """What an image, a class or an accuracy is comes through the task contract (TASK): a
    regression or segmentation task is a new src/task/, not a machinery edit: no identifier or
    string of the machinery names them."""
    found = {
        path.name: sorted(w for w in code_words(path) if TASK_WORDS.search(w.replace("_", " ")))
        for path in sorted(MACHINERY.rglob("*.py"))
    }
    assert not {name: words for name, words in found.items() if words}


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

    assert not [found for name in SOURCES if (found := cycle([name]))]


TASK_PACKAGE = PROJECT / "src" / "task"


def machinery_private_methods() -> set[str]:
    """Names of the underscore methods (not dunders) of every machinery class."""
    names = set()
    for path in MACHINERY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and item.name.startswith("_")
                    and not item.name.endswith("__")
                }
    return names


def test_the_task_uses_only_public_names_of_the_machinery() -> None:
    """What a task imports from src/template, the methods it calls on or overrides of the
    machinery's classes: public names only, the ones docs/make-it-yours.md documents. A private
    name would be a door a forker cannot see and an upgrade can move."""
    private = machinery_private_methods()
    assert "_resident" in private, "the machinery's private methods were found"
    found = []
    for path in sorted(TASK_PACKAGE.rglob("*.py")):
        where = path.relative_to(PROJECT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("src.template"):
                found += [f"{where}: imports {a.name}" for a in node.names if a.name[0] == "_"]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{where}:{node.lineno}: uses .{node.attr}")
            elif isinstance(node, ast.FunctionDef) and node.name in private:
                found.append(f"{where}:{node.lineno}: overrides {node.name}")
    assert not found


def test_make_it_yours_documents_every_machinery_name_the_task_uses() -> None:
    """Each name src/task imports from src/template, and each TensorDataModule method the
    shipped data modules call or override, is named in docs/make-it-yours.md."""
    page = (PROJECT / "docs" / "make-it-yours.md").read_text()
    imported = {
        alias.name
        for path in TASK_PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("src.template")
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


def machinery_names(path: Path) -> tuple[set[str], set[str]]:
    """The machinery's names an entry point uses and the modules they come from:
    ``from src.template.job import TrainingJob`` is one name of ``src.template.job``,
    ``from src.template import entry`` then ``entry.main`` one name of ``src.template.entry``."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    modules: set[str] = set()
    imported_modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("src.template"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in SOURCES:  # a module: its attributes count
                    imported_modules.add(alias.name)
                    modules.add(f"{node.module}.{alias.name}")
                else:
                    names.add(alias.name)
                    modules.add(node.module)
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(value, ast.Name) and value.id in imported_modules:
            names.add(f"{value.id}.{node.attr}")
    return names, modules


def test_entry_points_speak_to_a_few_lifecycle_objects() -> None:
    """train, eval and predict each use at most 12 of the machinery's names from at most 5 of its
    modules: a reader follows a job through a few objects (TrainingJob, CheckpointJob,
    TrackedRun), not through a dozen modules."""
    for entry_point in ("train", "eval", "predict"):
        names, modules = machinery_names(PROJECT / "src" / f"{entry_point}.py")
        assert "src.template.entry" in modules, "the count sees the entry points' imports"
        assert len(names) <= 12, f"src/{entry_point}.py uses {sorted(names)}"
        assert len(modules) <= 5, f"src/{entry_point}.py imports {sorted(modules)}"


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
                where = f"{path.relative_to(PROJECT)}:{node.lineno} {node.name}"
                if node.end_lineno - node.lineno + 1 > 40:
                    long.append(where)
                if max(depth(statement) for statement in node.body) > 4:
                    deep.append(where)
    assert not long, f"over 40 lines: {long}"
    assert not deep, f"nested over 4 deep: {deep}"
