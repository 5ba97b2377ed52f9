"""Tabulate what TensorRT-LLM's checkpoint loader accepts, from its own source (upstream/trtllm_checkpoint.json).

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast`:
- tensorrt_llm/models/modeling_utils.py: the fields of the `QuantConfig` dataclass and whether its `from_dict` passes
  every key on as a keyword (a key that is not a field then raises); how `PretrainedConfig` consumes the checkpoint's
  `mapping` and `quantization` dicts (built by `Mapping.from_dict` / `QuantConfig.from_dict`, or legacy keys picked
  with `.get`); how `preprocess_perlayer_weights` treats W8A16; what `PretrainedModel.load` does with missing and
  extra tensors;
- tensorrt_llm/mapping.py: the parameters of `Mapping.__init__`, whether `from_dict` passes every key on, what
  `to_dict` writes and the conditions under which `__init__` raises;
- tensorrt_llm/quantization/layers.py: the parameters (name, shape, dtype, condition) that the weight-only linears
  register, and the multiple they pad their sizes to;
- tensorrt_llm/models/convert_utils.py: `weight_only_quantize_dict` (which weights the loader quantizes itself).

A shape, condition or size that is not a literal is stored as a formula (`formula`): a JSON tree of the names,
literals and operations it is made of. None of the copies read is at a release's own commit (`pinned` false); two
were read from a copy with no known commit (`commit` null).
"""

from __future__ import annotations

import ast
from collections import defaultdict

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, dotted_name, find_def

MODELING_UTILS = "tensorrt_llm/models/modeling_utils.py"
MAPPING = "tensorrt_llm/mapping.py"
LAYERS = "tensorrt_llm/quantization/layers.py"
CONVERT_UTILS = "tensorrt_llm/models/convert_utils.py"
# The commits read per file (None: a copy whose commit is not known).
COMMITS = {
    MODELING_UTILS: (
        "01ea6d79d454bb3ab10c7510a6f706ba039090c2",
        "27712aa7720aa3e6a594ad3cc678625490cb479d",
        None,
    ),
    MAPPING: ("05ebebb2c1d34320db9019f2b7ace6009a67e997", "b35ac1b64368513d215c57d2ed01d62d910df8da"),
    LAYERS: (None,),
    CONVERT_UTILS: ("03961722f65265573cad179baca3bc5fe8c03f76",),
}
WEIGHT_ONLY_CLASSES = (
    "WeightOnlyQuantLinear",
    "WeightOnlyQuantRowLinear",
    "WeightOnlyGroupwiseQuantLinear",
    "WeightOnlyGroupwiseQuantRowLinear",
)


# ---------------------------------------------------------------- formulas

OPERATORS = {
    ast.Mult: "multiply",
    ast.FloorDiv: "floor_divide",
    ast.Div: "divide",
    ast.Add: "add",
    ast.Sub: "subtract",
    ast.Eq: "equal",
    ast.NotEq: "not_equal",
    ast.Lt: "less",
    ast.LtE: "at_most",
    ast.Gt: "greater",
    ast.GtE: "at_least",
    ast.In: "in",
    ast.NotIn: "not_in",
    ast.Is: "is",
    ast.IsNot: "is_not",
    ast.And: "all",
    ast.Or: "any",
}


