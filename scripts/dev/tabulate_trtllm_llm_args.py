"""Tabulate the LLM-API options (TorchLlmArgs and its nested configs) and `trtllm-serve`'s flags, as JSON facts.

Maintainer tool, not run by the pipeline. It reads, with `ast`, the cached excerpts of
`tensorrt_llm/llmapi/llm_args.py` (every pydantic model: its fields merged over its bases, their annotations,
defaults, aliases and stability status, and `extra` from `model_config` / `class Config`; every StrEnum/Enum; the
`speculative_config` discriminator: `decoding_type` Literals from 1.1/1.2's models, or the keys of
`DecodingBaseConfig.from_dict` in 1.0) and of `tensorrt_llm/commands/serve.py` (the `serve` command's click options,
among them the flag(s) naming the options YAML). RELEASES says which cached version stands for which release and why.
Writes pipeline/targets/trtllm_llm_args.json. Usage:
    python scripts/dev/tabulate_trtllm_llm_args.py /work/upstream-cache/NVIDIA+TensorRT-LLM \
        pipeline/targets/trtllm_llm_args.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from upstream_source import READS, REPO, complete_statements, find_def, value

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
SERVE = "tensorrt_llm/commands/serve.py"
ROOT_MODEL = "TorchLlmArgs"
OPTIONS_PARAM = "extra_llm_api_options"  # serve()'s parameter that receives the options YAML's path

# Which cached version stands for which release. The index holds no release commits and named no commit for the
# llm_args.py versions it returned by id, so each choice is argued from the content (see each note).
RELEASES = {
    "1.0": {
        "llm_args": "index-id-1520735490",
        "serve": "index-id-901178132",
        "note": (
            "llm_args.py: of the stored versions found (index ids 1520735490, 1090804222, 7019226376, 292162234 "
            "and the newest, 0004396720; none at 1.0.0's commit ae8270b7, read from tensorrtllm_backend v1.0.0's "
            "submodule), 1520735490 is the one with the 1.0 shape the release notes describe: cuda_graph_config, "
            "kv_cache_config.dtype, moe_config, StrictBaseModel defined inline with extra='forbid', "
            "KvCacheConfig.free_gpu_memory_fraction defaulting to None (the release notes put 0.9 in 1.1) and "
            "DecodingBaseConfig.from_dict keyed 'DraftTarget'; it has mid-2025 features (AutoDecodingConfig, "
            "KvCacheConnectorConfig, the MNNVL allreduce, the CUTEDSL MoE backend), so it is from the 1.0 line of"
            " development, but whether the 1.0.0 release added or renamed fields after it is not known. Medium "
            "confidence. serve.py: index id 901178132, a version with only --extra_llm_api_options and 1.0-era "
            "options (disagg_cluster_uri, media_io_kwargs, no stability tags); medium confidence."
        ),
    },
    "1.1": {
        "llm_args": "index-id-1090804222",
        "serve": "index-id-901178132",
        "note": (
            "llm_args.py: index id 1090804222 (chars 0-112000 read: every field; the rest is validators). Its "
            "content lies between the 1.0 and 1.2 versions: KvCacheConfig.free_gpu_memory_fraction defaults to 0.9 "
            "(the 1.1 change of the release notes) and it has tokens_per_block, SaveState speculation, sparse "
            "attention and the ray orchestrator, while DecodingBaseConfig.from_dict is still keyed 'DraftTarget' "
            "(renamed in 1.2) and StrictBaseModel is still defined in llm_args.py. The 1.1.0 release commit "
            "(48b7b5d8, tensorrtllm_backend's v1.1.0 submodule) is not stored, so whether this is it, the "
            "release/1.1 branch or main near the cut is not known. Medium-low confidence. serve.py: no version "
            "tied to 1.1 was found; the 1.0 one (index id 901178132) is used, whose --extra_llm_api_options every "
            "version read accepts (1.2 keeps it as an alias of --config), so the flag we pass is right whether or "
            "not 1.1 already has --config; its other flags are 1.0's."
        ),
    },
    "1.2": {
        "llm_args": "index-id-7019226376",
        "serve": "00209af149e7774406881a37283dce303571eb11",
        "note": (
            "llm_args.py: index id 7019226376 logs that 'the mtp_eagle_one_model flag will do nothing in release "
            "1.3', so it is from before 1.3; it has 1.2's discriminated speculative_config (decoding_type "
            "Literals, 'Draft_Target'), the KvCacheConfig.free_gpu_memory_fraction default 0.9 and the key-by-key"
            " kv_cache_config merge of update_llm_args_with_extra_dict (read at offset 128000, not cached) that "
            "the 1.2 notes describe. Whether it is the 1.2.x release commit or the main branch shortly "
            "before/after the release/1.2 cut is not known. Medium confidence. serve.py: commit 00209af1 (the "
            "version read_file gave without a commit), which passes custom_tokenizer and otlp_traces_endpoint, as"
            " this llm_args.py has them, and accepts --config and --extra_llm_api_options; medium-low confidence "
            "that it is 1.2 rather than early 1.3."
        ),
    },
}
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
FIELDS_ELIDED = "# [fields elided]"  # marks, in a cached excerpt, a class some of whose fields were left out


class UnrecognizedSource(ValueError):
    """The upstream code no longer has the shape this tabulator interprets: read it and update the tool."""


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


def _field(item: ast.AnnAssign) -> dict:
    """One annotated class attribute: annotation text, default (or required), aliases, status."""
    spec = {"type": ast.unparse(item.annotation)}
    call = _field_call(item.value)
    if call is None:
        spec["required"] = item.value is None
        if item.value is not None:
            spec["default"] = value(item.value)
        return spec
    keywords = {k.arg: k.value for k in call.keywords}
    default = call.args[0] if call.args else keywords.get("default")
    if "default_factory" in keywords:
        spec["required"], spec["default"] = False, {"factory": ast.unparse(keywords["default_factory"])}
    elif default is None or (isinstance(default, ast.Constant) and default.value is Ellipsis):
        spec["required"] = True
    else:
        spec["required"], spec["default"] = False, value(default)
    aliases = []
    for key in ("alias", "validation_alias"):
        if key in keywords:
            node = keywords[key]
            found = node.args if isinstance(node, ast.Call) else [node]
            aliases += [ast.literal_eval(a) for a in found if isinstance(a, ast.Constant)]
    if aliases:
        spec["aliases"] = list(dict.fromkeys(aliases))
    for key in ("status", "deprecated", "ge", "le", "min_length"):
        if key in keywords:
            spec[key] = value(keywords[key])
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


def llm_args_facts(source: str, excerpt: bool = False) -> dict:
    """Models, enums and the speculative_config discriminator of one llm_args.py text (with `excerpt`, of a text
    that may lack TorchLlmArgs or the speculative configs)."""
    statements = complete_statements(source)
    classes = {s.name: s for s in statements if isinstance(s, ast.ClassDef)}
    lines = source.splitlines()
    starts = sorted(s.lineno for s in statements) + [len(lines) + 1]
    partial = {  # a class's text runs to the next statement (trailing comments included)
        name
        for name, c in classes.items()
        if any(FIELDS_ELIDED in line for line in lines[c.lineno - 1 : starts[starts.index(c.lineno) + 1] - 1])
    }
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
        complete = name not in partial
        for base in bases:
            if base in models:
                parent = table(base)
                fields |= parent["fields"]
                complete = complete and parent["fields_complete"]
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
            "fields_complete": complete,
        }
        return tables[name]

    for name in models:
        table(name)
    if ROOT_MODEL not in tables and not excerpt:
        raise UnrecognizedSource(f"no {ROOT_MODEL} in this llm_args.py text")
    return {
        "models": tables,
        "enums": {n: e["values"] for n, e in enums.items()},
        "decoding_types": decoding_types(classes, tables, excerpt),
    }


def decoding_types(classes: dict, models: dict, excerpt: bool = False) -> dict:
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
    if excerpt:
        return {}
    raise UnrecognizedSource("neither decoding_type Literals nor DecodingBaseConfig.from_dict's mapping found")


# ---------------------------------------------------------------- serve.py


def serve_facts(source: str) -> dict:
    """The `serve` command's click options: each flag's parameter, type, default and choices; and the flag(s)
    that pass the options YAML (the option bound to serve()'s `extra_llm_api_options` parameter)."""
    function = find_def(complete_statements(source), "serve")
    if function is None:
        raise UnrecognizedSource("no serve() in this serve.py text")
    flags, backend = {}, None
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "click.option"):
            continue
        names = [ast.literal_eval(a) for a in decorator.args if isinstance(a, ast.Constant)]
        options = [n for n in names if n.startswith("--")]
        params = [n for n in names if not n.startswith("-")]
        param = params[0] if params else options[0].lstrip("-")
        keywords = {k.arg: k.value for k in decorator.keywords}
        spec = {"param": param, "options": options}
        kind = keywords.get("type")
        if isinstance(kind, ast.Call) and ast.unparse(kind.func) == "ChoiceWithAlias":
            spec["choices"], spec["aliases"] = ast.literal_eval(kind.args[0]), ast.literal_eval(kind.args[1])
        elif kind is not None:
            spec["type"] = ast.unparse(kind)
        if "is_flag" in keywords:
            spec["is_flag"] = ast.literal_eval(keywords["is_flag"])
        if "default" in keywords:
            spec["default"] = value(keywords["default"])
        for option in options:
            flags[option] = spec
        if param == "backend":
            backend = spec
    options_flags = next((s["options"] for s in flags.values() if s["param"] == OPTIONS_PARAM), None)
    if options_flags is None:
        raise UnrecognizedSource(f"no click option bound to serve()'s {OPTIONS_PARAM}")
    return {
        "options_flags": options_flags,
        "backend_choices": backend["choices"] if backend else None,
        "backend_aliases": backend["aliases"] if backend else None,
        "flags": flags,
    }


