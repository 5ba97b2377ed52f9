"""Tabulate the LLM-API options (TorchLlmArgs and its nested configs) and `trtllm-serve`'s flags, per release.

Maintainer tool, run by scripts/dev/tabulate_all.py. It reads, with `ast`, `tensorrt_llm/llmapi/llm_args.py` (every
pydantic model: its fields merged over its bases, their kinds, defaults, aliases and stability status, and `extra`
from `model_config` / `class Config`; every StrEnum/Enum; the `speculative_config` discriminator: `decoding_type`
Literals, or the keys of `DecodingBaseConfig.from_dict` before 1.2) and `tensorrt_llm/commands/serve.py` (the
`serve` command's click options, among them the flag(s) naming the options YAML).
"""

from __future__ import annotations

import ast

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, find_def, stored_releases

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
SERVE = "tensorrt_llm/commands/serve.py"
ROOT_MODEL = "TorchLlmArgs"
OPTIONS_PARAM = "extra_llm_api_options"  # serve()'s parameter that receives the options YAML's path

# The copies these facts were read from, per release. The llm_args.py copies have no known commit (they were
# chosen by their content: what the release notes say each release changed); `release_commit` is the commit to
# re-read them at. The serve.py copies have commits, but not the releases' own.
RELEASES = {
    "1.0": {
        "llm_args": None,
        "serve": "4c05a74891e4df8066f08ed4ce14b0972abe4e25",
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "note": "Medium confidence: a 1.0-line llm_args.py (free_gpu_memory_fraction without a default, "
        "'DraftTarget'); a serve.py with only --extra_llm_api_options.",
    },
    "1.1": {
        "llm_args": None,
        "serve": "4c05a74891e4df8066f08ed4ce14b0972abe4e25",
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "note": "Medium-low confidence: an llm_args.py between the 1.0 and 1.2 copies (free_gpu_memory_fraction "
        "0.9, still 'DraftTarget'); 1.0's serve.py, whose --extra_llm_api_options every release accepts.",
    },
    "1.2": {
        "llm_args": None,
        "serve": "00209af149e7774406881a37283dce303571eb11",
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "note": "Medium confidence: an llm_args.py from before 1.3 with the decoding_type Literals "
        "('Draft_Target'); a serve.py with --config and --extra_llm_api_options as its alias.",
    },
}
NOTE = (
    "models[root] holds every key of the LLM-API options YAML (`trtllm-serve MODEL <serve.options_flags[0]> FILE`, "
    "or the non-triton_config keys of Triton's llmapi model.yaml); a field of kind 'model' nests the named model's "
    "fields. 'extra' says what the model does with unknown keys ('forbid': pydantic refuses them); "
    "'fields_complete' is false where not all of a model's fields were read. 'aliases' are further accepted key "
    "names. A field with 'unresolved' names a type defined elsewhere (not read): its content is not checked. "
    "pipeline/targets/trtllm/llm_api_options.py validates options against this table."
)
NOT_TABULATED: dict[str, str] = {}  # release -> why its facts could not be read

SCALARS = {
    "int": "int",
    "NonNegativeInt": "int",
    "PositiveInt": "int",
    "float": "float",
    "NonNegativeFloat": "float",
    "bool": "bool",
    "str": "str",
    "Path": "str",
}
CONTAINERS = {"List": "list", "list": "list", "Set": "list", "set": "list", "Dict": "dict", "dict": "dict"}
OPAQUE = {"object", "Any"}


# ---------------------------------------------------------------- llm_args.py


def _bases(node: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in node.bases]


def _extra_of(node: ast.ClassDef) -> str | None:
    """`extra` from `model_config = {...}` / `ConfigDict(...)` or a nested `class Config`."""
    for item in node.body:
        if isinstance(item, ast.Assign) and [ast.unparse(t) for t in item.targets] == ["model_config"]:
            if isinstance(item.value, ast.Dict):
                config = {ast.literal_eval(k): v for k, v in zip(item.value.keys, item.value.values)}
            else:
                config = {k.arg: k.value for k in item.value.keywords}
            if "extra" in config:
                return ast.literal_eval(config["extra"])
        if isinstance(item, ast.ClassDef) and item.name == "Config":
            for sub in item.body:
                if isinstance(sub, ast.Assign) and [ast.unparse(t) for t in sub.targets] == ["extra"]:
                    return ast.literal_eval(sub.value)
    return None


