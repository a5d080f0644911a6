"""The library (lib/lightning_exact/) never imports a project (its src/: the task a forker edits,
the entry points): datasets, networks and the LightningModule reach it as config or arguments.
Its modules, and the test project's, stay small, shallow and free of cycles."""

import ast
import re
from importlib import metadata
from pathlib import Path

import lightning_exact
from lightning_exact.testing.code_shape import (
    import_cycles,
    imported_modules,
    long_and_deep_functions,
    module_name,
    packed_assignments,
)
from lightning_exact.testing.public_api import private_methods, private_uses

from tests.conftest import PROJECT

MACHINERY = Path(lightning_exact.__file__).resolve().parent


def where(path: Path) -> Path:
    """A source's path as a reader finds it: in the library or in the test project."""
    return path.relative_to(MACHINERY.parent if path.is_relative_to(MACHINERY) else PROJECT)


# The library's modules and the test project's (src.task and the entry points)
SOURCES = {
    **{module_name(path, MACHINERY.parent): path for path in sorted(MACHINERY.rglob("*.py"))},
    **{module_name(path, PROJECT): path for path in sorted((PROJECT / "src").rglob("*.py"))},
}


def test_machinery_imports_nothing_of_a_project() -> None:
    offenders = {
        str(where(path)): sorted(
            m for m in imported_modules(path, SOURCES) if m.split(".")[0] == "src"
        )
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


# Names of the image task the library still reads for one release, deprecated, in one module:
# predict's ``images=`` (now ``inputs=``), dropped in 2.0.
DEPRECATED = {"images": ("lightning_exact/job/stories.py", "2.0")}


def deprecated(word: str, path: Path) -> bool:
    """Whether ``word`` names only a deprecated name, in the module that still reads it, and
    that name's last release has not come (then the check below sees it again)."""
    names = {match.lower() for match in TASK_WORDS.findall(word.replace("_", " "))}
    version = tuple(int(part) for part in metadata.version("lightning-exact").split(".")[:2])
    return all(
        name in DEPRECATED
        and str(where(path)) == DEPRECATED[name][0]
        and version < tuple(int(part) for part in DEPRECATED[name][1].split("."))
        for name in names
    )


# Names of a library's API the machinery stands in for, by module: the outbox queues what a task
# logs with MLflow's client (``log_image(run_id, image, ...)``, a figure's ``write_image``).
LIBRARY_NAMES = {"outbox.py": {"log_image", "image", "write_image"}}


def test_the_machinery_knows_nothing_of_image_classification() -> None:
    """What an image, a class or an accuracy is comes through the task contract (TASK): a
    regression or segmentation task is a new src/task/, not a machinery edit: no identifier or
    string of the machinery names them (but a library's API it stands in for, and a deprecated
    name until its last release)."""
    found = {
        str(where(path)): sorted(
            w
            for w in code_words(path) - LIBRARY_NAMES.get(path.name, set())
            if TASK_WORDS.search(w.replace("_", " ")) and not deprecated(w, path)
        )
        for path in sorted(MACHINERY.rglob("*.py"))
    }
    assert not {name: words for name, words in found.items() if words}


def test_no_module_of_the_project_imports_itself_back() -> None:
    """No import cycle, counting imports inside functions too (a deferred import is still a
    cycle: neither module can be read, tested or replaced without the other)."""
    assert not import_cycles(SOURCES)


TASK_PACKAGE = PROJECT / "src" / "task"


def test_the_task_uses_only_public_names_of_the_machinery() -> None:
    """What a task (the test project's; the image task's: tests/template/test_layout.py) imports
    from lib/lightning_exact/, the methods it calls on or overrides of the machinery's classes:
    public names only. A private name would be a door a forker cannot see and an upgrade can
    move."""
    assert "_resident" in private_methods(), "the machinery's private methods were found"
    assert not private_uses(TASK_PACKAGE, PROJECT)


def test_one_assignment_per_line() -> None:
    """``a, b = x, y`` packs two statements into one line to save a line; the code reads better
    one name at a time (unpacking a function's tuple, ``a, b = f()``, is not this)."""
    packed = packed_assignments(SOURCES, where)
    assert not packed, f"split these into one assignment each: {packed}"


def machinery_names(path: Path) -> tuple[set[str], set[str]]:
    """The machinery's names an entry point uses and the modules they come from:
    ``from lightning_exact.job.jobs import TrainingJob`` is one name of
    ``lightning_exact.job.jobs``, ``from lightning_exact.job import entry`` then ``entry.main`` one
    name of ``lightning_exact.job.entry``."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    modules: set[str] = set()
    imported_modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_exact"):
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
        assert "lightning_exact.job.entry" in modules, "the count sees the entry points' imports"
        assert len(names) <= 12, f"src/{entry_point}.py uses {sorted(names)}"
        assert len(modules) <= 5, f"src/{entry_point}.py imports {sorted(modules)}"


def test_functions_are_short_and_shallow() -> None:
    """No function of the library or the test project is over 40 lines (its docstring included)
    or nests blocks more than 4 deep: a reader holds one in view. Longer ones split into named
    steps."""
    long, deep = long_and_deep_functions(SOURCES, where)
    assert not long, f"over 40 lines: {long}"
    assert not deep, f"nested over 4 deep: {deep}"
