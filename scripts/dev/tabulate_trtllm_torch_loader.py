"""Tabulate what TensorRT-LLM's PyTorch backend requires of a ModelOpt unified HF checkpoint, from its own source
(upstream/trtllm_torch_loader.json).

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast` (never runs) whole files:
- tensorrt_llm/_torch/model_config.py: which file `from_pretrained` takes the quantization config from
  (hf_quant_config.json before config.json's `quantization_config`), and which keys `load_modelopt_quant_config`
  reads by subscript (required: KeyError when absent) or `.get` (optional);
- tensorrt_llm/quantization/mode.py: `QuantMode.from_quant_algo` (quant_algo -> the QuantMode flags its
  constructor sets) and the QuantMode predicates that `get_quant_method` tests, evaluated on those flags;
- tensorrt_llm/_torch/modules/linear.py: `get_quant_method` (which LinearMethod each quant_algo gets, or the error
  it raises) and, per LinearMethod chosen, the tensors its loaders read next to `weight`: required when subscripted
  outside an `if "name" in w` guard, or when a value collected under such a guard is then used unguarded (`x[0]`,
  `x.float()`, `assert len(x) == 1`); optional otherwise. Also the dtypes the loaders assert and the dtypes of the
  parameters create_weights registers.

No copy read is at a release's own commit, and none has a known commit (`commit` null): each release names the
commit to read to pin it (`release_commit`).
"""

from __future__ import annotations

import ast
import json

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, find_def, stored_releases

MODEL_CONFIG = "tensorrt_llm/_torch/model_config.py"
LINEAR = "tensorrt_llm/_torch/modules/linear.py"
MODE = "tensorrt_llm/quantization/mode.py"
# The quant_algo values this pipeline's trtllm target declares (pipeline/targets/trtllm/checkpoint.py EXPECTED_ALGO).
OUR_ALGOS = ("FP8", "W8A16", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "W4A8_AWQ")
KV_CACHE_SCALES = ("k_scale", "v_scale", "kv_scale")
READ_FOR = {
    MODEL_CONFIG: ["from_pretrained", "load_modelopt_quant_config"],
    MODE: ["QuantMode"],
    LINEAR: ["get_quant_method", "linear methods"],
}
UNKNOWN = {MODEL_CONFIG: None, MODE: None, LINEAR: None}
# Per release: the commit each file is read at (None: a copy whose commit is not known), the release's own commit.
RELEASES = {
    "1.0": {
        "files": UNKNOWN,
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "note": "No copy at a release commit was readable: the oldest copies read that have the ModelOpt loader "
        "(model_config.py before the DeepSeek-V3.2 sparse-attention hook, linear.py before nvfp4_allowed_backends), "
        "attributed to 1.0 by content order. Medium confidence.",
    },
    "1.1": {
        "files": UNKNOWN,
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "note": "The 1.0 facts: the model_config.py copy read for 1.1 (with the DeepSeek-V3.2 hook) chooses and reads "
        "hf_quant_config.json exactly as 1.0's, and linear.py is 1.0's copy. Low confidence that these are the "
        "1.1.0 files.",
    },
    "1.2": {
        "files": UNKNOWN,
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "note": "linear.py: the newest copy read (with nvfp4_allowed_backends) for get_quant_method and the "
        "weight-only and AWQ methods; FP8QDQLinearMethod from the 1.0 copy. model_config.py: a later copy, seen "
        "only in part, reads the quantization section the same way; the 1.0 copy's facts are used. Low confidence "
        "for the exact 1.2 files.",
    },
}
MODE_FLAGS = {  # from_description's parameters -> the QuantMode flag each sets
    "quantize_weights": "INT8_WEIGHTS",
    "quantize_activations": "ACTIVATIONS",
    "per_token": "PER_TOKEN",
    "per_channel": "PER_CHANNEL",
    "per_group": "PER_GROUP",
    "use_fp8_qdq": "FP8_QDQ",
}
# A QuantMode mask attribute -> the flags it combines
MASKS = {"WEIGHTS_AND_ACTIVATIONS": {"INT4_WEIGHTS", "INT8_WEIGHTS", "ACTIVATIONS"}}
EXCLUDE_MODULES_MATCHING = (
    "fnmatch patterns against the PyTorch module names, which are the HF names (model.layers.N.self_attn.q_proj, "
    "lm_head) as ModelOpt writes them; the matching code was not tabulated"
)


