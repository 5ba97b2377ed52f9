"""Reading upstream source files for the tabulators (maintainer tools, not run by the pipeline).

`Upstream.read(repo, path, commit)` gives a file at a commit: from a local directory of sources
(<dir>/<owner>/<name>/<commit>/<path>), else downloaded once from raw.githubusercontent.com into that directory.
`cite` is how every table names a source: repository, path, commit, and whether that commit is the release's own
(`pinned`). `stored_releases` stores a block several releases share once (see pipeline/upstream/__init__.py).

`complete_statements` returns the top-level statements that are whole in a text that may be a slice of a file,
each with its line number in that text, so the tabulators can use `ast` on it.
"""

from __future__ import annotations

import ast
import json
import re
import urllib.request
from pathlib import Path

import jsonpatch

REPO = "NVIDIA/TensorRT-LLM"
RAW = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
DEFAULT_SOURCES = Path.home() / ".cache" / "trtllm-pipeline" / "upstream-sources"


class UnrecognizedSource(ValueError):
    """The upstream code no longer has the shape a tabulator interprets: read it and update the tool."""


def dotted_name(node: ast.expr) -> str | None:
    """`a.b.c` for a name or attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class SourceMissing(Exception):
    """An upstream file the tabulator needs is neither in the sources directory nor downloadable."""


def cite(repo: str, path: str, commit: str | None, pinned: bool = True) -> dict:
    """A table's record of one source file. `pinned` is False where the release's own commit was not readable and
    `commit` is the one read instead (None: a stored copy whose commit is not known, so the fact is unreproducible
    until re-read at the release's commit)."""
    if commit is not None and not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"{repo}:{path}: {commit!r} is not a 40-hex commit")
    return {"repo": repo, "path": path, "commit": commit, "pinned": pinned and commit is not None}


class Upstream:
    """Upstream files at commits, read from `directory` or downloaded into it."""

    def __init__(self, directory: Path = DEFAULT_SOURCES, download: bool = True):
        self.directory, self.download = directory, download

    def read(self, repo: str, path: str, commit: str | None) -> str:
        if commit is None:
            raise SourceMissing(f"{repo}:{path}: no commit is known for the copy these facts were read from")
        local = self.directory / repo / commit / path
        if not local.is_file():
            url = RAW.format(repo=repo, commit=commit, path=path)
            if not self.download:
                raise SourceMissing(f"{local} is missing (download it from {url})")
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    text = response.read().decode()
            except OSError as error:
                raise SourceMissing(f"{url}: {error}; put the file at {local}") from error
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
        return local.read_text()


def stored_releases(releases: dict[str, dict]) -> dict[str, dict]:
    """Releases as a table stores them: each one `same_as` an earlier identical release, or `based_on` the release
    before it plus a JSON Patch when that is smaller, else whole. Applying the patch gives the block back exactly,
    key order included (consumers iterate tensors and fields in table order)."""
    stored: dict[str, dict] = {}
    names = list(releases)
    for index, release in enumerate(names):
        block = releases[release]
        same = next((earlier for earlier in names[:index] if json.dumps(releases[earlier]) == json.dumps(block)), None)
        if same is not None:
            stored[release] = {"same_as": same}
            continue
        if index:
            base = names[index - 1]
            patch = ordered_patch(releases[base], block)
            assert json.dumps(jsonpatch.apply_patch(releases[base], patch)) == json.dumps(block), release
            if len(json.dumps(patch)) < 0.8 * len(json.dumps(block)):
                stored[release] = {"based_on": base, "patch": patch}
                continue
        stored[release] = block
    return stored


def ordered_patch(base, target, path: str = "") -> list[dict]:
    """JSON Patch operations turning `base` into `target`, key order included. jsonpatch's own diff adds a new key at
    the end of its object; here each key from the first one out of place on is moved to the end in `target`'s order
    (two moves through a spare key: a move onto itself changes nothing). Written by hand because no diff library
    promises key order."""
    if json.dumps(base) == json.dumps(target):
        return []
    if isinstance(base, dict) and isinstance(target, dict):
        operations = [{"op": "remove", "path": f"{path}/{_pointer(key)}"} for key in base if key not in target]
        for key in (key for key in target if key in base):
            operations += ordered_patch(base[key], target[key], f"{path}/{_pointer(key)}")
        operations += [
            {"op": "add", "path": f"{path}/{_pointer(key)}", "value": target[key]} for key in target if key not in base
        ]
        order = [key for key in base if key in target] + [key for key in target if key not in base]
        first = next((i for i, (now, wanted) in enumerate(zip(order, target)) if now != wanted), len(order))
        for key in list(target)[first:]:
            here, spare = f"{path}/{_pointer(key)}", f"{path}/{SPARE_KEY}"
            operations += [{"op": "move", "from": here, "path": spare}, {"op": "move", "from": spare, "path": here}]
        return operations
    if isinstance(base, list) and isinstance(target, list) and len(base) == len(target):
        return [op for i, (old, new) in enumerate(zip(base, target)) for op in ordered_patch(old, new, f"{path}/{i}")]
    return [{"op": "replace", "path": path, "value": target}]


