"""The packages' import direction is one-way, and no package reaches into another's private modules.

    peft -> ops -> layers -> adapters -> engine -> parallel -> frontend -> serve

A module may import its own package and those before it, never one after it (function-level imports included: an
import inside a function is still an upward dependency). ``lorakit/__init__.py`` and ``__main__.py`` sit above all.
A private module (``_name.py``) is imported only from inside its own package. No modules import one another in a
circle at module level (``if TYPE_CHECKING:`` imports included): a circle works only by the order of first import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorakit

ORDER = ["peft", "ops", "layers", "adapters", "engine", "parallel", "frontend", "serve"]
# The one upward edge, at run time only: ``Engine(factory, tensor_parallel_size=N)`` starts its workers through
# parallel's executor (which drives engine's runner on every rank), imported inside the function that needs it so
# that one command serves a sharded model. Nothing else may be added here without a reason as good.
ALLOWED = {("engine/build.py", "lorakit.parallel.executor")}
SRC = Path(lorakit.__file__).parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every lorakit import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "lorakit" or name.startswith("lorakit.")]


def _base(node: ast.ImportFrom, path: Path) -> str:
    """The module a ``from ... import`` names, a relative one resolved against ``path``'s package."""
    base = node.module or ""
    if node.level:
        package = ("lorakit", *path.relative_to(SRC).parent.parts)
        parts = package[: len(package) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return base


def _loaded_on_import(path: Path, modules: set[str]) -> set[str]:
    """The lorakit modules (of ``modules``) that importing ``path`` runs first: its imports outside function bodies
    (class bodies and ``if`` / ``try`` blocks, ``if TYPE_CHECKING:`` too, run on import). ``from p import m`` of a
    submodule m needs m, not p's ``__init__`` (it may still be running); of any other name, ``p/__init__.py``."""
    found = set()
    stack = list(ast.parse(path.read_text(), str(path)).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path)
            names = {f"{base}.{a.name}" for a in node.names}
            found |= names if names <= modules else names & modules | {base}
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return found & modules


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(("lorakit", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def _modules() -> list[tuple[Path, str | None]]:
    return [(path, _package(".".join(("lorakit", *path.relative_to(SRC).parts)))) for path in sorted(SRC.rglob("*.py"))]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> the nodes it points at)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_source_file_sits_in_a_layer():
    loose = [str(p.relative_to(SRC)) for p, package in _modules() if package is None
             and p.relative_to(SRC).as_posix() not in ("__init__.py", "__main__.py", "_help.py")]  # the command and its saved help
    assert not loose, f"modules outside the layered packages {ORDER}: {loose}"


def test_no_module_imports_a_later_layer():
    upward = []
    for path, package in _modules():
        if package is None:
            continue
        for line, name in _imports(path):
            target = _package(name)
            allowed = any(name == m or name.startswith(m + ".") for f, m in ALLOWED if f == str(path.relative_to(SRC)))
            if target is not None and ORDER.index(target) > ORDER.index(package) and not allowed:
                upward.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not upward, "imports against the layers' order " + " -> ".join(ORDER) + ":\n" + "\n".join(upward)


def test_no_module_imports_another_packages_private_module():
    reached = []
    for path, package in _modules():
        for line, name in _imports(path):
            parts = name.split(".")
            private = next((i for i, part in enumerate(parts) if part.startswith("_") and part != "__init__"), None)
            if private is not None and private >= 2 and parts[1] != package:
                reached.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not reached, "private modules used from outside their package:\n" + "\n".join(reached)


def test_the_checks_see_imports(tmp_path):
    """The walker finds function-level and relative imports (a check that saw none would always pass)."""
    sample = SRC / "frontend" / "core.py"
    names = {name for _, name in _imports(sample)}
    assert "lorakit.engine.loop.EngineLoop" in names and "lorakit.frontend.wire" in names


def test_no_import_circle():
    """No module imports, at module level, a module that imports it back, directly or around a circle."""
    paths = {_module_name(path): path for path, _ in _modules()}
    graph = {name: _loaded_on_import(path, paths.keys() - {name}) for name, path in paths.items()}
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, "modules that import one another in a circle:\n" + "\n".join(map(" <-> ".join, circles))


def test_the_circle_check_sees_circles():
    """The checks find a circle, and module-level imports under ``if TYPE_CHECKING:`` (a check that saw none would
    always pass)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(map(sorted, _strongly_connected(graph))) == [["a", "b", "c"], ["d"]]
    modules = {_module_name(path) for path, _ in _modules()}
    assert "lorakit.engine" in _loaded_on_import(SRC / "__init__.py", modules)  # under TYPE_CHECKING
    assert "lorakit.serve.adapters" in _loaded_on_import(SRC / "serve" / "app.py", modules)
    assert "lorakit.serve" not in _loaded_on_import(SRC / "serve" / "app.py", modules)  # submodules only