def function(source: str, name: str) -> ast.FunctionDef:
    """The first def called `name` anywhere in `source` (a method or a module function)."""
    found = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if found is None:
        raise UnrecognizedSource(f"no def {name}")
    return found


def dotted(node: ast.expr) -> str:
    return ast.unparse(node)


# ---------------------------------------------------------------- model_config.py


def quant_config_keys(source: str) -> dict:
    """Keys load_modelopt_quant_config reads from hf_quant_config.json: the top-level section subscripted out of
    the json.load result, then the keys read from that section by subscript (required) or .get (optional)."""
    body = function(source, "load_modelopt_quant_config")
    loaded = {
        target.id
        for node in ast.walk(body)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and dotted(node.value.func) == "json.load"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    section, top = None, []
    for node in body.body:  # the function's own statements: a nested branch may read another file's sections
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Subscript)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in loaded
        ):
            section, top = node.targets[0].id, top + [node.value.slice.value]
    if section is None:
        raise UnrecognizedSource("load_modelopt_quant_config: no section subscripted out of the loaded JSON")
    required, optional = [], []
    for node in ast.walk(body):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == section:
            required.append(node.slice.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and dotted(node.func.value) == section
        ):
            default = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
            optional.append({"default": default, "key": node.args[0].value})
    return {
        "function": body.name,
        "optional_in_section": optional,
        "required_in_section": sorted(set(required)),
        "required_top_level": top,
    }


def source_condition(test: ast.expr) -> dict:
    """A from_pretrained branch's test as data: a checkpoint file that exists, or an attribute the config has."""
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            return {"file_exists": node.right.value}  # (model_dir / "name.json").exists()
    if isinstance(test, ast.Call) and dotted(test.func) == "hasattr":
        return {"config_has": test.args[1].value}
    raise UnrecognizedSource(f"from_pretrained: a quantization-config branch tested on a {type(test).__name__}")


def config_sources(source: str) -> list[dict]:
    """The if/elif chain of from_pretrained choosing where the quantization config comes from, in order: the
    reader each branch calls and when."""
    body = function(source, "from_pretrained")
    chain = next(
        (n for n in ast.walk(body) if isinstance(n, ast.If) and "hf_quant_config.json" in dotted(n.test)),
        None,
    )
    if chain is None:
        raise UnrecognizedSource("from_pretrained: no branch on hf_quant_config.json")
    out = []
    while chain is not None:
        called = next(c.func for c in ast.walk(chain.body[-1]) if isinstance(c, ast.Call))
        reader = called.attr if isinstance(called, ast.Attribute) else dotted(called)
        out.append({"reader": reader, "when": source_condition(chain.test)})
        chain = chain.orelse[0] if len(chain.orelse) == 1 and isinstance(chain.orelse[0], ast.If) else None
    return out


# ---------------------------------------------------------------- mode.py


def quant_mode_class(source: str) -> ast.ClassDef:
    found = find_def(ast.parse(source).body, "QuantMode")
    if not isinstance(found, ast.ClassDef):
        raise UnrecognizedSource("no class QuantMode")
    return found


