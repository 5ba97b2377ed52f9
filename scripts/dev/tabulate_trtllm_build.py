"""Tabulate the flags `trtllm-build` accepts, from TensorRT-LLM's own source (upstream/trtllm_build_flags.json).

Maintainer tool, run by scripts/dev/tabulate_all.py. It reads, with `ast`, each version of
`tensorrt_llm/commands/build.py` (`parse_arguments`: each `add_argument` with its type, choices, default, action,
aliases) and of `tensorrt_llm/plugin/plugin.py` (the `PluginConfig` fields that `add_plugin_argument` turns into
flags: dtype plugins get the plugin's dtype options with None spelled "disable", bool features get enable/disable,
others their annotated type). `--kv_cache_type` is typed by the C++ enum `KVCacheType`; its accepted spellings come
from the bindings' value names (build.py looks a name up upper-cased) or from `KVCacheTypeFromString` (upper-cases,
then compares literals); no `ast` for C++, the two patterns are matched.

A flag's facts are stored once; a version that differs from the others is named in `absent_from` or `by_version`.
None of the copies read is at a release's own commit (`pinned` false); one plugin.py and the C++ files were read from
copies with no known commit (`commit` null).
"""

from __future__ import annotations

import ast
import re

from upstream_source import (
    REPO,
    UnrecognizedSource,
    Upstream,
    cite,
    complete_statements,
    dotted_name,
    find_def,
    module_literals,
)

BUILD = "tensorrt_llm/commands/build.py"
PLUGIN = "tensorrt_llm/plugin/plugin.py"
PYBIND = "cpp/tensorrt_llm/pybind/bindings.cpp"
NANOBIND = "cpp/tensorrt_llm/nanobind/bindings.cpp"
MODEL_CONFIG_H = "cpp/include/tensorrt_llm/runtime/modelConfig.h"

# The commits read per file (None: a copy whose commit is not known).
BUILD_COMMITS = ("008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc", "65f1d1536e18aea3380e6e270e00895a709333eb")
PLUGIN_COMMITS = ("c20322ffd3dc0740ca530c9fad989b22e64f6e06", None)
KV_CACHE_TYPE_READS = ((PYBIND, None), (PYBIND, None), (NANOBIND, None), (MODEL_CONFIG_H, None), (MODEL_CONFIG_H, None))

UPPER_CASED_NAME, FROM_STRING_LOOKUP = "upper_cased_name", "from_string"


def default_facts(node: ast.expr | None) -> dict:
    """An argument's default: {"default": literal}, {"default_from": "<class attribute it copies>"}, or
    {"default_suppressed": True} (argparse.SUPPRESS: the attribute is left unset when the flag is not given)."""
    if node is None:
        return {"default": None}
    try:
        return {"default": ast.literal_eval(node)}
    except ValueError:
        pass
    name = dotted_name(node)
    if name == "argparse.SUPPRESS":
        return {"default_suppressed": True}
    if name is None:
        raise UnrecognizedSource("a default that is neither a literal nor a name")
    return {"default_from": name}


def choices_facts(node: ast.expr | None) -> dict:
    """{"choices": [...] | None}, plus {"choices_are_keys_of": "<mapping>"} for `choices=<mapping>.keys()`."""
    if node is None:
        return {"choices": None}
    try:
        return {"choices": list(ast.literal_eval(node))}
    except ValueError:
        pass
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys":
        return {"choices": None, "choices_are_keys_of": dotted_name(node.func.value)}
    raise UnrecognizedSource("choices that are neither a literal nor a mapping's keys")


def type_fact(node: ast.expr | None):
    """An argument's type: its name ("int"), {"enum": "<C++ enum>"} for `enum_type(<enum>)`, or None."""
    if node is None:
        return None
    if isinstance(node, ast.Call) and dotted_name(node.func) == "enum_type" and len(node.args) == 1:
        return {"enum": dotted_name(node.args[0])}
    name = dotted_name(node)
    if name is None:
        raise UnrecognizedSource("a type that is neither a name nor enum_type(<enum>)")
    return name


# ---------------------------------------------------------------- build.py


def build_arguments(source: str) -> dict:
    """{"flags": {option: spec}, "adds_plugin_arguments": bool, "enum_lookup": ...} of parse_arguments()."""
    statements = complete_statements(source)
    function = find_def(statements, "parse_arguments")
    if function is None:
        raise UnrecognizedSource("no parse_arguments() in this build.py")
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
            "type": type_fact(keywords.get("type")),
            **choices_facts(keywords.get("choices")),
            **default_facts(keywords.get("default")),
            "action": ast.literal_eval(keywords["action"]) if "action" in keywords else None,
        }
        for extra in ("dest", "nargs"):
            if extra in keywords:
                spec[extra] = ast.literal_eval(keywords[extra])
        for i, option in enumerate(options):  # the first spelling is the flag, the others its aliases
            flags[option] = spec | ({"alias_of": options[0]} if i else {})
    return {"flags": flags, "adds_plugin_arguments": adds_plugins, "enum_lookup": enum_lookup(statements)}


def enum_lookup(statements: list[ast.stmt]) -> str | None:
    """How build.py's enum_type() turns a string into an enum member: by its upper-cased name (indexing the enum)
    or by the enum's from_string(); None if there is no enum_type()."""
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
            return UPPER_CASED_NAME
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_string":
            return FROM_STRING_LOOKUP
    raise UnrecognizedSource("enum_type() neither indexes the enum by the upper-cased value nor calls from_string()")


# ---------------------------------------------------------------- plugin.py


