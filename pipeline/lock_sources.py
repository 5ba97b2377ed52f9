"""The source files a stage executes or copies, so the build lock sees every line of code that shapes an output.

Roots are a stage's module, its target's modules and the files it copies into its output; from each
Python root every `pipeline` module it imports (at module level or inside a function) is followed, and
every table it loads from its own location (`Path(__file__).parent / "x.json"`, `.with_name("x.json")`),
so a module and the tables it executes are hashed together.
`pipeline.stages` is hashed but not followed: it imports every stage. The target registry and trtllm's backend
registry load their adapters by entry point, so following imports never reaches another target; a stage executes
only its own target, which it names as a root (`Target.sources`). A target's adapter is a facade: every stage
calls it, but each of its methods imports what it runs inside itself, so it is followed through its module-level
imports only (`facades`), and each stage names the modules its own methods run (tests/test_lock_per_target.py
checks that those cover every import in the methods the stage module calls, and in those deploy asks through
`host_memory` and `validation`).
Written by hand: import-graph tools (modulefinder, pydeps) execute or over-approximate; this reads the AST.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable
from importlib.util import find_spec
from pathlib import Path

PACKAGE = "pipeline"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
REGISTRIES = frozenset({"pipeline.stages"})
UPSTREAM_TABLES = Path(__file__).resolve().parent / "upstream"
UPSTREAM_READERS = frozenset({"facts", "release_facts", "releases"})


@functools.cache
def module_file(name: str) -> Path | None:
    """The source file of a `pipeline` module (None for names that are not modules)."""
    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).resolve() if spec and spec.origin and spec.origin.endswith(".py") else None


def imported_modules(path: Path, module_level: bool = False) -> set[str]:
    """`pipeline` modules a Python file imports anywhere in its body but under `if TYPE_CHECKING:`, which never runs
    (`module_level`: outside any function too)."""
    tree = ast.parse(path.read_text(), str(path))
    return modules_imported_by(_executed(tree, functions=not module_level))


def modules_imported_by(nodes: Iterable[ast.AST]) -> set[str]:
    """`pipeline` modules the import statements among `nodes` import."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {
                name
                for alias in node.names
                if alias.name.split(".")[0] == PACKAGE
                for name in _with_parents(alias.name)
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == PACKAGE
        ):
            found |= _with_parents(node.module)
            # `from pipeline.targets import trtllm` imports the module pipeline.targets.trtllm.adapter
            found |= {
                f"{node.module}.{alias.name}" for alias in node.names if module_file(f"{node.module}.{alias.name}")
            }
    return found


def _with_parents(module: str) -> set[str]:
    """A module and the packages above it, whose `__init__` an import of it runs first."""
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def _executed(node: ast.AST, functions: bool = True):
    """The nodes under `node` that can run: none in the body of `if TYPE_CHECKING:` (type-only imports; its `else`
    runs), and, without `functions`, none in a function's or lambda's body (what importing the module runs)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for statement in child.orelse:
                yield from _executed(statement, functions)
        elif functions or not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _executed(child, functions)


def loaded_tables(path: Path) -> set[Path]:
    """The existing `.json` files a Python file names relative to itself (`Path(__file__)...`) or reads from
    pipeline.upstream by name (`facts("llm_args")`, `release_facts("llm_args", ...)`, `releases(...)`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if upstream := _upstream_table(node):
            found.add(upstream)
            continue
        if not isinstance(node, ast.BinOp | ast.Call) or not ast.unparse(node).startswith("Path(__file__)"):
            continue
        try:
            value = eval(
                compile(ast.Expression(node), str(path), "eval"),
                {"Path": Path, "__file__": str(path), "__builtins__": {}},
            )
        except Exception:  # an expression using other names: not a fixed table
            continue
        if isinstance(value, Path) and value.suffix == ".json" and value.is_file():
            found.add(value.resolve())
    return found


def _upstream_table(node: ast.AST) -> Path | None:
    """pipeline/upstream/<name>.json when `node` is a call of one of its readers with a literal name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    reader = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    table = UPSTREAM_TABLES / f"{node.args[0].value}.json"
    return table.resolve() if reader in UPSTREAM_READERS and table.is_file() else None


def source_files(roots: tuple[str | Path, ...], facades: frozenset[str] = frozenset()) -> list[Path]:
    """Every file reached from `roots` (dotted module names or file paths), sorted; a module named in `facades` is
    followed through its module-level imports only."""
    seen: set[Path] = set()
    pending = [(module_file(root) if isinstance(root, str) else Path(root).resolve(), str(root)) for root in roots]
    while pending:
        path, name = pending.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        if path.suffix != ".py" or name in REGISTRIES:
            continue
        for module in imported_modules(path, module_level=name in facades):
            pending.append((module_file(module), module))
        pending += [(table, str(table)) for table in loaded_tables(path)]
    return sorted(seen)


def source_hashes(roots: tuple[str | Path, ...], facades: frozenset[str] = frozenset()) -> dict[str, str]:
    """{path relative to the project: sha256 prefix} for every source file reached from `roots`."""
    hashes = {}
    for path in source_files(roots, facades):
        key = str(path.relative_to(PACKAGE_ROOT)) if path.is_relative_to(PACKAGE_ROOT) else str(path)
        hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return hashes
