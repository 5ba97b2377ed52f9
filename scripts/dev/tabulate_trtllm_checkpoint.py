"""Tabulate what TensorRT-LLM's checkpoint loader accepts, from its own source, as JSON facts.

Maintainer tool, not run by the pipeline. Reads with `ast` every cached version (or slice) of:
- tensorrt_llm/models/modeling_utils.py: the fields of the `QuantConfig` dataclass and how `from_dict` builds
  it (`cls(**config)`: a key that is not a field raises); how `PretrainedConfig` consumes the checkpoint's
  `mapping` and `quantization` dicts (`Mapping.from_dict(...)` / `QuantConfig.from_dict(...)`, or legacy
  `.get(key)` picks); how `preprocess_perlayer_weights` treats W8A16; what `PretrainedModel.load` does with
  missing and extra tensors;
- tensorrt_llm/mapping.py: the parameters of `Mapping.__init__`, how `from_dict` calls it, what `to_dict`
  writes and the conditions under which `__init__` raises;
- tensorrt_llm/quantization/layers.py: the parameters (name, shape, dtype, condition) that the weight-only
  linears register, and their padding rule (`multiple = ...`);
- tensorrt_llm/models/convert_utils.py: `weight_only_quantize_dict` (which weights the loader quantizes itself).
Writes pipeline/trtllm_checkpoint_rules.json. Usage:
    python scripts/dev/tabulate_trtllm_checkpoint.py /work/upstream-cache/NVIDIA+TensorRT-LLM \
        pipeline/trtllm_checkpoint_rules.json
"""

from __future__ import annotations

import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from upstream_source import CUT_CLASS, cached_versions, complete_statements, find_def, source_record, value

MODELING_UTILS = "tensorrt_llm/models/modeling_utils.py"
MAPPING = "tensorrt_llm/mapping.py"
LAYERS = "tensorrt_llm/quantization/layers.py"
CONVERT_UTILS = "tensorrt_llm/models/convert_utils.py"
WEIGHT_ONLY_CLASSES = (
    "WeightOnlyQuantLinear",
    "WeightOnlyQuantRowLinear",
    "WeightOnlyGroupwiseQuantLinear",
    "WeightOnlyGroupwiseQuantRowLinear",
)


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    return find_def(cls.body, name) if cls is not None else None


def where(node: ast.AST, offset: int) -> dict:
    """The position of a node: its line in the file when the text read starts at offset 0, else its line
    within the slice that starts at `offset` characters."""
    return {"line": node.lineno} if offset == 0 else {"slice_offset": offset, "line_in_slice": node.lineno}


def calls_with_star_kwargs(function: ast.FunctionDef | None) -> list[str]:
    """Calls in `function` that pass a dict as **kwargs, e.g. ["cls(**config)"]."""
    if function is None:
        return []
    return [
        ast.unparse(n) for n in ast.walk(function) if isinstance(n, ast.Call) and any(k.arg is None for k in n.keywords)
    ]


# ---------------------------------------------------------------- modeling_utils.py


def quant_config(statements: list[ast.stmt], offset: int) -> dict | None:
    """QuantConfig's dataclass fields and how from_dict builds it; None when the text has no QuantConfig."""
    cls = find_def(statements, "QuantConfig")
    if cls is None:
        return None
    decorators = [ast.unparse(d) for d in cls.decorator_list]
    fields = [
        {"name": f.target.id, "annotation": ast.unparse(f.annotation), "default": value(f.value)}
        for f in cls.body
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
    ]
    return {
        "decorators": decorators,
        "fields": fields,
        "from_dict_calls": calls_with_star_kwargs(method(cls, "from_dict")),
        **where(cls, offset),
    }


