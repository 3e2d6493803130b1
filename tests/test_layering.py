"""The packages' import direction is one-way, and no package reaches into another's private modules.

    ops -> layers -> adapters -> engine -> parallel -> frontend -> serve

A module may import its own package and those before it, never one after it (function-level imports included: an
import inside a function is still an upward dependency). ``lorakit/__init__.py`` and ``__main__.py`` sit above all.
A private module (``_name.py``) is imported only from inside its own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorakit

ORDER = ["ops", "layers", "adapters", "engine", "parallel", "frontend", "serve"]
# The one upward edge, at run time only: ``Engine(factory, tensor_parallel_size=N)`` starts its workers through
# parallel's executor (which drives engine's runner on every rank), imported inside the function that needs it so
# that one command serves a sharded model. Nothing else may be added here without a reason as good.
ALLOWED = {("engine/build.py", "lorakit.parallel.executor")}
SRC = Path(lorakit.__file__).parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every lorakit import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("lorakit", *path.relative_to(SRC).parent.parts))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "lorakit" or name.startswith("lorakit.")]


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def _modules() -> list[tuple[Path, str | None]]:
    return [(path, _package(".".join(("lorakit", *path.relative_to(SRC).parts)))) for path in sorted(SRC.rglob("*.py"))]


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
