"""The shape checks a reader relies on, for any set of modules: no import cycle, one assignment
per line, short and shallow functions. The library's tests run them on the library and its test
project, the template's on the project's ``src/``."""

import ast
from collections.abc import Callable, Mapping
from pathlib import Path

Sources = Mapping[str, Path]  # a module's dotted name -> its file


def module_name(path: Path, root: Path) -> str:
    """``root/src/task/__init__.py`` -> ``src.task``."""
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: Path, sources: Sources) -> set[str]:
    """Every module ``path`` imports, anywhere in it: ``from src.task import nets`` counts as
    ``src.task.nets`` (a submodule of ``sources``), not as the package ``src.task``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & sources.keys()
            names |= submodules or {node.module}
    return names


def import_cycles(sources: Sources) -> list[list[str]]:
    """Each module's import cycle through ``sources`` (imports inside functions count: a
    deferred import is still a cycle), as the modules along it."""
    imports = {
        name: imported_modules(path, sources) & sources.keys() for name, path in sources.items()
    }

    def cycle(path: list[str]) -> list[str]:
        for module in sorted(imports[path[-1]]):
            if module == path[0]:
                return [*path, module]
            if module not in path and (found := cycle([*path, module])):
                return found
        return []

    return [found for name in sources if (found := cycle([name]))]


def packed_assignments(sources: Sources, where: Callable[[Path], Path]) -> list[str]:
    """``a, b = x, y``: the places (``where(path):line``) that pack two assignments into one."""
    return [
        f"{where(path)}:{node.lineno}"
        for path in sources.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Tuple)
        and isinstance(node.value, ast.Tuple)
    ]


def long_and_deep_functions(
    sources: Sources, where: Callable[[Path], Path], lines: int = 40, depth: int = 4
) -> tuple[list[str], list[str]]:
    """The functions over ``lines`` lines (docstring included), and those nesting blocks more
    than ``depth`` deep, each as ``where(path):line name``."""
    blocks = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.Match)

    def nesting(node: ast.AST) -> int:
        inner = [nesting(child) for child in ast.iter_child_nodes(node)]
        return max(inner, default=0) + isinstance(node, blocks)

    long: list[str] = []
    deep: list[str] = []
    for path in sources.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                place = f"{where(path)}:{node.lineno} {node.name}"
                if node.end_lineno - node.lineno + 1 > lines:
                    long.append(place)
                if max(nesting(statement) for statement in node.body) > depth:
                    deep.append(place)
    return long, deep