def pretrained_config(statements: list[ast.stmt], offset: int) -> dict | None:
    """How PretrainedConfig turns the checkpoint's `mapping` and `quantization` dicts into objects.

    In a slice that starts inside the class, the class is recognised by its from_dict popping 'architecture'."""
    cls, inferred = find_def(statements, "PretrainedConfig"), False
    if cls is None:
        cut = find_def(statements, CUT_CLASS)
        reader = method(cut, "from_dict")
        if reader is None or "config.pop('architecture')" not in ast.unparse(reader):
            return None
        cls, inferred = cut, True
    out = {"class_recognised_by": "from_dict pops 'architecture'"} if inferred else {}
    for key in ("mapping", "quantization"):  # the dicts' parameter names in __init__ / from_dict
        built_by = sorted(
            {
                ast.unparse(n.func)
                for n in ast.walk(cls)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "from_dict"
                and [ast.unparse(a) for a in n.args] == [key]
            }
        )
        picked = sorted(
            {
                n.args[0].value
                for n in ast.walk(cls)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get"
                and ast.unparse(n.func.value) == key
                and n.args
                and isinstance(n.args[0], ast.Constant)
            }
        )
        out[key] = {"built_by": built_by, "keys_picked_with_get": picked}
    keys = ("mapping", "quantization")
    out["from_dict_calls"] = calls_with_star_kwargs(method(cls, "from_dict"))
    if not out["from_dict_calls"] and not any(out[k]["built_by"] or out[k]["keys_picked_with_get"] for k in keys):
        return None  # the class is there, but not the part that reads the dicts
    return out | where(cls, offset)


def load_rules(statements: list[ast.stmt], offset: int) -> dict | None:
    """What PretrainedModel.load does when the checkpoint lacks or adds tensors: {condition: "raise X" | call}."""
    load = method(find_def(statements, "PretrainedModel"), "load")
    if load is None:
        return None
    outcomes = {}
    for node in ast.walk(load):
        if isinstance(node, ast.If) and "provided_names" in ast.unparse(node.test):
            body = ast.Module(body=node.body, type_ignores=[])
            raises = [n for n in ast.walk(body) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
            first = node.body[0]
            if raises:
                outcomes[ast.unparse(node.test)] = f"raise {ast.unparse(raises[0].exc.func)}"
            elif isinstance(first, ast.Expr) and isinstance(first.value, ast.Call):
                outcomes[ast.unparse(node.test)] = ast.unparse(first.value.func)
    return {"on": outcomes} | where(load, offset)


def w8a16_preprocessing(statements: list[ast.stmt], offset: int) -> dict | None:
    """The branch of preprocess_perlayer_weights that handles W8A16, and the call it makes."""
    function = find_def(statements, "preprocess_perlayer_weights")
    if function is None:
        return None
    for node in ast.walk(function):
        if isinstance(node, ast.If) and "QuantAlgo.W8A16" in ast.unparse(node.test):
            calls = [ast.unparse(n) for n in ast.walk(ast.Module(body=node.body, type_ignores=[]))]
            calls = [c for c in calls if c.startswith("weight_only_quantize_dict(")]
            return {"condition": ast.unparse(node.test), "calls": calls} | where(node, offset)
    return {"condition": None, "calls": []}


# ---------------------------------------------------------------- convert_utils.py


def weight_only_quantize_dict(statements: list[ast.stmt], offset: int) -> dict | None:
    """Which weights the loader quantizes itself for W8A16/W4A16, and what it writes in their place."""
    function = find_def(statements, "weight_only_quantize_dict")
    helper = find_def(statements, "weight_only_quantize")
    if function is None:
        return None
    arguments = function.args
    defaults = dict(zip([a.arg for a in arguments.args][-len(arguments.defaults) :], arguments.defaults))
    loop_conditions = [
        ast.unparse(n.test)
        for n in ast.walk(function)
        if isinstance(n, ast.If) and "weights[name].dtype" in ast.unparse(n.test)
    ]
    writes = [
        ast.unparse(t)
        for n in ast.walk(function)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "weights"
    ]
    ops = (
        sorted(
            {
                ast.unparse(n.func)
                for n in ast.walk(helper)
                if isinstance(n, ast.Call) and "torch.ops" in ast.unparse(n.func)
            }
        )
        if helper is not None
        else []
    )
    return {
        "quant_weights_default": value(defaults.get("quant_weights")),
        "quantizes_when": loop_conditions,
        "writes": writes,
        "quantizer_ops": ops,
    } | where(function, offset)


# ---------------------------------------------------------------- mapping.py


def mapping_rules(statements: list[ast.stmt], offset: int) -> dict | None:
    """Mapping.__init__'s parameter names, how from_dict calls it, what to_dict writes, and when __init__ raises."""
    classes = {s.name: s for s in statements if isinstance(s, ast.ClassDef)}
    cls = classes.get("Mapping")
    if cls is None:
        return None
    lineage = [cls] + [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]

    def inherited(name):
        return next((m for m in (method(c, name) for c in lineage) if m is not None), None)

    init = inherited("__init__")
    arguments = init.args
    params = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs if a.arg != "self"]
    # __init__ may only forward to the base class; its conditions live where the work is done
    raising = [m for m in (method(c, "__init__") for c in lineage) if m is not None]
    raises_if = [
        ast.unparse(n.test)
        for m in raising
        for n in ast.walk(m)
        if isinstance(n, ast.If) and any(isinstance(b, ast.Raise) for b in n.body)
    ]
    to_dict = inherited("to_dict")
    written = []
    if to_dict is not None:
        for n in ast.walk(to_dict):
            if isinstance(n, ast.Dict):
                written = [k.value for k in n.keys if isinstance(k, ast.Constant)]
    return {
        "class_lineage": [c.name for c in lineage],
        "init_params": params,
        "from_dict_calls": calls_with_star_kwargs(inherited("from_dict")),
        "to_dict_keys": written,
        "init_raises_if": list(dict.fromkeys(raises_if)),
    } | where(init, offset)


