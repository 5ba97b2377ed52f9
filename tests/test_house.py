"""The shape of the package: no import cycle between modules (every import that runs counts, inside functions too), no
two folders that import each other (every import counts, type-only ones included: docs/architecture.md's layers),
and no module too long to read in one sitting. `graphlib` finds the cycle; reading imports from the AST, not by
importing, sees them all."""

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


def import_statements(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(the most specific module of the package it names, line) for every import in module `name`, those under
    `TYPE_CHECKING` and inside functions included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            specific = next(
                (".".join(parts[:d]) for d in range(len(parts), 0, -1) if ".".join(parts[:d]) in modules), None
            )
            if specific:
                found.append((specific, node.lineno))
    return found


def folder(name: str, modules: dict[str, Path]) -> str:
    """The node a module belongs to: its folder (a subpackage, at any depth, is a folder of its own; a package's
    `__init__` is the folder), or itself for a module at the package's root."""
    if modules[name].name == "__init__.py" or name.count(".") == 1:
        return name
    return name.rpartition(".")[0]


def folder_cycle(package: Path) -> list[str] | None:
    """One cycle of folders importing each other, each step with an import that makes it, or None."""
    modules = module_names(package)
    edges: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        for target, line in import_statements(name, path, modules):
            source, destination = folder(name, modules), folder(target, modules)
            if source != destination:
                edges.setdefault(source, {}).setdefault(destination, f"{name}:{line} imports {target}")
    try:
        graphlib.TopologicalSorter({node: set(out) for node, out in edges.items()}).prepare()
    except graphlib.CycleError as cycle:
        nodes = list(reversed(cycle.args[1]))
        return [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(nodes, nodes[1:])]
    return None


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


def test_no_two_folders_import_each_other():
    cycle = folder_cycle(PACKAGE)
    assert cycle is None, "folders importing each other (docs/architecture.md says which may import which):\n" + (
        "\n".join(cycle or [])
    )


def test_only_the_commands_import_a_target_package():
    """The shared layers reach a target through the registry (`pipeline.targets`), never by importing its package:
    that keeps each stage's lock to its own target's code and lets another package add a target."""
    modules = module_names(PACKAGE)
    commands = ("pipeline.cli", "pipeline.bench")
    found = []
    for name, path in modules.items():
        for target, line in import_statements(name, path, modules):
            package = ".".join(target.split(".")[:3])
            if package.startswith("pipeline.targets.") and not name.startswith((package, *commands)):
                found.append(f"{name}:{line} imports {target}")
    assert not found, "import a target's package only through pipeline.targets' registry:\n" + "\n".join(found)


@pytest.mark.parametrize("where", ["module level", "inside a function", "under TYPE_CHECKING"])
def test_a_planted_back_edge_between_folders_is_found(tmp_path, where):
    package = tmp_path / "layered"
    for sub in ("low", "high"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "high" / "user.py").write_text("from layered.low.base import helper\n")
    back = {
        "module level": "import layered.high.user\n",
        "inside a function": "def helper():\n    from layered.high import user\n",
        "under TYPE_CHECKING": "import typing\nif typing.TYPE_CHECKING:\n    from layered.high.user import X\n",
    }[where]
    (package / "low" / "base.py").write_text(back)
    cycle = folder_cycle(package)
    assert cycle and {step.split(" ")[0] for step in cycle} == {"layered.low", "layered.high"}, cycle
    (package / "low" / "base.py").write_text("def helper():\n    pass\n")
    assert folder_cycle(package) is None


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
