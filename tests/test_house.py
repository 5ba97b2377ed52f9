"""The shape of the package: no import cycles (every import counts, inside functions too) and no module too long to
read in one sitting. `graphlib` finds the cycle; reading imports from the AST, not by importing, sees them all."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
MAX_LINES = 600


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of `package` (a package's name stands for its `__init__.py`)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (read by type checkers, never executed)."""
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in block.body
        for node in ast.walk(statement)
    }


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that importing (or running any function of) module `name` imports, with the packages
    above each: importing a.b.c runs a/__init__.py and a/b/__init__.py first."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    found = set()
    for target in targets:
        parts = target.split(".")
        found |= {".".join(parts[:depth]) for depth in range(1, len(parts) + 1)} & modules.keys()
    return found - {name}


def import_cycle(package: Path) -> list[str] | None:
    """One import cycle of the package's modules (first module repeated at the end), or None."""
    modules = module_names(package)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    # A package's __init__ runs before its modules; an edge from a package to its parent is no cycle of ours.
    graph = {name: {dep for dep in deps if not name.startswith(f"{dep}.")} for name, deps in graph.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as cycle:
        return list(reversed(cycle.args[1]))
    return None


def test_the_pipeline_package_has_no_import_cycle():
    cycle = import_cycle(PACKAGE)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("where", ["module level", "inside a function"])
def test_a_planted_cycle_is_found(tmp_path, where):
    package = tmp_path / "planted"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "base.py").write_text("from planted.sub.leaf import helper\n")
    body = "import planted.base\n" if where == "module level" else "def helper():\n    from planted import base\n"
    (package / "sub" / "leaf.py").write_text(body)
    (package / "clean.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import planted.base\n")
    assert set(import_cycle(package)) == {"planted.base", "planted.sub.leaf"}


def test_type_checking_imports_and_parent_packages_are_no_cycle(tmp_path):
    package = tmp_path / "clean"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from clean import b\n")
    (package / "b.py").write_text("from clean import a\n")
    assert import_cycle(package) is None


def test_no_module_is_over_600_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