# ---------------------------------------------------------------- layers.py


def weight_only_layers(statements: list[ast.stmt], offset: int) -> dict:
    """For each weight-only linear wholly in the text: its registered parameters and its padding rule."""
    out = {}
    aliases = {
        s.targets[0].id: s.value.id
        for s in statements
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Name) and isinstance(s.targets[0], ast.Name)
    }
    for name in WEIGHT_ONLY_CLASSES:
        init = method(find_def(statements, name), "__init__")
        if init is None:
            continue
        params, padding = {}, None
        local = defaultdict(list)  # local names a shape or dtype may use, e.g. scale_shape, pack_ratio
        for n, conditions in walk_with_conditions(init.body, []):
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
                condition = " and ".join(conditions)
                local[n.targets[0].id].append(ast.unparse(n.value) + (f"  (if {condition})" if condition else ""))
        for node, conditions in walk_with_conditions(init.body, []):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "multiple"
            ):
                padding = {"multiple": ast.unparse(node.value)} | where(node, offset)
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "Parameter"
                and isinstance(node.targets[0], ast.Attribute)
            ):
                keywords = {k.arg: k.value for k in node.value.keywords}
                used = sorted(
                    {
                        n.id
                        for k in ("shape", "dtype")
                        if k in keywords
                        for n in ast.walk(keywords[k])
                        if isinstance(n, ast.Name)
                    }
                    & set(local)
                )
                params[node.targets[0].attr] = {
                    "shape": ast.unparse(keywords["shape"]) if "shape" in keywords else None,
                    "dtype": ast.unparse(keywords["dtype"]) if "dtype" in keywords else None,
                    "only_if": " and ".join(conditions) or None,
                    "where": {n: local[n] for n in used},
                } | where(node, offset)
        padded = [
            ast.unparse(n.targets[0])
            for n, _ in walk_with_conditions(init.body, [])
            if isinstance(n, ast.Assign)
            and ast.unparse(n.value).startswith("math.ceil(")
            and isinstance(n.targets[0], ast.Name)
        ]
        out[name] = {
            "parameters": params,
            "padding": padding | {"padded": padded} if padding else None,
            "aliases": sorted(a for a, target in aliases.items() if target == name),
            "base": [ast.unparse(b) for b in find_def(statements, name).bases],
        } | where(init, offset)
    return out