def spells_none_as_disable(node: ast.AST) -> bool:
    """Whether `node` is a comprehension keeping each option but spelling a falsy one "disable"."""
    if not isinstance(node, ast.ListComp) or not isinstance(node.elt, ast.IfExp):
        return False
    choice = node.elt
    return (
        isinstance(choice.orelse, ast.Constant)
        and choice.orelse.value == "disable"
        and dotted_name(choice.test) == dotted_name(choice.body) == dotted_name(node.generators[0].target)
    )


def plugin_arguments(source: str) -> dict:
    """{option: spec} of the flags add_plugin_argument() adds, from PluginConfig's fields; every name of
    cli_plugin_args must have its field."""
    statements = complete_statements(source)
    adder, config = find_def(statements, "add_plugin_argument"), find_def(statements, "PluginConfig")
    if adder is None or config is None:
        raise UnrecognizedSource("plugin.py lacks add_plugin_argument() or PluginConfig")
    keyword_values = [k.value for n in ast.walk(adder) if isinstance(n, ast.Call) for k in n.keywords]
    maps_dtypes = any(spells_none_as_disable(v) for v in keyword_values)
    maps_bools = any(isinstance(v, ast.List) and ast.literal_eval(v) == ["enable", "disable"] for v in keyword_values)
    if not (maps_dtypes and maps_bools):
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
            choices, default = ["enable", "disable"], "enable" if default else "disable"
            flags[f"--{name}"] = {"type": "str", "choices": choices, "default": default, "action": None}
        else:
            flags[f"--{name}"] = {"type": type_fact(field.annotation), "choices": None, "default": default}
            flags[f"--{name}"]["action"] = None
    missing = set(cli) - {f.removeprefix("--") for f in flags}
    if missing:
        raise UnrecognizedSource(f"cli_plugin_args names without a PluginConfig field: {sorted(missing)}")
    return flags


def field_default(node: ast.expr | None):
    """The literal default of a dataclass `field(default=...)`, a pydantic `Field(default=...)`, or a plain value."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("field", "Field"):
        node = {k.arg: k.value for k in node.keywords}.get("default")
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError as error:
        raise UnrecognizedSource("a plugin field whose default is not a literal") from error


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
    """{"names": [...]} from a binding's value-name list, and/or {"from_string": [...]} from the literals
    KVCacheTypeFromString compares with (it upper-cases its argument first, so both are case-insensitive)."""
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


def merged_flags(file: str, versions: dict[str, dict]) -> dict[str, dict]:
    """{option: facts} over the versions of one file ({commit: {option: spec}}): a spec shared by every version
    that has the flag is stored once; `absent_from` names the versions without it, `by_version` the facts in which
    a version differs (and `choices` is then those every version offers)."""
    flags: dict[str, dict] = {}
    for option in dict.fromkeys(option for specs in versions.values() for option in specs):
        having = {version: specs[option] for version, specs in versions.items() if option in specs}
        fields = list(dict.fromkeys(key for spec in having.values() for key in spec))
        first = next(iter(having.values()))
        shared = {k: first[k] for k in fields if all(k in s and s[k] == first.get(k) for s in having.values())}
        entry = {"defined_in": file} | shared
        differing = [k for k in fields if k not in shared]
        if differing:
            lists = [s["choices"] for s in having.values() if isinstance(s.get("choices"), list)]
            if "choices" in differing:
                entry["choices"] = [c for c in lists[0] if all(c in other for other in lists)] if lists else None
            entry["by_version"] = {v: {k: s.get(k) for k in differing} for v, s in having.items()}
        absent = [version for version in versions if version not in having]
        if absent:
            entry["absent_from"] = absent
        flags[option] = entry
    return flags


def tabulate(upstream: Upstream) -> dict:
    builds = {commit: build_arguments(upstream.read(REPO, BUILD, commit)) for commit in BUILD_COMMITS}
    plugins = {commit: plugin_arguments(upstream.read(REPO, PLUGIN, commit)) for commit in PLUGIN_COMMITS}
    spellings = [
        {"source": cite(REPO, path, commit, pinned=False)} | kv_cache_type_spellings(upstream.read(REPO, path, commit))
        for path, commit in KV_CACHE_TYPE_READS
    ]
    lookups = {b["enum_lookup"] for b in builds.values()}
    kv_sets = [
        set(s.get("names" if lookup == UPPER_CASED_NAME else "from_string", []))
        for lookup in lookups
        for s in spellings
        if s.get("names" if lookup == UPPER_CASED_NAME else "from_string")
    ]
    kv_choices = sorted(v.lower() for v in set.intersection(*kv_sets)) if kv_sets else None
    flags = merged_flags(BUILD, {c: b["flags"] for c, b in builds.items()}) | merged_flags(PLUGIN, plugins)
    for entry in flags.values():
        if isinstance(entry.get("type"), dict) and entry["type"].get("enum") == "KVCacheType":
            entry |= {"choices": kv_choices, "choices_from_enum": "KVCacheType"}
    return {
        "sources": {
            BUILD: [cite(REPO, BUILD, commit, pinned=False) for commit in BUILD_COMMITS],
            PLUGIN: [cite(REPO, PLUGIN, commit, pinned=False) for commit in PLUGIN_COMMITS],
        },
        "plugin_flags_added_by_build_py": all(b["adds_plugin_arguments"] for b in builds.values()),
        "enums": {
            "KVCacheType": {
                "lookup_in_build_py": {commit: b["enum_lookup"] for commit, b in builds.items()},
                "spellings": spellings,
                "accepted_in_every_version": kv_choices,
            }
        },
        "flags": {option: flags[option] for option in sorted(flags)},
    }
