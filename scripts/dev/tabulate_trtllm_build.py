"""Tabulate the flags `trtllm-build` accepts, from TensorRT-LLM's own source, as JSON facts.

Maintainer tool, not run by the pipeline. It reads, with `ast`, every cached version of
`tensorrt_llm/commands/build.py` (`parse_arguments`: each `add_argument` with its type, choices, default,
action) and of `tensorrt_llm/plugin/plugin.py` (the `PluginConfig` fields that `add_plugin_argument`, called
from `parse_arguments`, turns into flags: dtype plugins get the plugin's dtype options with None spelled
"disable", bool features get enable/disable, others their annotated type). `--kv_cache_type` is typed by
the C++ enum `KVCacheType`; its accepted spellings come from the bindings' `.value(...)` names (build.py
looks a name up as `KVCacheType[value.upper()]`) or from `KVCacheTypeFromString` (upper-cases, then compares
literals), read from excerpts of the C++ headers/bindings (no `ast` for C++; the two patterns are matched).
Writes pipeline/targets/trtllm_build_flags.json. Usage:
    python scripts/dev/tabulate_trtllm_build.py /work/upstream-cache/NVIDIA+TensorRT-LLM \
        pipeline/targets/trtllm_build_flags.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from upstream_source import cached_versions, complete_statements, find_def, module_literals, source_record, value

BUILD = "tensorrt_llm/commands/build.py"
PLUGIN = "tensorrt_llm/plugin/plugin.py"
ENUM_SOURCES = (
    "cpp/tensorrt_llm/pybind/bindings.cpp",
    "cpp/tensorrt_llm/nanobind/bindings.cpp",
    "cpp/include/tensorrt_llm/runtime/modelConfig.h",
)


class UnrecognizedSource(ValueError):
    """The upstream code no longer has the shape this tabulator interprets: read it and update the tool."""


# ---------------------------------------------------------------- build.py


def build_arguments(source: str, cut_start: bool = False, cut_end: bool = False) -> dict:
    """{"flags": {option: spec}, "adds_plugin_arguments": bool, "enum_lookup": ...} of parse_arguments()."""
    statements = complete_statements(source, cut_start, cut_end)
    function = find_def(statements, "parse_arguments")
    if function is None:
        raise UnrecognizedSource("no complete parse_arguments() in this build.py text")
    flags, adds_plugins = {}, False
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "add_plugin_argument":
            adds_plugins = True
        if not (isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        options = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        keywords = {k.arg: k.value for k in node.keywords}
        spec = {
            "type": ast.unparse(keywords["type"]) if "type" in keywords else None,
            "choices": value(keywords.get("choices")),
            "default": value(keywords.get("default")),
            "action": value(keywords.get("action")),
            "line": node.lineno,
        }
        for extra in ("dest", "nargs"):
            if extra in keywords:
                spec[extra] = value(keywords[extra])
        for i, option in enumerate(options):
            flags[option] = spec | ({"alias_of": options[0]} if i else {})
    return {"flags": flags, "adds_plugin_arguments": adds_plugins, "enum_lookup": enum_lookup(statements)}


def enum_lookup(statements: list[ast.stmt]) -> str | None:
    """How build.py's enum_type() turns a string into an enum member: "name.upper()" (enum_class[value.upper()])
    or "from_string" (enum_class.from_string(value)); None if there is no enum_type()."""
    function = find_def(statements, "enum_type")
    if function is None:
        return None
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Call)
            and isinstance(node.slice.func, ast.Attribute)
            and node.slice.func.attr == "upper"
        ):
            return "name.upper()"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_string":
            return "from_string"
    raise UnrecognizedSource("enum_type() neither indexes the enum by value.upper() nor calls from_string()")


# ---------------------------------------------------------------- plugin.py

# add_plugin_argument's two rules this tool interprets; it refuses a version whose function lacks either.
DTYPE_CHOICES_RULE = '[x if x else "disable" for x in plugin_dtype_options]'
BOOL_CHOICES_RULE = "['enable', 'disable']"


def plugin_arguments(source: str, cut_start: bool = False, cut_end: bool = False, excerpt: bool = False) -> dict:
    """{option: spec} of the flags add_plugin_argument() adds, from PluginConfig's fields (with `excerpt`, of
    the fields the text has; else every name of cli_plugin_args must have its field)."""
    statements = complete_statements(source, cut_start, cut_end)
    adder, config = find_def(statements, "add_plugin_argument"), find_def(statements, "PluginConfig")
    if adder is None or config is None:
        raise UnrecognizedSource("plugin.py text lacks a complete add_plugin_argument() or PluginConfig")
    rules = {ast.unparse(k.value) for n in ast.walk(adder) if isinstance(n, ast.Call) for k in n.keywords}
    if DTYPE_CHOICES_RULE not in {r.replace("'", '"') for r in rules} or BOOL_CHOICES_RULE not in rules:
        raise UnrecognizedSource("add_plugin_argument() no longer maps dtype options / bools as this tool assumes")
    gemm_keeps_none = "gemm_plugin" in {
        n.comparators[0].value
        for n in ast.walk(adder)
        if isinstance(n, ast.Compare) and isinstance(n.comparators[0], ast.Constant)
    }
    literals = module_literals(statements)
    cli = literals.get("cli_plugin_args")
    if cli is None:
        raise UnrecognizedSource("no cli_plugin_args list")
    aliases = {  # e.g. DefaultPluginDtype = Literal[...]
        s.targets[0].id: s.value
        for s in statements
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
    }
    # the dataclass PluginConfig (0.x) keys dtype options by field name; the pydantic one (1.x) in Literal types
    dataclass_style = "DEFAULT_PLUGIN_DTYPE_OPTIONS" in literals
    flags = {}
    for field in config.body:
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        name = field.target.id.lstrip("_")
        if name not in cli:
            continue
        default = field_default(field.value)
        options = dtype_options(field, name, literals, aliases, dataclass_style)
        if options is not None:
            choices = list(dict.fromkeys(x if x else "disable" for x in options))
            if not (name == "gemm_plugin" and gemm_keeps_none):
                default = default if default else "disable"
            flags[f"--{name}"] = {"type": "str", "choices": choices, "default": default, "action": None}
        elif ast.unparse(field.annotation) == "bool":
            flags[f"--{name}"] = {
                "type": "str",
                "choices": ["enable", "disable"],
                "default": "enable" if default else "disable",
                "action": None,
            }
        else:
            flags[f"--{name}"] = {"type": ast.unparse(field.annotation), "choices": None, "default": default}
            flags[f"--{name}"]["action"] = None
        flags[f"--{name}"]["line"] = field.lineno
    missing = set(cli) - {f.removeprefix("--") for f in flags}
    if missing and not excerpt:
        raise UnrecognizedSource(f"cli_plugin_args names without a PluginConfig field: {sorted(missing)}")
    return flags


def field_default(node: ast.expr | None):
    """The default of a dataclass `field(default=...)`, a pydantic `Field(default=...)`, or a plain value."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("field", "Field"):
        keywords = {k.arg: k.value for k in node.keywords}
        return value(keywords.get("default"))
    return value(node)


