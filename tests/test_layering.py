"""The house is built bottom up: refengine's library (GGUF, spec, reference engine) <- solver (the
planner) <- cudarun (the runtime, which also measures the machine into a solver profile). Only the
command line (refengine/commands/, __main__.py) sits on top and reaches down into all three. Any
import that runs back up is found here by walking the sources with `ast`, including imports
inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LINE = (ROOT / "refengine" / "commands", ROOT / "refengine" / "__main__.py")
# package -> the packages above it, which it must never import
ABOVE = {"solver": ("cudarun",), "refengine": ("solver", "cudarun")}


def imported_packages(source: str, package: str) -> set[str]:
    """Top-level package names a module's source imports (a relative import is its own package)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.add(package if node.level else (node.module or "").split(".")[0])
    return out


def upward_imports(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if package == "refengine" and any(path.is_relative_to(c) for c in COMMAND_LINE):
            continue
        found = imported_packages(path.read_text(), package) & set(ABOVE[package])
        bad += [f"{path.relative_to(ROOT)} imports {p}" for p in sorted(found)]
    return bad


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_package_imports_one_above_it(package):
    assert upward_imports(package) == []


def test_the_walk_finds_imports_inside_functions_and_relative_ones():
    source = "import os\ndef f():\n    from cudarun.driver import init\n    import cudarun.bench_gpu\n"
    assert imported_packages(source, "solver") == {"os", "cudarun"}
    assert imported_packages("from .profile import Figure\n", "solver") == {"solver"}
    assert imported_packages("from solver.profile import X\n", "cudarun") == {"solver"}