# ---------------------------------------------------------------- the table


def _cached(cache: Path, version: str, path: str) -> tuple[str, dict]:
    """Text of the cached excerpt and its READS record."""
    file = cache / version / f"{path} (excerpt)"
    reads = json.loads((cache / READS).read_text())["reads"]
    commit = None if version.startswith("index-id-") else version
    index_id = version.removeprefix("index-id-") if commit is None else None
    for read in reads:
        if read["path"].split(" ")[0] == path and (read["commit"] == commit if commit else read["id"] == index_id):
            record = {"repo": REPO, "path": path, "commit": commit, "index_id": read["id"]}
            record |= {"ranges": read["ranges"], "total_chars": read["total_chars"], "cached_as": "excerpt"}
            return file.read_text(), record
    raise KeyError(f"{version}/{path} is not described in {cache / READS}")


def tabulate(cache: Path) -> dict:
    releases = {}
    for release, chosen in RELEASES.items():
        llm_text, llm_source = _cached(cache, chosen["llm_args"], LLM_ARGS)
        serve_text, serve_source = _cached(cache, chosen["serve"], SERVE)
        facts = llm_args_facts(llm_text)
        releases[release] = {
            "source": {"llm_args": llm_source, "serve": serve_source, "note": chosen["note"]},
            "root": ROOT_MODEL,
            "models": facts["models"],
            "enums": facts["enums"],
            "speculative_decoding_types": facts["decoding_types"],
            "serve": serve_facts(serve_text),
        }
    return {
        "note": (
            "Made by scripts/dev/tabulate_trtllm_llm_args.py from excerpts of TensorRT-LLM's llm_args.py and "
            "commands/serve.py (sources per release). models[root] holds every key of the LLM-API options YAML "
            "(`trtllm-serve MODEL <serve.options_flags[0]> FILE`, or the non-triton_config keys of Triton's "
            "llmapi model.yaml); a field of kind 'model' nests the named model's fields. 'extra' says what the "
            "model does with unknown keys ('forbid': pydantic refuses them). 'aliases' are further accepted key "
            "names. A field with 'unresolved' names a type defined elsewhere (not read): its content is not "
            "checked. pipeline/targets/llm_api_args.py validates options against this table."
        ),
        "not_tabulated": NOT_TABULATED,
        "releases": releases,
    }


if __name__ == "__main__":
    cache, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(tabulate(cache), indent=1, sort_keys=True) + "\n")