def formula(node: ast.expr):
    """A shape, size or condition as data: a literal as itself, a name as {"name": ...}, a tuple as a list, and each
    operation as {operation: operands} (e.g. {"multiply": [{"name": "tp_size"}, 64]}, {"not": ...},
    {"call": "f", "args": [...]})."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)) and dotted_name(node):
        return {"name": dotted_name(node)}
    if isinstance(node, ast.Attribute):
        return {"attribute": node.attr, "of": formula(node.value)}
    if isinstance(node, (ast.Tuple, ast.List)):
        return [formula(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return {OPERATORS[type(node.op)]: [formula(node.left), formula(node.right)]}
    if isinstance(node, ast.BoolOp):
        return {OPERATORS[type(node.op)]: [formula(value) for value in node.values]}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return {"not": formula(node.operand)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in OPERATORS:
        return {OPERATORS[type(node.ops[0])]: [formula(node.left), formula(node.comparators[0])]}
    if isinstance(node, ast.IfExp):
        return {"if": formula(node.test), "then": formula(node.body), "else": formula(node.orelse)}
    if isinstance(node, ast.Subscript):
        return {"item": formula(node.slice), "of": formula(node.value)}
    if isinstance(node, ast.Call):
        function = dotted_name(node.func)
        called = {"call": function} if function else {"call_method": node.func.attr, "of": formula(node.func.value)}
        if node.args:
            called["args"] = [formula(argument) for argument in node.args]
        if node.keywords:
            called["keywords"] = {k.arg: formula(k.value) for k in node.keywords}
        return called
    if isinstance(node, ast.ListComp) and len(node.generators) == 1 and not node.generators[0].ifs:
        loop = node.generators[0]
        return {"each": formula(node.elt), "for": formula(loop.target), "in": formula(loop.iter)}
    raise UnrecognizedSource(f"no formula for a {type(node).__name__}")


def conjunction(conditions: list):
    """One condition from the formulas of several that all hold; None for none."""
    if not conditions:
        return None
    return conditions[0] if len(conditions) == 1 else {"all": conditions}


def literal(node: ast.expr | None):
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError as error:
        raise UnrecognizedSource("a default that is not a literal") from error


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    return find_def(cls.body, name) if cls is not None else None


def passes_every_key(function: ast.FunctionDef | None) -> bool:
    """Whether `function` passes a dict on as **kwargs (so a key the callee lacks raises)."""
    return function is not None and any(
        isinstance(n, ast.Call) and any(k.arg is None for k in n.keywords) for n in ast.walk(function)
    )


# ---------------------------------------------------------------- modeling_utils.py


def quant_config(statements: list[ast.stmt]) -> dict | None:
    """QuantConfig's dataclass fields and how from_dict builds it; None when the file has no QuantConfig."""
    cls = find_def(statements, "QuantConfig")
    if cls is None:
        return None
    fields = [
        {"name": f.target.id, "type": ast.unparse(f.annotation), "default": literal(f.value)}
        for f in cls.body
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
    ]
    return {
        "dataclass": any(dotted_name(d) in ("dataclass", "dataclasses.dataclass") for d in cls.decorator_list),
        "fields": fields,
        "from_dict_passes_every_key": passes_every_key(method(cls, "from_dict")),
    }


def pretrained_config(statements: list[ast.stmt]) -> dict | None:
    """How PretrainedConfig turns the checkpoint's `mapping` and `quantization` dicts into objects."""
    cls = find_def(statements, "PretrainedConfig")
    if cls is None:
        return None
    out = {"from_dict_passes_every_key": passes_every_key(method(cls, "from_dict"))}
    for key in ("mapping", "quantization"):  # the dicts' parameter names in __init__ / from_dict
        built_by = sorted(
            {
                dotted_name(n.func)
                for n in ast.walk(cls)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "from_dict"
                and [dotted_name(a) for a in n.args] == [key]
            }
        )
        picked = sorted(
            {
                n.args[0].value
                for n in ast.walk(cls)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get"
                and dotted_name(n.func.value) == key
                and n.args
                and isinstance(n.args[0], ast.Constant)
            }
        )
        out[key] = {"built_by": built_by, "keys_picked_with_get": picked}
    return out


def outcome(body: list[ast.stmt]) -> dict | None:
    """What a branch does: {"raises": "<exception>"} or {"calls": "<function>"} (its first statement)."""
    raises = [n for n in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(n, ast.Raise)]
    if raises and isinstance(raises[0].exc, ast.Call):
        return {"raises": dotted_name(raises[0].exc.func)}
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call):
        return {"calls": dotted_name(first.value.func)}
    return None


def load_rules(statements: list[ast.stmt]) -> list[dict] | None:
    """What PretrainedModel.load does when the checkpoint lacks or adds tensors: [{"when": formula, ...outcome}]."""
    load = method(find_def(statements, "PretrainedModel"), "load")
    if load is None:
        return None
    rules = []
    for node in ast.walk(load):
        if isinstance(node, ast.If) and "provided_names" in {
            n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)
        }:
            then = outcome(node.body)
            if then is not None:
                rules.append({"when": formula(node.test)} | then)
    return rules


