"""Tabulate what TensorRT-LLM's PyTorch backend reads from a ModelOpt unified HF checkpoint, from its own source.

Maintainer tool, not run by the pipeline. Reads with `ast` (never runs) verbatim excerpts of:
- tensorrt_llm/_torch/model_config.py: which file `from_pretrained` takes the quantization config from
  (hf_quant_config.json before config.json's `quantization_config`), and which keys
  `load_modelopt_quant_config` reads by subscript (required: KeyError when absent) or `.get` (optional);
- tensorrt_llm/quantization/mode.py: `QuantMode.from_quant_algo` (quant_algo -> QuantMode constructor) and the
  predicates `get_quant_method` tests, evaluated on the flags the constructors set;
- tensorrt_llm/_torch/modules/linear.py: `get_quant_method` (which LinearMethod each quant_algo gets, or the
  `unsupported quant mode` ValueError) and, per LinearMethod, the tensors its loaders read next to `weight`:
  required when subscripted outside an `if "name" in w` guard, or when a value collected under such a guard is
  then used unguarded (`x[0]`, `x.float()`, `assert len(x) == 1`); optional otherwise. Also the dtypes the
  loaders assert and the dtypes of the parameters create_weights registers.

The excerpts are committed under tests/fixtures/upstream/ (each headed with its repository, path, index id) and
cached under /work/upstream-cache/NVIDIA+TensorRT-LLM/index-id-<id>/<path>.excerpt-<name>. Usage:
    python scripts/dev/tabulate_trtllm_torch_loader.py tests/fixtures/upstream pipeline/trtllm_torch_loader.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

REPO = "NVIDIA/TensorRT-LLM"
MODEL_CONFIG = "tensorrt_llm/_torch/model_config.py"
LINEAR = "tensorrt_llm/_torch/modules/linear.py"
MODE = "tensorrt_llm/quantization/mode.py"
# The quant_algo values this pipeline's trtllm target declares (pipeline/trtllm_checkpoint.py EXPECTED_ALGO).
OUR_ALGOS = ("FP8", "W8A16", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "W4A8_AWQ")
SAME_AS_10 = "the same excerpt texts as 1.0 where a file is shared"

# Which stored version stands for which release. The index does not store release commits (v1.0.0 is
# ae8270b713446948246f16fadf4e2a32e35d0f62, the tensorrtllm_backend v1.0.0 submodule pointer: "stored, but not at
# that commit"), so each release takes the stored version whose line of development is closest, ordered by
# content: model_config.py 2419649560 (no DeepSeek-V3.2 DSA) < 224781002 (DSA in from_pretrained, same
# load_modelopt_quant_config text) < 4218302881 (checkpoint_dir signature) < 54702305068 / 008e0af (DeepSeek-V4,
# after 1.2; not used); linear.py 421325918 < 3478255898 (nvfp4_allowed_backends).
RELEASES = {
    "1.0": {
        "files": {
            "model_config": [
                "model_config_2419649560_modelopt.py.txt",
                "model_config_2419649560_from_pretrained.py.txt",
            ],
            "mode": ["mode_472971060_from_quant_algo.py.txt", "mode_472971060_predicates.py.txt"],
            "get_quant_method": ["linear_421325918_get_quant_method.py.txt"],
            "methods": [
                "linear_421325918_fp8qdq.py.txt",
                "linear_421325918_weight_only_awq.py.txt",
                "linear_421325918_w4a8_awq.py.txt",
            ],
        },
        "note": "Oldest stored versions with a ModelOpt loader: model_config.py index id 2419649560 (from_pretrained "
        "without the DeepSeek-V3.2 sparse-attention hook added after 1.0), linear.py 421325918 (before "
        "nvfp4_allowed_backends). Not the v1.0.0 commit (ae8270b7, not stored); attribution by content order, "
        "medium confidence.",
    },
    "1.1": {
        "files": None,  # as 1.0: 224781002's load_modelopt_quant_config / from_pretrained choice read identical
        "note": "model_config.py index id 224781002 (read whole: DeepSeek-V3.2 hook present, so after 1.0; its "
        "load_modelopt_quant_config and hf_quant_config.json choice are character for character those of "
        "2419649560), linear.py 421325918. Low confidence that these are the 1.1.0 texts; " + SAME_AS_10 + ".",
    },
    "1.2": {
        "files": {
            "model_config": [
                "model_config_2419649560_modelopt.py.txt",
                "model_config_2419649560_from_pretrained.py.txt",
            ],
            "mode": ["mode_472971060_from_quant_algo.py.txt", "mode_472971060_predicates.py.txt"],
            "get_quant_method": ["linear_3478255898_get_quant_method.py.txt"],
            "methods": [
                "linear_421325918_fp8qdq.py.txt",
                "linear_3478255898_weight_only_awq.py.txt",
                "linear_3478255898_w4a8_awq.py.txt",
            ],
        },
        "note": "linear.py index id 3478255898 (newest stored; has nvfp4_allowed_backends): get_quant_method, "
        "WeightOnlyQuantLinearMethod, W4A16_AWQ and W4A8_AWQ loaders read; FP8QDQLinearMethod was not read in "
        "this version (421325918's is used). model_config.py: 4218302881 (checkpoint_dir signature, before the "
        "DeepSeek-V4 versions) was seen only through find_string excerpts, which show the same "
        "quant_config_dict['quantization'] subscript and .get('quant_algo'); the rest is 2419649560's text. "
        "Low confidence for the exact 1.2.x texts.",
    },
}
MODE_FLAGS = {  # from_description's keyword -> the QuantMode flag it sets (mode.py from_description)
    "quantize_weights": "INT8_WEIGHTS",
    "quantize_activations": "ACTIVATIONS",
    "per_token": "PER_TOKEN",
    "per_channel": "PER_CHANNEL",
    "per_group": "PER_GROUP",
    "use_fp8_qdq": "FP8_QDQ",
}
# QuantMode class attribute (mode.py): WEIGHTS_AND_ACTIVATIONS = INT4_WEIGHTS | INT8_WEIGHTS | ACTIVATIONS
MASKS = {"WEIGHTS_AND_ACTIVATIONS": {"INT4_WEIGHTS", "INT8_WEIGHTS", "ACTIVATIONS"}}


def read_excerpt(path: Path) -> tuple[dict, ast.Module]:
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("# ")][:3]
    match = re.match(r"# Excerpt of (\S+/\S+) (\S+) at the version the search index stores as id (\d+)", header[0])
    body = "\n".join(line for line in text.splitlines()[3:])
    return {
        "repo": match.group(1),
        "path": match.group(2),
        "index_id": match.group(3),
        "excerpt": path.name,
    }, ast.parse(textwrap.dedent(body))


# ---------------------------------------------------------------- model_config.py


def quant_config_keys(tree: ast.Module) -> dict:
    """Keys load_modelopt_quant_config reads from hf_quant_config.json: the top-level section subscripted out of
    the json.load result, then the keys read from that section by subscript (required) or .get (optional)."""
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    first_with = next(n for n in function.body if isinstance(n, ast.With))  # with open(quant_config_file) as f
    loaded = {
        t.id
        for s in first_with.body
        if isinstance(s, ast.Assign) and "json.load" in ast.unparse(s.value)
        for t in s.targets
    }
    section, top = None, []
    for n in function.body:  # the function's own statements, not the MIXED_PRECISION branch's quant_cfg.json
        if (
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Subscript)
            and isinstance(n.value.value, ast.Name)
            and n.value.value.id in loaded
        ):
            section, top = n.targets[0].id, top + [n.value.slice.value]
    if section is None:
        raise ValueError(f"{function.name}: no section subscripted out of the loaded JSON")
    required, optional = [], []
    for n in ast.walk(function):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == section:
            required.append(n.slice.value)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "get"
            and ast.unparse(n.func.value) == section
        ):
            optional.append(
                {"key": n.args[0].value, "default": ast.literal_eval(n.args[1]) if len(n.args) > 1 else None}
            )
    return {
        "function": function.name,
        "required_top_level": top,
        "required_in_section": sorted(set(required)),
        "optional_in_section": optional,
        "line_in_excerpt": function.lineno,
    }


def config_sources(tree: ast.Module) -> list[str]:
    """The if/elif chain of from_pretrained choosing where the quantization config comes from, in order."""
    chain = next(n for n in tree.body if isinstance(n, ast.If))
    out = []
    while chain is not None:
        test = ast.unparse(chain.test)
        called = next(ast.unparse(c.func) for c in ast.walk(chain.body[-1]) if isinstance(c, ast.Call))
        file = re.search(r"'([\w.]+\.json)'", test)
        out.append({"when": file.group(1) + " exists" if file else test, "reader": called})
        chain = chain.orelse[0] if chain.orelse and isinstance(chain.orelse[0], ast.If) else None
    return out


# ---------------------------------------------------------------- mode.py


def algo_modes(from_quant_algo: ast.Module, predicates: ast.Module) -> dict[str, set[str]]:
    """quant_algo -> the QuantMode flags from_quant_algo's constructor sets."""
    constructors = {
        f.name: f for f in ast.walk(predicates) if isinstance(f, ast.FunctionDef) and f.name.startswith("use_")
    }

    def flags_of(call: ast.Call) -> set[str]:
        name = call.func.attr
        if name == "from_description":
            params = list(MODE_FLAGS)  # positional order of from_description's first parameters
            values = dict(zip(params, [ast.literal_eval(a) for a in call.args]))
            values |= {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            int4 = values.pop("use_int4_weights", False)
            flags = {MODE_FLAGS[k] for k, v in values.items() if v and k in MODE_FLAGS}
            if int4 and "INT8_WEIGHTS" in flags:
                flags = flags - {"INT8_WEIGHTS"} | {"INT4_WEIGHTS"}
            return flags
        body = constructors[name]
        inner = next(
            n for n in ast.walk(body) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("from_description")
        )
        defaults = dict(zip([a.arg for a in body.args.args][-len(body.args.defaults) :], body.args.defaults))
        bound = {k: ast.literal_eval(v) for k, v in defaults.items()} | {
            k.arg: ast.literal_eval(k.value) for k in call.keywords
        }
        resolved = ast.Call(
            func=ast.Attribute(value=ast.Name("QuantMode"), attr="from_description"),
            args=[ast.Constant(bound.get(a.id, None)) if isinstance(a, ast.Name) else a for a in inner.args],
            keywords=[
                ast.keyword(k.arg, ast.Constant(bound[k.value.id]) if isinstance(k.value, ast.Name) else k.value)
                for k in inner.keywords
            ],
        )
        return flags_of(resolved)

    out = {}
    for n in ast.walk(from_quant_algo):
        if isinstance(n, ast.If) and ast.unparse(n.test).startswith("quant_algo == QuantAlgo."):
            algo = ast.unparse(n.test).split(".")[-1]
            call = n.body[0].value
            out[algo] = flags_of(call)
    return out


def evaluate(expr: ast.expr, flags: set[str], algo: str, predicates: dict[str, ast.FunctionDef]) -> bool:
    """A get_quant_method condition on a quant_config whose layer_quant_mode has `flags`."""
    if isinstance(expr, ast.BoolOp):
        values = [evaluate(v, flags, algo, predicates) for v in expr.values]
        return all(values) if isinstance(expr.op, ast.And) else any(values)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return not evaluate(expr.operand, flags, algo, predicates)
    if isinstance(expr, ast.Compare) and ast.unparse(expr.left).endswith("quant_algo"):
        return ast.unparse(expr.comparators[0]).split(".")[-1] == algo
    if isinstance(expr, ast.Compare) and ast.unparse(expr.left) == "quant_config":  # `quant_config is None`
        return False
    if isinstance(expr, ast.Call):
        name = expr.func.attr
        if name == "_all":
            bits = flag_set(expr.args[0])
            mask = flag_set(expr.args[1]) if len(expr.args) > 1 else None
            return (flags & mask if mask is not None else flags) == bits
        if name == "_any":
            return bool(flags & flag_set(expr.args[0]))
        if name == "has_any_quant":  # every weight/activation flag (mode.py has_any_quant, exclude_kv_cache=True)
            return bool(flags - {"PER_CHANNEL", "PER_TOKEN", "PER_GROUP"})
        if name in predicates:
            ret = next(n for n in ast.walk(predicates[name]) if isinstance(n, ast.Return))
            return evaluate(ret.value, flags, algo, predicates)
        return False  # a predicate of a format this pipeline does not produce (NVFP4, MXFP4, FP8 rowwise/block)
    raise ValueError(f"cannot evaluate {ast.unparse(expr)}")


def flag_set(node: ast.expr) -> set[str]:
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return set().union(*(MASKS.get(n, {n}) for n in names))


def quant_methods(get_quant_method: ast.Module, modes: dict[str, set[str]], predicates: ast.Module) -> dict:
    function = next(n for n in ast.walk(get_quant_method) if isinstance(n, ast.FunctionDef))
    checks = {f.name: f for f in ast.walk(predicates) if isinstance(f, ast.FunctionDef)}
    branches = [
        (s.test, s.body[0].value.func.id)
        for s in function.body
        if isinstance(s, ast.If) and isinstance(s.body[0], ast.Return)
    ]
    fallthrough = next(ast.unparse(s.exc) for s in function.body if isinstance(s, ast.Raise))
    out = {}
    for algo in OUR_ALGOS:
        flags = modes.get(algo)
        if flags is None:
            out[algo] = {"method": None, "why": f"QuantMode.from_quant_algo has no branch for {algo}"}
            continue
        hit = next(((t, m) for t, m in branches if evaluate(t, flags, algo, checks)), None)
        out[algo] = (
            {"method": hit[1], "condition": ast.unparse(hit[0]), "quant_mode_flags": sorted(flags)}
            if hit
            else {"method": None, "raises": fallthrough, "quant_mode_flags": sorted(flags)}
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
        and (ast.unparse(n.value) == "w" or ast.unparse(n.value).startswith("weights["))
    ]


def method_tensors(cls: ast.ClassDef) -> dict:
    """Tensors the class's loaders read next to `weight`, required or optional, and the dtype facts stated."""
    required, optional, guarded_vars, dtypes = {}, {}, {}, {}
    functions = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    for function in functions:
        for statement, conditions in _statements(function.body, []):
            guards = _guards(conditions)
            if len(guards) == 1:  # what a statement under `if "name" in w` assigns or appends to holds that tensor
                (name,) = guards
                for target in getattr(statement, "targets", []):
                    if isinstance(target, ast.Name):
                        guarded_vars[target.id] = name
                call = statement.value if isinstance(statement, ast.Expr) else None
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "append":
                    guarded_vars[ast.unparse(call.func.value)] = name
            for name in _tensor_subscripts(statement):
                if name in guards:
                    optional.setdefault(name, f"{function.name}: read under `if {name!r} in ...`")
                else:
                    required[name] = f"{function.name}: {ast.unparse(statement).splitlines()[0][:100]}"
            if isinstance(statement, ast.Assert) and ".dtype ==" in ast.unparse(statement.test):
                dtypes[ast.unparse(statement.test).split(".dtype")[0]] = ast.unparse(statement.test)
            if (
                function.name == "create_weights"
                and isinstance(statement, ast.Assign)
                and isinstance(statement.targets[0], ast.Attribute)
                and ast.unparse(statement.targets[0].value) == "module"
                and "Parameter(torch.empty" in ast.unparse(statement.value)
            ):
                dtype = next(
                    (
                        ast.unparse(k.value)
                        for k in ast.walk(statement.value)
                        if isinstance(k, ast.keyword) and k.arg == "dtype"
                    ),
                    None,
                )
                dtypes[f"parameter {statement.targets[0].attr}"] = dtype
    # a value collected under a guard and then used without one makes its tensor required
    for function in functions:
        for statement, conditions in _statements(function.body, []):
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
                    asserted = isinstance(statement, ast.Assert) and f"len({var})" in ast.unparse(statement.test)
                    if used or asserted:
                        required.setdefault(
                            name, f"{function.name}: {ast.unparse(statement).splitlines()[0][:100]} (no guard)"
                        )
                        break
    optional = {k: v for k, v in optional.items() if k not in required}
    return {"required": required, "optional": optional, "dtypes": dtypes}


def linear_methods(trees: list[ast.Module]) -> dict:
    return {n.name: method_tensors(n) for tree in trees for n in tree.body if isinstance(n, ast.ClassDef)}


# ---------------------------------------------------------------- the table


def tabulate(fixtures: Path) -> dict:
    table = {}
    for release, spec in RELEASES.items():
        files = spec["files"] or RELEASES["1.0"]["files"]
        read = {role: [read_excerpt(fixtures / name) for name in names] for role, names in files.items()}
        modelopt, from_pretrained = (t for _, t in read["model_config"])
        from_quant_algo, predicates = (t for _, t in read["mode"])
        modes = algo_modes(from_quant_algo, predicates)
        methods = linear_methods([t for _, t in read["methods"]])
        by_algo = quant_methods(read["get_quant_method"][0][1], modes, predicates)
        for algo, row in by_algo.items():
            if row["method"] in methods:
                row["tensors"] = methods[row["method"]]
        kv = {
            name: f"{method}: {why}"
            for method, facts in methods.items()
            for name, why in facts["optional"].items()
            if name in ("k_scale", "v_scale", "kv_scale")
        }
        table[release] = {
            "source": {
                "repo": REPO,
                "note": spec["note"],
                "files": [
                    {k: v for k, v in meta.items()} | {"role": role}
                    for role, entries in read.items()
                    for meta, _ in entries
                ],
            },
            "quant_config_source": config_sources(from_pretrained),
            "hf_quant_config": quant_config_keys(modelopt),
            "exclude_modules": {
                "read": any(o["key"] == "exclude_modules" for o in quant_config_keys(modelopt)["optional_in_section"]),
                "matching": "QuantConfig.exclude_modules: fnmatch patterns against the PyTorch module names (HF "
                "names: model.layers.N.self_attn.q_proj, lm_head), as ModelOpt writes them; not tabulated from "
                "the matching code (QuantConfig.is_module_excluded_from_quantization was not read)",
            },
            "quant_algos": by_algo,
            "kv_cache_scales": kv,
        }
    return table


if __name__ == "__main__":
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(tabulate(fixtures), indent=1, sort_keys=True) + "\n")