def walk_with_conditions(body: list[ast.stmt], conditions: list[str]):
    """(statement, enclosing if-conditions) for every statement in `body`, recursively."""
    for node in body:
        yield node, conditions
        if isinstance(node, ast.If):
            yield from walk_with_conditions(node.body, conditions + [ast.unparse(node.test)])
            yield from walk_with_conditions(node.orelse, conditions + [f"not ({ast.unparse(node.test)})"])


# ---------------------------------------------------------------- the table


def per_version(cache: Path, path: str, readers: dict) -> dict[str, dict]:
    """{version: {fact: value}} from all cached slices of `path`, each read with every reader."""
    facts: dict[str, dict] = defaultdict(dict)
    for cached in cached_versions(cache, path):
        version, offset = cached["version"], cached["offset"]
        statements = complete_statements(cached["text"], cached["cut_start"], cached["cut_end"])
        for fact, reader in readers.items():
            result = reader(statements, offset)
            if result:
                facts[version][fact] = result
        facts[version].setdefault("_read", [])
    return {v: {k: f for k, f in facts[v].items() if k != "_read"} for v in sorted(facts)}


def tabulate(cache: Path) -> dict:
    modeling = per_version(
        cache,
        MODELING_UTILS,
        {
            "quant_config": quant_config,
            "pretrained_config": pretrained_config,
            "load": load_rules,
            "w8a16_preprocessing": w8a16_preprocessing,
        },
    )
    mappings = per_version(cache, MAPPING, {"mapping": mapping_rules})
    layers = per_version(cache, LAYERS, {"weight_only_layers": weight_only_layers})
    converters = per_version(cache, CONVERT_UTILS, {"weight_only_quantize_dict": weight_only_quantize_dict})

    with_quant_config = {v: f["quant_config"] for v, f in modeling.items() if "quant_config" in f}
    field_sets = [{f["name"] for f in q["fields"]} for q in with_quant_config.values()]
    param_sets = [set(f["mapping"]["init_params"]) for f in mappings.values() if "mapping" in f]
    sources = [
        source_record(cache, version, path)
        for path, table in (
            (MODELING_UTILS, modeling),
            (MAPPING, mappings),
            (LAYERS, layers),
            (CONVERT_UTILS, converters),
        )
        for version in table
    ]
    first = next(iter(with_quant_config.values()))
    return {
        "sources": sources,
        "quant_config": {
            "source": MODELING_UTILS,
            "by_version": {v: q for v, q in with_quant_config.items()},
            "versions_without_quant_config_in_text_read": sorted(set(modeling) - set(with_quant_config)),
            "accepted_in_every_version": [
                f["name"] for f in first["fields"] if all(f["name"] in s for s in field_sets)
            ],
        },
        "pretrained_config": {
            "source": MODELING_UTILS,
            "by_version": {v: f["pretrained_config"] for v, f in modeling.items() if "pretrained_config" in f},
        },
        "load": {"source": MODELING_UTILS, "by_version": {v: f["load"] for v, f in modeling.items() if "load" in f}},
        "mapping": {
            "source": MAPPING,
            "by_version": {v: f["mapping"] for v, f in mappings.items() if "mapping" in f},
            "accepted_in_every_version": sorted(set.intersection(*param_sets)),
            "accepted_in_some_version_only": sorted(set.union(*param_sets) - set.intersection(*param_sets)),
        },
        "weight_only_layers": {
            "source": LAYERS,
            "by_version": {v: f["weight_only_layers"] for v, f in layers.items() if "weight_only_layers" in f},
        },
        "w8a16_loader": {
            "preprocess_perlayer_weights": {
                "source": MODELING_UTILS,
                "by_version": {v: f["w8a16_preprocessing"] for v, f in modeling.items() if "w8a16_preprocessing" in f},
            },
            "weight_only_quantize_dict": {
                "source": CONVERT_UTILS,
                "by_version": {v: f["weight_only_quantize_dict"] for v, f in converters.items() if f},
            },
        },
    }


if __name__ == "__main__":
    cache, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(tabulate(cache), indent=1, sort_keys=True) + "\n")