def dtype_options(field: ast.AnnAssign, name: str, literals: dict, aliases: dict, dataclass_style: bool) -> list | None:
    """The dtype options of a plugin field, None for a non-dtype field.

    Dataclass PluginConfig: a str/Optional[str] field takes PLUGIN_DTYPE_OPTIONS_MAP[name] or
    DEFAULT_PLUGIN_DTYPE_OPTIONS. Pydantic PluginConfig: an Optional[Literal[...]] field (directly or via a
    module-level alias) takes the Literal's values, plus None since Optional admits it."""
    if dataclass_style:
        if ast.unparse(field.annotation) in ("str", "Optional[str]"):
            return literals.get("PLUGIN_DTYPE_OPTIONS_MAP", {}).get(name, literals["DEFAULT_PLUGIN_DTYPE_OPTIONS"])
        return None
    node = field.annotation
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "Union"):
        members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for member in members:
            member = aliases.get(member.id, member) if isinstance(member, ast.Name) else member
            if isinstance(member, ast.Subscript) and ast.unparse(member.value) == "Literal":
                elements = member.slice.elts if isinstance(member.slice, ast.Tuple) else [member.slice]
                return [ast.literal_eval(e) for e in elements] + [None]
    return None


# ---------------------------------------------------------------- KVCacheType (C++)