def algo_modes(source: str) -> dict[str, set[str]]:
    """quant_algo (of OUR_ALGOS) -> the QuantMode flags from_quant_algo's constructor for it sets."""
    quant_mode = quant_mode_class(source)
    methods = {f.name: f for f in quant_mode.body if isinstance(f, ast.FunctionDef)}
    positional = [a.arg for a in methods["from_description"].args.args]

    def flags_of(call: ast.Call) -> set[str]:
        name = call.func.attr
        if name == "from_description":
            values = dict(zip(positional, [ast.literal_eval(a) for a in call.args]))
            values |= {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            int4 = values.pop("use_int4_weights", False)
            flags = {MODE_FLAGS[k] for k, v in values.items() if v and k in MODE_FLAGS}
            return flags - {"INT8_WEIGHTS"} | {"INT4_WEIGHTS"} if int4 and "INT8_WEIGHTS" in flags else flags
        constructor = methods[name]  # use_weight_only(...) and the like: from_description with bound parameters
        inner = next(
            n for n in ast.walk(constructor) if isinstance(n, ast.Call) and dotted(n.func).endswith("from_description")
        )
        parameters = [a.arg for a in constructor.args.args]
        defaults = dict(zip(parameters[len(parameters) - len(constructor.args.defaults) :], constructor.args.defaults))
        bound = {k: ast.literal_eval(v) for k, v in defaults.items()}
        bound |= {k.arg: ast.literal_eval(k.value) for k in call.keywords}

        def resolve(node: ast.expr) -> ast.expr:
            return ast.Constant(bound.get(node.id)) if isinstance(node, ast.Name) else node

        resolved = ast.Call(
            func=ast.Attribute(value=ast.Name("QuantMode"), attr="from_description"),
            args=[resolve(a) for a in inner.args],
            keywords=[ast.keyword(k.arg, resolve(k.value)) for k in inner.keywords],
        )
        return flags_of(resolved)

    out = {}
    for node in ast.walk(methods["from_quant_algo"]):
        if isinstance(node, ast.If) and dotted(node.test).startswith("quant_algo == QuantAlgo."):
            algo = node.test.comparators[0].attr
            if algo in OUR_ALGOS:
                out[algo] = flags_of(node.body[0].value)
    return out


def predicates(source: str) -> dict[str, ast.FunctionDef]:
    """QuantMode's methods, by name: the predicates get_quant_method's conditions call."""
    return {f.name: f for f in quant_mode_class(source).body if isinstance(f, ast.FunctionDef)}


def holds(expr: ast.expr, flags: set[str], algo: str, checks: dict[str, ast.FunctionDef]) -> bool:
    """Whether a get_quant_method condition holds for a quant_config of `algo` whose layer_quant_mode has `flags`."""
    if isinstance(expr, ast.BoolOp):
        values = [holds(v, flags, algo, checks) for v in expr.values]
        return all(values) if isinstance(expr.op, ast.And) else any(values)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return not holds(expr.operand, flags, algo, checks)
    if isinstance(expr, ast.Compare) and dotted(expr.left).endswith("quant_algo"):
        return dotted(expr.comparators[0]).split(".")[-1] == algo
    if isinstance(expr, ast.Compare) and dotted(expr.left) == "quant_config":  # `quant_config is None`
        return False
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        name = expr.func.attr
        if name == "_all":
            bits = flag_set(expr.args[0])
            mask = flag_set(expr.args[1]) if len(expr.args) > 1 else None
            return (flags & mask if mask is not None else flags) == bits
        if name == "_any":
            return bool(flags & flag_set(expr.args[0]))
        if name == "has_any_quant":  # every weight or activation flag (kv-cache flags excluded)
            return bool(flags - {"PER_CHANNEL", "PER_TOKEN", "PER_GROUP"})
        if name in checks:
            returned = next(n for n in ast.walk(checks[name]) if isinstance(n, ast.Return))
            return holds(returned.value, flags, algo, checks)
        return False  # a predicate of a format this pipeline does not produce (NVFP4, MXFP4, FP8 rowwise/block)
    raise UnrecognizedSource(f"a get_quant_method condition on a {type(expr).__name__}")


def flag_set(node: ast.expr) -> set[str]:
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return set().union(*(MASKS.get(n, {n}) for n in names))


def condition(expr: ast.expr):
    """A get_quant_method condition as data: {"predicate": QuantMode method}, {"quant_algo": name}, {"not": ...},
    {"all": [...]} / {"any": [...]}."""
    if isinstance(expr, ast.BoolOp):
        return {"all" if isinstance(expr.op, ast.And) else "any": [condition(v) for v in expr.values]}
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return {"not": condition(expr.operand)}
    if isinstance(expr, ast.Compare) and dotted(expr.left).endswith("quant_algo"):
        return {"quant_algo": dotted(expr.comparators[0]).split(".")[-1]}
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        return {"predicate": expr.func.attr}
    raise UnrecognizedSource(f"a get_quant_method condition on a {type(expr).__name__}")


def quant_methods(linear: str, modes: dict[str, set[str]], checks: dict[str, ast.FunctionDef]) -> dict:
    """Per quant_algo of ours: the LinearMethod get_quant_method returns for its flags (and the condition that
    picks it), or the error it raises when no branch matches."""
    body = function(linear, "get_quant_method")
    branches = [
        (s.test, s.body[0].value.func)
        for s in body.body
        if isinstance(s, ast.If) and isinstance(s.body[0], ast.Return) and isinstance(s.body[0].value, ast.Call)
    ]
    raised = next(s.exc for s in body.body if isinstance(s, ast.Raise))
    error = raised.func.id if isinstance(raised, ast.Call) else dotted(raised)
    out = {}
    for algo in OUR_ALGOS:
        flags = modes.get(algo)
        if flags is None:
            out[algo] = {"method": None, "why": f"QuantMode.from_quant_algo has no branch for {algo}"}
            continue
        hit = next(((test, method) for test, method in branches if holds(test, flags, algo, checks)), None)
        out[algo] = (
            {"condition": condition(hit[0]), "method": dotted(hit[1]), "quant_mode_flags": sorted(flags)}
            if hit
            else {"method": None, "quant_mode_flags": sorted(flags), "raises": error, "when": "no_branch_matches"}
        )
    return out


# ---------------------------------------------------------------- linear.py LinearMethods


def _statements(body, conditions):
    for node in body:
        if isinstance(node, ast.If):
            yield from _statements(node.body, conditions + [node.test])
            yield from _statements(node.orelse, conditions + [ast.UnaryOp(ast.Not(), node.test)])
        elif isinstance(node, (ast.For, ast.While, ast.With)):
            yield from _statements(node.body, conditions)
        else:
            yield node, conditions


def _guards(conditions) -> set[str]:
    """Tensor names an `if "name" in w` (or `in weights[0].keys()`) condition tests."""
    return {
        n.left.value
        for c in conditions
        for n in ast.walk(c)
        if isinstance(n, ast.Compare)
        and isinstance(n.ops[0], ast.In)
        and isinstance(n.left, ast.Constant)
        and isinstance(n.left.value, str)
    }


def _tensor_subscripts(node) -> list[str]:
    return [
        n.slice.value
        for n in ast.walk(node)
        if isinstance(n, ast.Subscript)
        and isinstance(n.slice, ast.Constant)
        and isinstance(n.slice.value, str)
        and (dotted(n.value) == "w" or dotted(n.value).startswith("weights["))
    ]


def dtype_name(node: ast.expr | None) -> str | None:
    """`torch.int8` -> "int8"; the layer's own dtype (`dtype`, `module.dtype`) -> "module_dtype"."""
    if node is None:
        return None
    if isinstance(node, ast.Attribute) and dotted(node.value) == "torch":
        return node.attr
    if dotted(node) in ("dtype", "module.dtype"):
        return "module_dtype"
    raise UnrecognizedSource(f"a dtype given as a {type(node).__name__}")


def method_tensors(cls: ast.ClassDef) -> dict:
    """Tensors the class's loaders read next to `weight`, required or optional (the function reading each and how),
    the dtypes they assert and the dtypes of the parameters create_weights registers."""
    required, optional, guarded_vars, asserted, parameters = {}, {}, {}, {}, {}
    functions = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    for body in functions:
        for statement, conditions in _statements(body.body, []):
            guards = _guards(conditions)
            if len(guards) == 1:  # what a statement under `if "name" in w` assigns or appends to holds that tensor
                (name,) = guards
                for target in getattr(statement, "targets", []):
                    if isinstance(target, ast.Name):
                        guarded_vars[target.id] = name
                call = statement.value if isinstance(statement, ast.Expr) else None
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "append":
                    guarded_vars[dotted(call.func.value)] = name
            for name in _tensor_subscripts(statement):
                if name in guards:
                    optional.setdefault(name, {"function": body.name, "read": "guarded"})
                else:
                    required[name] = {"function": body.name, "read": "unguarded"}
            test = statement.test if isinstance(statement, ast.Assert) else None
            if (
                isinstance(test, ast.Compare)
                and isinstance(test.left, ast.Attribute)
                and test.left.attr == "dtype"
                and isinstance(test.ops[0], ast.Eq)
            ):
                asserted[dotted(test.left.value)] = dtype_name(test.comparators[0])
            if (
                body.name == "create_weights"
                and isinstance(statement, ast.Assign)
                and isinstance(statement.targets[0], ast.Attribute)
                and dotted(statement.targets[0].value) == "module"
                and "Parameter(torch.empty" in dotted(statement.value)
            ):
                dtype = next(
                    (k.value for k in ast.walk(statement.value) if isinstance(k, ast.keyword) and k.arg == "dtype"),
                    None,
                )
                parameters[statement.targets[0].attr] = dtype_name(dtype)
    # a value collected under a guard and then used without one makes its tensor required
    for body in functions:
        for statement, conditions in _statements(body.body, []):
            mentioned = {n.id for c in conditions for n in ast.walk(c) if isinstance(n, ast.Name)}
            guards = _guards(conditions)
            for var, name in guarded_vars.items():
                if var in mentioned or name in guards:
                    continue
                for n in ast.walk(statement):
                    used = (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == var) or (
                        isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name)
                        and n.value.id == var
                        and n.attr != "append"
                    )
                    counted = isinstance(statement, ast.Assert) and any(
                        isinstance(c, ast.Call) and dotted(c) == f"len({var})" for c in ast.walk(statement.test)
                    )
                    if used or counted:
                        required.setdefault(name, {"function": body.name, "read": "guarded_then_used"})
                        break
    optional = {k: v for k, v in optional.items() if k not in required}
    return {
        "asserted_dtypes": asserted,
        "optional": dict(sorted(optional.items())),
        "parameter_dtypes": parameters,
        "required": dict(sorted(required.items())),
    }


