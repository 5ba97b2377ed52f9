"""Loading a YAML build config: the limits on what is parsed, `section.key=value` overrides, and errors collected in
two passes -- every field error first, then (if the fields parse) every cross-field rule -- each naming the YAML
file, the line, the field and the fix.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.cross_field import cross_field_problems
from pipeline.config.schema import BuildConfig
from pipeline.errors import ConfigError, shown
from pipeline.models import path_problem

# A build config is a few KB (the shipped ones are under 4 KB); a larger file is a mistake or an attack, and parsing
# megabytes of YAML takes minutes.
MAX_CONFIG_BYTES = 256 * 1024
# Nodes that aliases may add to a document: `&a [*b, *b, ...]` nested nine deep is 2.4 KB of text and 387 million
# nodes, which every check and error message would walk.
MAX_ALIAS_NODES = 10_000
# libyaml's parser (when PyYAML has it) is 4x faster and refuses nesting beyond 1000 levels instead of recursing.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _alias_problem(root: yaml.Node) -> str | None:
    """Why the document's aliases expand it too far (past MAX_ALIAS_NODES, or without end: an alias inside its own
    anchor), None when they do not. Counted on the composed nodes, where an alias is its anchor's node once more."""
    sizes: dict[int, int] = {}  # nodes under each node, aliases expanded
    stack, open_ = [(root, False)], set()
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
        elif id(node) in open_:
            return "an alias refers to a node that contains it, so the document never ends; write the value out"
        elif id(node) not in sizes:
            open_.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _children(node)]
    added = sizes[id(root)] - len(sizes)
    if added <= MAX_ALIAS_NODES:
        return None
    return (
        f"its aliases expand {len(sizes):,} YAML nodes to {sizes[id(root)]:,}; at most {MAX_ALIAS_NODES:,} may come "
        "from aliases: write the values out"
    )


def _parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The document and its composed nodes (None for an empty one).

    Raises:
        yaml.YAMLError: not one YAML document.
        ValueError: its aliases expand it too far, or it nests deeper than Python recurses.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        problem = _alias_problem(node)
        if problem:
            raise ValueError(problem)
        return loader.construct_document(node), node
    except RecursionError:
        raise ValueError("it nests deeper than it can be read; flatten it") from None
    finally:
        loader.dispose()