SPARE_KEY = "_moving_"


def _pointer(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


_NOT_A_START = re.compile(r"[\s#)\]}]|(else|elif|except|finally)\b")
_CLASS = re.compile(r"class (\w+)\b")
CUT_CLASS = "<class whose header precedes the slice>"


def complete_statements(source: str, cut_start: bool = False, cut_end: bool = False) -> list[ast.stmt]:
    """Top-level statements of `source` that are whole, with their line numbers in `source`.

    `source` may be a slice of a file: `cut_start` / `cut_end` say that the file goes on before / after it.
    A statement that the slice cuts is left out, even when what remains happens to parse (a cut line such as
    `logger.se` is a valid expression): the first one if it starts on the first line, the last one if it runs
    to the last line. Of a class that the end of the slice cuts, the members that end before the cut are kept."""
    lines = source.splitlines(keepends=True)
    try:
        statements = ast.parse(source).body
    except SyntaxError:
        statements = _blocks(lines, 0, salvage_classes=True)
    last_line = max((i + 1 for i, line in enumerate(lines) if line.strip()), default=0)

    def reaches_end(node: ast.AST) -> bool:
        return (node.end_lineno or node.lineno) >= last_line

    if cut_start and statements and statements[0].lineno == 1:
        statements = statements[1:]
    if cut_start and lines and lines[0][:1] == " ":  # the slice starts inside a class: keep its whole members
        stop = next((i for i, line in enumerate(lines) if line.strip() and not _NOT_A_START.match(line)), len(lines))
        members = [m for m in _blocks(lines[:stop], 4) if m.lineno > 1]
        if members:
            cls = ast.ClassDef(name=CUT_CLASS, bases=[], keywords=[], body=members, decorator_list=[], type_params=[])
            cls.lineno, cls.col_offset, cls.end_lineno = 1, 0, stop
            statements.insert(0, cls)
    if cut_end and statements and reaches_end(statements[-1]):
        last = statements.pop()
        if isinstance(last, ast.ClassDef):
            last.body = [member for member in last.body if not reaches_end(member)]
            if last.body:
                statements.append(last)
    return statements


def _blocks(lines: list[str], indent: int, salvage_classes: bool = False) -> list[ast.stmt]:
    """Statements at `indent` that parse on their own, found greedily (the shortest run of lines from one
    statement start to another that parses); line numbers are those of `lines`."""
    margin = " " * indent

    def starts(line: str) -> bool:
        return line.startswith(margin) and bool(line.strip()) and not _NOT_A_START.match(line[indent:])

    def text(first: int, last: int) -> str:
        return "".join(line[indent:] if line.startswith(margin) else line.lstrip(" ") for line in lines[first:last])

    bounds = [i for i, line in enumerate(lines) if starts(line)] + [len(lines)]
    statements, position = [], 0
    for k, start in enumerate(bounds[:-1]):
        if start < position:
            continue
        for end in [bounds[-1], *bounds[k + 1 : -1]]:
            try:
                tree = ast.parse(text(start, end))
            except SyntaxError:
                continue
            for node in tree.body:
                ast.increment_lineno(node, start)
            statements += tree.body
            position = end
            break
        else:
            header = _CLASS.match(lines[start][indent:]) if salvage_classes else None
            if header:  # a class cut by the end of the text: keep its whole members
                stop = next((b for b in bounds[k + 1 :] if b > start), len(lines))
                members = _blocks(lines[start + 1 : stop], indent + 4)
                for node in members:
                    ast.increment_lineno(node, start + 1)
                if members:
                    cls = ast.ClassDef(
                        name=header.group(1), bases=[], keywords=[], body=members, decorator_list=[], type_params=[]
                    )
                    cls.lineno, cls.col_offset, cls.end_lineno = start + 1, indent, stop
                    statements.append(cls)
                position = stop
    return statements


def find_def(statements: list[ast.stmt], name: str) -> ast.FunctionDef | ast.ClassDef | None:
    return next(
        (s for s in statements if isinstance(s, (ast.FunctionDef, ast.ClassDef)) and s.name == name),
        None,
    )


def module_literals(statements: list[ast.stmt]) -> dict[str, object]:
    """Module-level `NAME = <literal>` assignments."""
    values = {}
    for s in statements:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            try:
                values[s.targets[0].id] = ast.literal_eval(s.value)
            except ValueError:
                pass
    return values


def value(node: ast.expr | None):
    """A literal as itself, anything else as {"expr": source text}."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"expr": ast.unparse(node)}