def w8a16_preprocessing(statements: list[ast.stmt]) -> dict | None:
    """The branch of preprocess_perlayer_weights that handles W8A16, and the weight_only_quantize_dict call in it."""
    function = find_def(statements, "preprocess_perlayer_weights")
    if function is None:
        return None
    for node in ast.walk(function):
        if isinstance(node, ast.If) and "QuantAlgo.W8A16" in {dotted_name(n) for n in ast.walk(node.test)}:
            calls = [
                formula(n)
                for n in ast.walk(ast.Module(body=node.body, type_ignores=[]))
                if isinstance(n, ast.Call) and dotted_name(n.func) == "weight_only_quantize_dict"
            ]
            return {"condition": formula(node.test), "calls": calls}
    return {"condition": None, "calls": []}


# ---------------------------------------------------------------- convert_utils.py


def weight_only_quantize_dict(statements: list[ast.stmt]) -> dict | None:
    """Which weights the loader quantizes itself for W8A16/W4A16, and what it writes in their place."""
    function = find_def(statements, "weight_only_quantize_dict")
    helper = find_def(statements, "weight_only_quantize")
    if function is None:
        return None
    arguments = function.args
    defaults = dict(zip([a.arg for a in arguments.args][-len(arguments.defaults) :], arguments.defaults))
    conditions = [
        formula(n.test)
        for n in ast.walk(function)
        if isinstance(n, ast.If) and any(isinstance(s, ast.Attribute) and s.attr == "dtype" for s in ast.walk(n.test))
    ]
    writes = [
        formula(t)
        for n in ast.walk(function)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and dotted_name(t.value) == "weights"
    ]
    ops = sorted(
        {
            dotted_name(n.func)
            for n in ast.walk(helper or function)
            if isinstance(n, ast.Call) and (dotted_name(n.func) or "").startswith("torch.ops.")
        }
    )
    return {
        "quant_weights_default": literal(defaults.get("quant_weights")),
        "quantizes_when": conditions,
        "writes": writes,
        "quantizer_ops": ops,
    }


# ---------------------------------------------------------------- mapping.py


def mapping_rules(statements: list[ast.stmt]) -> dict | None:
    """Mapping.__init__'s parameter names, how from_dict calls it, what to_dict writes, and when __init__ raises."""
    classes = {s.name: s for s in statements if isinstance(s, ast.ClassDef)}
    cls = classes.get("Mapping")
    if cls is None:
        return None
    lineage = [cls] + [classes[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]

    def inherited(name):
        return next((m for m in (method(c, name) for c in lineage) if m is not None), None)

    arguments = inherited("__init__").args
    params = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs if a.arg != "self"]
    # __init__ may only forward to the base class; its conditions live where the work is done
    raises_if = [
        formula(n.test)
        for m in (method(c, "__init__") for c in lineage)
        if m is not None
        for n in ast.walk(m)
        if isinstance(n, ast.If) and any(isinstance(b, ast.Raise) for b in n.body)
    ]
    written = []
    to_dict = inherited("to_dict")
    if to_dict is not None:
        for n in ast.walk(to_dict):
            if isinstance(n, ast.Dict):
                written = [k.value for k in n.keys if isinstance(k, ast.Constant)]
    return {
        "class_lineage": [c.name for c in lineage],
        "init_params": params,
        "from_dict_passes_every_key": passes_every_key(inherited("from_dict")),
        "to_dict_keys": written,
        "init_raises_if": [c for i, c in enumerate(raises_if) if c not in raises_if[:i]],
    }


# ---------------------------------------------------------------- layers.py


def walk_with_conditions(body: list[ast.stmt], conditions: list):
    """(statement, formulas of its enclosing if-conditions) for every statement in `body`, recursively."""
    for node in body:
        yield node, conditions
        if isinstance(node, ast.If):
            yield from walk_with_conditions(node.body, [*conditions, formula(node.test)])
            yield from walk_with_conditions(node.orelse, [*conditions, {"not": formula(node.test)}])