def linear_methods(linear: str, names: set[str]) -> dict:
    """The tensors each of the LinearMethod classes `names` reads (module-level classes of linear.py)."""
    classes = {n.name: n for n in ast.parse(linear).body if isinstance(n, ast.ClassDef) and n.name in names}
    if missing := names - set(classes):
        raise UnrecognizedSource(f"linear.py has no class {sorted(missing)}")
    return {name: method_tensors(cls) for name, cls in classes.items()}


# ---------------------------------------------------------------- the table


def release_facts(model_config: str, mode: str, linear: str) -> dict:
    """One release's facts from its model_config.py, mode.py and linear.py."""
    by_algo = quant_methods(linear, algo_modes(mode), predicates(mode))
    methods = linear_methods(linear, {row["method"] for row in by_algo.values() if row["method"]})
    for row in by_algo.values():
        if row["method"] in methods:
            row["tensors"] = methods[row["method"]]
    keys = quant_config_keys(model_config)
    return {
        "exclude_modules": {
            "matching": EXCLUDE_MODULES_MATCHING,
            "read": any(o["key"] == "exclude_modules" for o in keys["optional_in_section"]),
        },
        "hf_quant_config": keys,
        "kv_cache_scales": {
            name: read | {"method": method}
            for method, tensors in sorted(methods.items())
            for name, read in tensors["optional"].items()
            if name in KV_CACHE_SCALES
        },
        "quant_algos": dict(sorted(by_algo.items())),
        "quant_config_source": config_sources(model_config),
    }


def tabulate(upstream: Upstream) -> dict:
    releases = {}
    for release, spec in RELEASES.items():
        text = {path: upstream.read(REPO, path, commit) for path, commit in spec["files"].items()}
        files = [
            cite(REPO, path, commit, pinned=False) | {"read_for": READ_FOR[path]}
            for path, commit in spec["files"].items()
        ]
        block = release_facts(text[MODEL_CONFIG], text[MODE], text[LINEAR])
        block |= {
            "release_commit": spec["release_commit"],
            "source": {"files": files, "note": spec["note"]},
        }
        releases[release] = json.loads(json.dumps(block, sort_keys=True))
    return {"releases": stored_releases(releases)}