def _field_call(node: ast.expr | None) -> ast.Call | None:
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("Field", "PydanticField"):
        return node
    return None


def default_meaning(node: ast.expr):
    """A default as a literal, or what a non-literal one means: another model's field default, an enum member, a
    value computed by a model's method."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # Model.field or Enum.MEMBER
        owner, name = node.value.id, node.attr
        return {"enum": owner, "member": name} if name.isupper() else {"default_of": {"model": owner, "field": name}}
    if (  # Model.model_fields['field'].default
        isinstance(node, ast.Attribute)
        and node.attr == "default"
        and isinstance(node.value, ast.Subscript)
        and isinstance(node.value.value, ast.Attribute)
        and node.value.value.attr == "model_fields"
        and isinstance(node.value.value.value, ast.Name)
    ):
        return {"default_of": {"model": node.value.value.value.id, "field": ast.literal_eval(node.value.slice)}}
    if isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute):  # Model.method()
        if isinstance(node.func.value, ast.Name):
            return {"computed_by": {"model": node.func.value.id, "method": node.func.attr}}
    raise UnrecognizedSource(f"a default this tabulator cannot state: {ast.unparse(node)}")


def factory_meaning(node: ast.expr):
    """A `default_factory`: a class or builtin called with no arguments, or a lambda returning a literal (that
    literal is then the default)."""
    if isinstance(node, ast.Name):
        return {"default_factory": node.id}
    if isinstance(node, ast.Lambda):
        return ast.literal_eval(node.body)
    raise UnrecognizedSource(f"a default_factory this tabulator cannot state: {ast.unparse(node)}")


def _field(item: ast.AnnAssign) -> dict:
    """One annotated class attribute: annotation text, default (or required), aliases, status."""
    spec = {"type": ast.unparse(item.annotation)}
    call = _field_call(item.value)
    if call is None:
        spec["required"] = item.value is None
        if item.value is not None:
            spec["default"] = default_meaning(item.value)
        return spec
    keywords = {k.arg: k.value for k in call.keywords}
    default = call.args[0] if call.args else keywords.get("default")
    if "default_factory" in keywords:
        spec["required"], spec["default"] = False, factory_meaning(keywords["default_factory"])
    elif default is None or (isinstance(default, ast.Constant) and default.value is Ellipsis):
        spec["required"] = True
    else:
        spec["required"], spec["default"] = False, default_meaning(default)
    aliases = []
    for key in ("alias", "validation_alias"):
        if key in keywords:
            node = keywords[key]
            found = node.args if isinstance(node, ast.Call) else [node]
            aliases += [ast.literal_eval(a) for a in found if isinstance(a, ast.Constant)]
    if aliases:
        spec["aliases"] = list(dict.fromkeys(aliases))
    if "status" in keywords:
        spec["status"] = ast.literal_eval(keywords["status"])
    if "deprecated" in keywords:  # its message is upstream's text: only that the field is deprecated is kept
        spec["deprecated"] = True
    for key in ("ge", "le", "min_length"):
        if key in keywords:
            spec[key] = ast.literal_eval(keywords[key])
    return spec


def _enum(node: ast.ClassDef) -> dict:
    members = {}
    for item in node.body:
        if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
            members[item.targets[0].id] = ast.literal_eval(item.value)
    kind = "StrEnum" if "StrEnum" in _bases(node) else "Enum"
    # A StrEnum field takes the member's value; a plain Enum field (pydantic) takes the value too.
    return {"base": kind, "members": members, "values": list(members.values())}


def _unwrap(node: ast.expr) -> tuple[str | None, list[ast.expr]]:
    """(subscripted name, its arguments) of `X[...]`, or (None, []) for anything else."""
    if isinstance(node, ast.Subscript):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return ast.unparse(node.value), list(args)
    return None, []


def classify(node: ast.expr, names: dict) -> dict:
    """{"kind", "nullable", ...} of an annotation; `names` holds the file's enums, models, and aliases."""
    head, args = _unwrap(node)
    if head == "Annotated":
        return classify(args[0], names)
    if head in ("Optional", "Union"):
        members = [a for a in args if ast.unparse(a) != "None"]
        nullable = head == "Optional" or len(members) < len(args)
        if len(members) == 1:
            return classify(members[0], names) | ({"nullable": True} if nullable else {})
        inner = [classify(m, names) for m in members]
        return {"kind": "union", "nullable": nullable or any(i["nullable"] for i in inner), "members": inner}
    if head == "Literal":
        return {"kind": "enum", "nullable": False, "choices": [ast.literal_eval(a) for a in args]}
    if head in CONTAINERS:
        return {"kind": CONTAINERS[head], "nullable": False}
    text = ast.unparse(node)
    if text in SCALARS:
        return {"kind": SCALARS[text], "nullable": False}
    if text in OPAQUE:
        return {"kind": "any", "nullable": False}
    if text in names["enums"]:
        return {"kind": "enum", "nullable": False, "choices": names["enums"][text]["values"], "enum": text}
    if text in names["aliases"]:
        return classify(names["aliases"][text], names)
    if text in names["models"]:
        return {"kind": "model", "nullable": False, "model": text}
    return {"kind": "any", "nullable": False, "unresolved": text}


