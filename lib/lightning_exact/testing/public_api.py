"""Whether a task uses only the library's public names: a private one would be a door a forker
cannot see and an upgrade can move. The library's own tests check its test task with it, the
template's the image task."""

import ast
from pathlib import Path

import lightning_exact

LIBRARY = Path(lightning_exact.__file__).resolve().parent


def private_methods() -> set[str]:
    """Names of the underscore methods (not dunders) of every class of the library."""
    names = set()
    for path in LIBRARY.rglob("*.py"):
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


def private_uses(task_package: Path, project: Path) -> list[str]:
    """What the task in ``task_package`` imports from the library other than the package's own
    public names, and the library's private methods it calls or overrides: each a line naming
    its place relative to ``project``."""
    private = private_methods()
    found = []
    for path in sorted(task_package.rglob("*.py")):
        place = path.relative_to(project)
        for node in ast.walk(ast.parse(path.read_text())):
            found += private_use(node, place, private)
    return found


def private_use(node: ast.AST, place: Path, private: set[str]) -> list[str]:
    """What one node of a task's code uses of the library that is not public."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_exact"):
        found = [f"{place}: imports {a.name}" for a in node.names if a.name[0] == "_"]
        if node.module != "lightning_exact":  # the public API is the package's own names
            found.append(f"{place}:{node.lineno}: imports from {node.module}")
        return found
    if isinstance(node, ast.Attribute) and node.attr in private:
        return [f"{place}:{node.lineno}: uses .{node.attr}"]
    if isinstance(node, ast.FunctionDef) and node.name in private:
        return [f"{place}:{node.lineno}: overrides {node.name}"]
    return []