def _line_index(root: yaml.Node | None) -> dict[tuple, int]:
    """Map each YAML key path (list items by index) to its 1-based line, so errors can point into the file."""
    lines: dict[tuple, int] = {}
    stack = [(root, ())] if root is not None else []
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            items = [(str(key.value), key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            items = [(str(index), item, item) for index, item in enumerate(node.value)]
        else:
            continue
        for name, at, value in items:
            lines[path + (name,)] = at.start_mark.line + 1
            stack.append((value, path + (name,)))
    return lines


def _model_for(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of `loc`."""
    model: type[BaseModel] = BuildConfig
    for key in loc[:-1]:
        field = model.model_fields.get(key)
        if field is None:
            return None
        annotation = field.annotation
        candidates = [
            a
            for a in getattr(annotation, "__args__", (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not candidates:
            return None
        model = candidates[0]
    return model


class _Locator:
    def __init__(self, path: Path, lines: dict[tuple, int], overridden: set[tuple] = frozenset()):
        self.path, self.lines, self.overridden = path, lines, overridden

    def where(self, loc: tuple, given: bool) -> str:
        """The file and line of `loc`, else of the nearest section above it that the file sets. `given`: the value
        is the file's (a field error), even where the index has no line for it (a mapping key, a union member)."""
        if loc and tuple(loc) not in self.lines and any(key[: len(loc)] == tuple(loc) for key in self.overridden):
            return f"{self.path} (overridden on the command line)"  # a section only the command line's keys set
        for depth in range(len(loc), 0, -1):
            if tuple(loc[:depth]) in self.overridden:
                return f"{self.path} (overridden on the command line)"
            line = self.lines.get(tuple(loc[:depth]))
            if line is not None:
                suffix = "" if depth == len(loc) or given else " (default, not set in file)"
                return f"{self.path}:{line}{suffix}"
        return f"{self.path}" if given else f"{self.path} (default, not set in file)"

    def problem(self, loc: tuple, message: str, given: bool = False) -> str:
        return f"{self.where(loc, given)}: {'.'.join(map(str, loc))}: {message}"


def _describe_field_error(err: dict) -> str:
    loc = tuple(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        owner = _model_for(loc)
        known = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return f"unknown key {shown(loc[-1])} -- {hint}"
    if err["type"] == "literal_error":
        return f"{err['msg'].replace('Input should be', 'must be')}, got {shown(err['input'])}"
    if err["type"] == "value_error":  # our validators' messages name the value and the fix already
        return str(err["ctx"]["error"])
    return f"{err['msg']} (got {shown(err.get('input'))})"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Merge `section.key=value` overrides (values parsed as YAML) over the loaded mapping.

    Raises:
        ConfigError: naming every override that is not key=value, not valid YAML, or not under a section.
    """
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override '{item}' is not key=value, e.g. build.max_batch_size=16")
            continue
        try:
            value = _parse_yaml(raw)[0]
        except yaml.YAMLError as exc:
            problems.append(
                f"override '{item}': the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                "write it as in the config file, e.g. build.max_batch_size=16 or quantization.exclude_modules=[lm_head]"
            )
            continue
        except ValueError as exc:
            problems.append(f"override '{key}': {exc}")
            continue
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override '{item}': '{part}' is not a section")
                break
        else:
            node[leaf] = value
    if problems:
        raise ConfigError("command line", problems)
    return data


def read_config(
    path: str | Path, overrides: list[str] | None = None, rules: Callable[[BuildConfig], list] | None = None
) -> BuildConfig:
    """Parse and validate a YAML build config: its schema, the config's own rules, then `rules` (what a layer above
    the config checks, e.g. its target's: `pipeline.validation.load_config`), each problem placed in the file.

    Raises:
        ConfigError: listing every problem, each with file, line, field and fix.
    """
    path = Path(path)
    problem = path_problem(path, "regular file")
    if problem:
        raise ConfigError(path, [f"cannot read config: {problem}"])
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            path, [f"is {size:,} bytes; a build config is at most {MAX_CONFIG_BYTES:,} (the shipped ones are a few KB)"]
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(path, [f"cannot read config: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    try:
        data, root = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"not valid YAML: {exc}"]) from None
    except ValueError as exc:
        raise ConfigError(path, [f"refused: {exc}"]) from None
    data = data if data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError(path, ["top level must be a mapping of sections (model, target, quantization, ...)"])
    data = apply_overrides(data, overrides or [])
    overridden = {tuple(item.partition("=")[0].split(".")) for item in overrides or []}
    locator = _Locator(path, _line_index(root), overridden)
    problems, bad_locs = [], set()
    for _ in range(3):  # drop invalid fields and retry, so cross-field rules still report on the rest
        try:
            config = BuildConfig.model_validate(data)
            break
        except ValidationError as exc:
            data, earlier = copy.deepcopy(data), set(bad_locs)
            for e in exc.errors():
                loc = tuple(map(str, e["loc"]))
                if not _under(loc, earlier):  # else the retry's view of a value dropped before: reported already
                    problems.append(locator.problem(loc, _describe_field_error(e), given=True))
                bad_locs.add(loc)
                _drop(data, loc, missing=e["type"] == "missing")
    else:
        raise ConfigError(path, problems)
    config._base_dir, config._source, config._overrides = path.resolve().parent, path, tuple(overrides or ())
    for loc, message in cross_field_problems(config) + (rules(config) if rules else []):
        if not _under(loc, bad_locs):
            problems.append(locator.problem(loc, message))
    if problems:
        raise ConfigError(path, problems)
    return config


def _under(loc: tuple, locs: set[tuple]) -> bool:
    """Whether `loc` is one of `locs` or lies below one."""
    return any(loc[:depth] in locs for depth in range(1, len(loc) + 1))


def _drop(data: dict, loc: tuple, missing: bool) -> None:
    """Remove the value at `loc` from `data`, so that the retry uses its default: the whole list when `loc` points
    into one, and for a `missing` required key the section lacking it."""
    parent, node = None, data
    for depth, key in enumerate(loc):
        if not isinstance(node, dict) or key not in node:
            if missing and parent is not None:
                del parent[loc[depth - 1]]
            return
        if depth == len(loc) - 1 or not isinstance(node[key], dict):
            del node[key]
            return
        parent, node = node, node[key]