def llm_args_facts(source: str) -> dict:
    """Models, enums and the speculative_config discriminator of one llm_args.py text."""
    statements = complete_statements(source)
    classes = {s.name: s for s in statements if isinstance(s, ast.ClassDef)}
    aliases = {}
    for s in statements:
        target = s.target if isinstance(s, ast.AnnAssign) else (s.targets[0] if isinstance(s, ast.Assign) else None)
        if (
            isinstance(target, ast.Name)
            and s.value is not None
            and _unwrap(s.value)[0] in ("Literal", "Annotated", "Optional", "Union")
        ):
            aliases[target.id] = s.value
    enums = {n: _enum(c) for n, c in classes.items() if {"StrEnum", "Enum"} & set(_bases(c))}
    strict_defined = "StrictBaseModel" in classes
    models: dict[str, ast.ClassDef] = {}
    pending = dict(classes)
    changed = True
    while changed:  # a model is a class whose base is a pydantic base or another model
        changed = False
        for name, node in list(pending.items()):
            if {"BaseModel", "StrictBaseModel"} & set(_bases(node)) or set(_bases(node)) & set(models):
                models[name] = pending.pop(name)
                changed = True
    names = {"enums": enums, "models": models, "aliases": aliases}

    tables: dict[str, dict] = {}

    def table(name: str) -> dict:
        if name in tables:
            return tables[name]
        node = models[name]
        bases = _bases(node)
        fields, extra, extra_from = {}, _extra_of(node), name
        for base in bases:
            if base in models:
                parent = table(base)
                fields |= parent["fields"]
                if extra is None:
                    extra, extra_from = parent["extra"], parent["extra_from"]
            elif base == "StrictBaseModel" and extra is None:
                extra = "forbid"
                extra_from = (
                    "StrictBaseModel" if strict_defined else "StrictBaseModel (imported from llmapi/utils.py, not read)"
                )
            elif base == "BaseModel" and extra is None:
                extra, extra_from = "ignore", "pydantic default"
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            field = item.target.id
            if field.startswith("_") or ast.unparse(item.annotation).startswith("ClassVar"):
                continue
            fields[field] = _field(item) | classify(item.annotation, names)
        tables[name] = {
            "bases": bases,
            "extra": extra,
            "extra_from": extra_from,
            "fields": fields,
            # a whole file gives every field (the committed 1.2 facts, read from a partial copy, mark some false)
            "fields_complete": True,
        }
        return tables[name]

    for name in models:
        table(name)
    if ROOT_MODEL not in tables:
        raise UnrecognizedSource(f"no {ROOT_MODEL} in this llm_args.py text")
    return {
        "models": tables,
        "enums": {n: e["values"] for n, e in enums.items()},
        "decoding_types": decoding_types(classes, tables),
    }


