"""Reading upstream source files that were fetched in part (maintainer tools, not run by the pipeline).

The search index hands out files in 16,000-character pages, so a cached version of an upstream file may be
a prefix, a middle slice or an excerpt. `complete_statements` returns the top-level statements that are
whole in such a text, each with its line number in that text, so the tabulators can use `ast` on them.

Cache layout (outside any repository): <cache>/<commit or index-id-N>/<path>[@<offset>], described by
<cache>/READS-trtllm-i11.json (repository, path, commit or index id, character ranges read).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = "NVIDIA/TensorRT-LLM"
READS = "READS-trtllm-i11.json"
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


def cached_versions(cache: Path, path: str) -> list[dict]:
    """Every cached slice of `path`: {version, offset, text, cut_start, cut_end}, in a stable order."""
    reads = json.loads((cache / READS).read_text())["reads"]
    found = []
    for file in sorted(cache.glob(f"*/{path}*")):
        suffix = file.name[len(Path(path).name) :]
        if suffix and not suffix.startswith("@"):
            continue
        version, offset, text = file.relative_to(cache).parts[0], int(suffix[1:]) if suffix else 0, file.read_text()
        total = source_record(cache, version, path, reads)["total_chars"]
        found.append(
            {
                "version": version,
                "offset": offset,
                "text": text,
                "cut_start": offset > 0,
                "cut_end": offset + len(text) < total,
            }
        )
    return found


def source_record(cache: Path, version: str, path: str, reads: list | None = None) -> dict:
    """{repo, path, commit, index_id, ranges} of a cached version, from the cache's READS file."""
    reads = reads if reads is not None else json.loads((cache / READS).read_text())["reads"]
    commit = None if version.startswith("index-id-") else version
    index_id = version.removeprefix("index-id-") if commit is None else None
    for read in reads:
        if read["path"].split(" ")[0] == path and (read["commit"] == commit if commit else read["id"] == index_id):
            record = {
                "repo": REPO,
                "path": path,
                "commit": commit,
                "index_id": read["id"],
                "ranges": read["ranges"],
                "total_chars": read["total_chars"],
            }
            if " " in read["path"]:  # an excerpt whose path the index did not name: inferred from its content
                record["path_inferred"] = True
            return record
    raise KeyError(f"{version}/{path} is not described in {cache / READS}")
