"""The shape of the package: no import cycle between modules (every import that runs counts, inside functions too), no
two folders that import each other (every import counts, type-only ones included: docs/architecture.md's layers),
and no module too long to read in one sitting. `graphlib` finds the cycle; reading imports from the AST, not by
importing, sees them all."""

from __future__ import annotations

import ast
import graphlib
import re
import shutil
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


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
NAME_COLUMN = slice(19, 58)  # the diagram's column of folder and module names (the leaves' lines: all of it)


def diagram_layers(text: str) -> list[tuple[set[str], set[tuple[str, str]]]]:
    """docs/architecture.md's diagram, top line first: each line's nodes (test_house's `folder` names) and the
    imports its arrows allow within the line (`a -> b`); the leaves' lines are one layer, whose nodes import each
    other freely."""
    block = text.split("```\n", 2)[1]
    layers, leaves = [], None
    for line in block.splitlines():
        if line.lstrip().startswith("─"):
            continue
        if line[: NAME_COLUMN.start].strip() == "leaves":
            leaves = set()
            layers.append((leaves, set()))
        names = line[NAME_COLUMN.start :] if leaves is not None else line[NAME_COLUMN]
        words = re.sub(r"\([^)]*\)", "", names).split()
        nodes = [_node(word) for word in words if word != "->"]
        arrows = {(_node(a), _node(b)) for a, arrow, b in zip(words, words[1:], words[2:]) if arrow == "->"}
        if leaves is not None:
            leaves |= set(nodes)
            layers[-1] = (leaves, {(a, b) for a in leaves for b in leaves})
        elif nodes:
            layers.append((set(nodes), arrows))
    return layers


def _node(word: str) -> str:
    """A diagram name as a `folder` node: `cli/` -> pipeline.cli, `targets/onnxruntime/` -> pipeline.targets.
    onnxruntime, `targets/__init__` -> pipeline.targets, `build` -> pipeline.build."""
    return "pipeline." + word.removesuffix("/").removesuffix("/__init__").replace("/", ".")


def layer_violations(package: Path, layers) -> list[str]:
    """Each import from a node to one on its own or a higher line of the diagram (not allowed by an arrow), and
    each node the diagram leaves out."""
    modules = module_names(package)
    level = {node: index for index, (nodes, _) in enumerate(layers) for node in nodes}
    allowed = {pair for _, arrows in layers for pair in arrows}
    problems = set()
    for name, path in modules.items():
        if name == package.name:  # the package's own __init__: its version string
            continue
        source = _placed(folder(name, modules), level)
        if source is None:
            problems.add(f"{folder(name, modules)} is on no line of the diagram")
            continue
        for target, line in import_statements(name, path, modules):
            destination = _placed(folder(target, modules), level)
            if destination in (None, source) or destination.startswith(f"{source}."):
                continue
            if level[destination] <= level[source] and (source, destination) not in allowed:
                problems.add(f"{name}:{line} imports {target}, on a line not below {source}'s")
    return sorted(problems)


def _placed(node: str, level: dict[str, int]) -> str | None:
    """The diagram's name for a folder node: itself, or the nearest folder above it that the diagram names
    (targets/onnxruntime/runtime/ is drawn with targets/onnxruntime/)."""
    while node and node not in level:
        node = node.rpartition(".")[0]
    return node or None


def test_every_import_goes_down_the_layers_architecture_md_draws():
    layers = diagram_layers(ARCHITECTURE.read_text())
    assert {"pipeline.config", "pipeline.errors", "pipeline.cli"} <= {n for nodes, _ in layers for n in nodes}
    assert layer_violations(PACKAGE, layers) == []


def test_config_imports_only_the_leaves():
    """The config model is the one source of truth every layer reads: it reads none of them back."""
    layers = diagram_layers(ARCHITECTURE.read_text())
    leaves, config = layers[-1][0], "pipeline.config"
    assert config in layers[-2][0]
    modules = module_names(PACKAGE)
    reached = {
        _placed(folder(target, modules), {n: 0 for n in leaves | {config}}) or folder(target, modules)
        for name, path in modules.items()
        if folder(name, modules) == config
        for target, _ in import_statements(name, path, modules)
    }
    assert reached - {config} <= leaves, sorted(reached - {config} - leaves)


def test_an_import_up_the_layers_is_found(tmp_path):
    package = tmp_path / "pipeline"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    config = package / "config" / "schema.py"
    config.write_text(config.read_text() + "\n\ndef late():\n    from pipeline import quality  # noqa\n")
    layers = diagram_layers(ARCHITECTURE.read_text())
    assert any("pipeline.config.schema" in p and "pipeline.quality" in p for p in layer_violations(package, layers))