BINDING_ENUM = re.compile(r'enum_<[\w:]*KVCacheType>\(m, "KVCacheType"\)((?:\s*\.value\("\w+",[^)]*\))+)')
FROM_STRING = re.compile(r"KVCacheTypeFromString\(std::string value\)\s*\{(.*?)throw", re.S)


def kv_cache_type_spellings(text: str) -> dict:
    """{"names": [...]} from a binding's .value("NAME", ...) list, and/or {"from_string": [...]} from
    KVCacheTypeFromString's literals (it upper-cases its argument first, so both are case-insensitive)."""
    found = {}
    binding = BINDING_ENUM.search(text)
    if binding:
        found["names"] = re.findall(r'\.value\("(\w+)"', binding.group(1))
    parser = FROM_STRING.search(text)
    if parser:
        if "::toupper" not in parser.group(1):
            raise UnrecognizedSource("KVCacheTypeFromString no longer upper-cases its argument")
        found["from_string"] = re.findall(r'value == "(\w+)"', parser.group(1))
    return found


# ---------------------------------------------------------------- the table


def tabulate(cache: Path) -> dict:
    builds = {
        c["version"]: build_arguments(c["text"], c["cut_start"], c["cut_end"]) for c in cached_versions(cache, BUILD)
    }
    plugins = {
        c["version"]: plugin_arguments(c["text"], c["cut_start"], c["cut_end"]) for c in cached_versions(cache, PLUGIN)
    }
    enum_texts = [(path, c["version"], c["text"]) for path in ENUM_SOURCES for c in cached_versions(cache, path)]
    spellings = {(path, version): kv_cache_type_spellings(text) for path, version, text in enum_texts}
    if not builds or not plugins:
        raise SystemExit(f"no cached {BUILD} or {PLUGIN} under {cache}")

    lookups = {b["enum_lookup"] for b in builds.values()}
    kv_sets = [
        set(s.get("names" if lookup == "name.upper()" else "from_string", []))
        for lookup in lookups
        for s in spellings.values()
        if s.get("names" if lookup == "name.upper()" else "from_string")
    ]
    kv_choices = sorted(v.lower() for v in set.intersection(*kv_sets)) if kv_sets else None

    flags: dict[str, dict] = {}
    for file, versions in ((BUILD, builds), (PLUGIN, plugins)):
        for version, table in versions.items():
            for option, spec in (table["flags"] if file == BUILD else table).items():
                entry = flags.setdefault(option, {"defined_in": file, "by_version": {}})
                entry["by_version"][version] = spec
    for option, entry in flags.items():
        specs = list(entry["by_version"].values())
        entry["in_versions"] = sorted(entry["by_version"])
        types = list(dict.fromkeys(s["type"] for s in specs))
        entry["type"] = types[0] if len(types) == 1 else types
        lists = [s["choices"] for s in specs if isinstance(s["choices"], list)]
        entry["choices"] = [c for c in lists[0] if all(c in other for other in lists)] if lists else None
        if entry["type"] == "enum_type(KVCacheType)":
            entry["choices"] = kv_choices
            entry["choices_from"] = "C++ enum KVCacheType (case-insensitive), see enums.KVCacheType"
    versions_read = {BUILD: sorted(builds), PLUGIN: sorted(plugins)}
    sources = [source_record(cache, v, BUILD) for v in sorted(builds)]
    sources += [source_record(cache, v, PLUGIN) for v in sorted(plugins)]
    sources += [source_record(cache, version, path) for path, version, _ in enum_texts]
    return {
        "sources": sources,
        "versions_read": versions_read,
        "plugin_flags_added_by_build_py": {v: b["adds_plugin_arguments"] for v, b in sorted(builds.items())},
        "enums": {
            "KVCacheType": {
                "lookup_in_build_py": {v: b["enum_lookup"] for v, b in sorted(builds.items())},
                "spellings": {f"{version}/{path}": s for (path, version), s in sorted(spellings.items())},
                "accepted_in_every_version": kv_choices,
            }
        },
        "flags": {option: flags[option] for option in sorted(flags)},
    }


if __name__ == "__main__":
    cache, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(tabulate(cache), indent=1, sort_keys=True) + "\n")