def weight_only_layers(statements: list[ast.stmt]) -> dict:
    """For each weight-only linear: its registered parameters and the multiple it pads its sizes to."""
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
        statements_in_init = list(walk_with_conditions(init.body, []))
        local = defaultdict(list)  # local names a shape or dtype may use, e.g. scale_shape, pack_ratio
        for node, conditions in statements_in_init:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                condition = conjunction(conditions)
                local[node.targets[0].id].append(
                    {"value": formula(node.value)} | ({"if": condition} if condition is not None else {})
                )
        params, multiple = {}, None
        for node, conditions in statements_in_init:
            if not isinstance(node, ast.Assign):
                continue
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "multiple":
                multiple = formula(node.value)
            if isinstance(node.value, ast.Call) and dotted_name(node.value.func) == "Parameter":
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
                params[target.attr] = {
                    "shape": formula(keywords["shape"]) if "shape" in keywords else None,
                    "dtype": formula(keywords["dtype"]) if "dtype" in keywords else None,
                    "only_if": conjunction(conditions),
                    "where": {n: local[n] for n in used},
                }
        padded = [
            n.targets[0].id
            for n, _ in statements_in_init
            if isinstance(n, ast.Assign)
            and isinstance(n.targets[0], ast.Name)
            and any(isinstance(c, ast.Call) and dotted_name(c.func) == "math.ceil" for c in ast.walk(n.value))
        ]
        out[name] = {
            "parameters": params,
            "padding": {"multiple": multiple, "padded": padded} if multiple is not None else None,
            "aliases": sorted(a for a, target in aliases.items() if target == name),
            "base": [dotted_name(b) for b in find_def(statements, name).bases],
        }
    return out


# ---------------------------------------------------------------- the table


def versions(upstream: Upstream, path: str, reader) -> list[tuple[dict, object]]:
    """(citation, what `reader` finds) for every commit of `path` read."""
    return [
        (cite(REPO, path, commit, pinned=False), reader(complete_statements(upstream.read(REPO, path, commit))))
        for commit in COMMITS[path]
    ]


def tabulate(upstream: Upstream) -> dict:
    quant = versions(upstream, MODELING_UTILS, quant_config)
    pretrained = versions(upstream, MODELING_UTILS, pretrained_config)
    load = versions(upstream, MODELING_UTILS, load_rules)
    preprocess = versions(upstream, MODELING_UTILS, w8a16_preprocessing)
    mappings = versions(upstream, MAPPING, mapping_rules)
    ((layers_source, layers),) = versions(upstream, LAYERS, weight_only_layers)
    quantizers = versions(upstream, CONVERT_UTILS, weight_only_quantize_dict)

    with_quant_config = [q for _, q in quant if q]
    field_sets = [{f["name"] for f in q["fields"]} for q in with_quant_config]
    param_sets = [set(m["init_params"]) for _, m in mappings if m]
    return {
        "quant_config": {
            "versions": [{"source": source} | q for source, q in quant if q],
            "not_defined_in": [source for source, q in quant if not q],
            "accepted_in_every_version": [
                f["name"] for f in with_quant_config[0]["fields"] if all(f["name"] in s for s in field_sets)
            ],
        },
        "pretrained_config": {"versions": [{"source": source} | p for source, p in pretrained if p]},
        "load": {"versions": [{"source": source, "on": rules} for source, rules in load if rules]},
        "mapping": {
            "versions": [{"source": source} | m for source, m in mappings if m],
            "accepted_in_every_version": sorted(set.intersection(*param_sets)),
            "accepted_in_some_version_only": sorted(set.union(*param_sets) - set.intersection(*param_sets)),
        },
        "weight_only_layers": {"source": layers_source, "classes": layers},
        "w8a16_loader": {
            "preprocess_perlayer_weights": {"versions": [{"source": source} | p for source, p in preprocess if p]},
            "weight_only_quantize_dict": {"versions": [{"source": source} | q for source, q in quantizers if q]},
        },
    }