def decoding_types(classes: dict, models: dict) -> dict:
    """{decoding_type value: config class} that speculative_config accepts: the `decoding_type` Literal of each
    DecodingBaseConfig subclass (discriminated union), or the keys of DecodingBaseConfig.from_dict's mapping."""
    found = {
        name: table["fields"]["decoding_type"]["choices"][0]
        for name, table in models.items()
        if "decoding_type" in table["fields"] and table["fields"]["decoding_type"]["kind"] == "enum"
    }
    if found:
        return {v: k for k, v in sorted(found.items())}
    base = classes.get("DecodingBaseConfig")
    method = find_def(base.body, "from_dict") if base else None
    for node in ast.walk(method) if method else []:
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return {ast.literal_eval(k): ast.unparse(v) for k, v in zip(node.keys, node.values)}
    raise UnrecognizedSource("neither decoding_type Literals nor DecodingBaseConfig.from_dict's mapping found")


# ---------------------------------------------------------------- serve.py


def flag_type(node: ast.expr) -> dict:
    """A click option's `type=`: a builtin's name, or choices (ChoiceWithAlias: with their aliases; a Choice over
    a mapping's keys: the mapping's name)."""
    if isinstance(node, ast.Name):
        return {"type": node.id}
    head = ast.unparse(node.func) if isinstance(node, ast.Call) else None
    if head == "ChoiceWithAlias":
        return {"choices": ast.literal_eval(node.args[0]), "aliases": ast.literal_eval(node.args[1])}
    if head == "click.Choice":
        choices = node.args[0]
        if isinstance(choices, ast.Call) and isinstance(choices.func, ast.Attribute) and choices.func.attr == "keys":
            return {"type": "choice", "choices_from": ast.unparse(choices.func.value)}
        return {"type": "choice", "choices": ast.literal_eval(choices)}
    raise UnrecognizedSource(f"a click option type this tabulator cannot state: {ast.unparse(node)}")


def serve_facts(source: str) -> dict:
    """The `serve` command's click options by parameter: its flag names (the first is the current one, the others
    aliases: a renamed flag keeps its old name there), type, default and choices; and the flags that pass the
    options YAML (those bound to serve()'s `extra_llm_api_options` parameter)."""
    function = find_def(complete_statements(source), "serve")
    if function is None:
        raise UnrecognizedSource("no serve() in this serve.py text")
    options = {}
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "click.option"):
            continue
        names = [ast.literal_eval(a) for a in decorator.args if isinstance(a, ast.Constant)]
        flags = [n for n in names if n.startswith("--")]
        params = [n for n in names if not n.startswith("-")]
        keywords = {k.arg: k.value for k in decorator.keywords}
        spec = {"options": flags}
        if "type" in keywords:
            spec |= flag_type(keywords["type"])
        if "is_flag" in keywords:
            spec["is_flag"] = ast.literal_eval(keywords["is_flag"])
        if "default" in keywords:
            spec["default"] = default_meaning(keywords["default"])
        options[params[0] if params else flags[0].lstrip("-")] = spec
    if OPTIONS_PARAM not in options:
        raise UnrecognizedSource(f"no click option bound to serve()'s {OPTIONS_PARAM}")
    backend = options.get("backend", {})
    return {
        "options_flags": options[OPTIONS_PARAM]["options"],
        "backend_choices": backend.get("choices"),
        "backend_aliases": backend.get("aliases"),
        "options": options,
    }


# ---------------------------------------------------------------- the table


def release_facts(upstream: Upstream, release: str) -> dict:
    chosen = RELEASES[release]
    facts = llm_args_facts(upstream.read(REPO, LLM_ARGS, chosen["llm_args"]))
    source = {
        "llm_args": cite(REPO, LLM_ARGS, chosen["llm_args"], pinned=False)
        | {"release_commit": chosen["release_commit"]},
        "serve": cite(REPO, SERVE, chosen["serve"], pinned=False) | {"release_commit": chosen["release_commit"]},
        "note": chosen["note"],
    }
    return {
        "source": source,
        "root": ROOT_MODEL,
        "models": facts["models"],
        "enums": facts["enums"],
        "speculative_decoding_types": facts["decoding_types"],
        "serve": serve_facts(upstream.read(REPO, SERVE, chosen["serve"])),
    }


def tabulate(upstream: Upstream) -> dict:
    releases = {release: release_facts(upstream, release) for release in RELEASES}
    return {"note": NOTE, "not_tabulated": NOT_TABULATED, "releases": stored_releases(releases)}
