"""Tabulate, per TensorRT-LLM release, which HF architectures the PyTorch backend registers and what each family's
model reads from a unified HF checkpoint beyond Llama's, from its own source (upstream/trtllm_torch_models.json).

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast` (never runs) whole files:
tensorrt_llm/_torch/models/modeling_{llama,mistral,qwen,qwen3,gemma3,phi3}.py, modules/qk_norm_attention.py,
models/checkpoints/hf/gemma3_weight_mapper.py, models/__init__.py (the import order) and modeling_utils.py
(register_auto_model):
- `@register_auto_model("X")`: the architecture names, their class and the decoder model it wraps. Two modules
  register MistralForCausalLM (modeling_llama.py and modeling_mistral.py); register_auto_model overwrites its
  mapping, so the module models/__init__.py imports later holds the name;
- the attention class (the one whose `super().__init__` takes num_key_value_heads): `bias=` / `dense_bias=` (which
  q/k/v and o_proj biases its Linear layers hold, so load), q_norm / k_norm (its own RMSNorm or
  QKNormRoPEAttention's, with their eps and size), and whether it takes an attention window from config.json;
- the decoder layer's RMSNorm attributes (every norm weight the loader copies, subscripting, so requires);
- the config attributes read by plain attribute access (AttributeError when the loaded config lacks them), those
  defaulted when absent (`if not hasattr(...): ... = `), and how a layer is told sliding from full attention;
- load_weights / the weight mapper: an offset added to every norm weight when copied (Gemma's (1 + w) norms), and
  for checkpoint-fused linears (Phi-3's qkv_proj / gate_up_proj) the row split and the tensor names each part gets;
- which of the config keys that change a family's output (NEVER_NAMED_CHECKS) its file never mentions.

A value that is not a literal is stored as what it refers to: {"config": key} (config.json's key), {"attribute":
name} (the attention's own attribute), {"name": local} (a local of load_weights, defined in `bindings`), or an
arithmetic formula {operation: [left, right]}. No copy read is at a release's own commit (`pinned` false); most were
read from copies with no known commit (`commit` null), and each release names the commit to read to pin them.
"""

from __future__ import annotations

import ast
import json
import re

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, stored_releases

MODELS = "tensorrt_llm/_torch/models"
INIT = f"{MODELS}/__init__.py"
UTILS = f"{MODELS}/modeling_utils.py"
LLAMA = f"{MODELS}/modeling_llama.py"
MISTRAL = f"{MODELS}/modeling_mistral.py"
QWEN = f"{MODELS}/modeling_qwen.py"
QWEN3 = f"{MODELS}/modeling_qwen3.py"
GEMMA3 = f"{MODELS}/modeling_gemma3.py"
GEMMA3_MAPPER = f"{MODELS}/checkpoints/hf/gemma3_weight_mapper.py"
QK_NORM = "tensorrt_llm/_torch/modules/qk_norm_attention.py"
PHI3 = f"{MODELS}/modeling_phi3.py"
# Config attributes every decoder reads and every HF config class defines: not worth a row per family.
COMMON_CONFIG = {
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "torch_dtype",
    "rms_norm_eps",
    "intermediate_size",
    "vocab_size",
    "num_hidden_layers",
    "tie_word_embeddings",
    "pad_token_id",
}
# Per modeling module: the config.json keys that change the model's output when set, to be recorded when the file
# never mentions them (Mistral's sliding window, Gemma's logit soft-capping).
NEVER_NAMED_CHECKS = {
    "modeling_mistral": ("sliding_window",),
    "modeling_gemma3": ("final_logit_softcapping", "attn_logit_softcapping"),
}
SHARED = {INIT: None, UTILS: None, LLAMA: None, MISTRAL: None, QWEN: None, QWEN3: None}
# Per release: the commit each file is read at (None: a copy whose commit is not known), in the order read, and the
# release's own commit. modeling_phi3.py at 000a01de (version 1.0.0rc4) anchors 1.0; the other copies are ordered
# by content: modeling_gemma3.py reading sliding_window_pattern before the one reading layer_types (with
# QKNormRoPEAttention and the HF weight mapper); modeling_phi3.py passing only `weight` to the split parts before
# the one that also splits or shares weight_scale and passes input_scale / weight_scale_2.
RELEASES = {
    "1.0": {
        "files": SHARED | {GEMMA3: None, PHI3: "000a01de66f0eab4ab05640711f0253f50f5209c"},
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "note": "No copy at a release commit was readable. modeling_phi3.py is the copy at 000a01de (version "
        "1.0.0rc4); modeling_gemma3.py is the copy that reads sliding_window_pattern (1.0 pins transformers 4.53, "
        "whose Gemma 3 config has it); the other files are copies ordered by content. Medium confidence.",
    },
    "1.1": {
        "files": SHARED | {GEMMA3: None, PHI3: None},
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "note": "As 1.0, except modeling_phi3.py: the copy whose load_weights also splits or shares weight_scale and "
        "passes input_scale and weight_scale_2 to the parts (the ModelOpt FP8 Phi-3 fix merged on main in August "
        "2025, the 1.1 line). Low confidence that these are the 1.1.0 files.",
    },
    "1.2": {
        "files": SHARED
        | {GEMMA3: None, GEMMA3_MAPPER: "2a9abd9536aa62ad3e4b9314be9286b1b1be523b", QK_NORM: None, PHI3: None},
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "note": "As 1.1, except modeling_gemma3.py: the newest copy read (layer_types, QKNormRoPEAttention, norms "
        "offset by the HF weight mapper). Low confidence for the exact 1.2 files.",
    },
}
OPERATIONS = {ast.Add: "add", ast.Sub: "subtract", ast.Mult: "multiply", ast.FloorDiv: "floor_divide"}


def refers_to(node: ast.expr):
    """A keyword's or assignment's value as data: a literal as itself, `config.X` / `self.pretrained_config.X` as
    {"config": X}, `self.X` as {"attribute": X}."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute):
        owner = ast.unparse(node.value)
        if owner == "config" or owner.endswith((".config", "pretrained_config")):
            return {"config": node.attr}
        if owner == "self":
            return {"attribute": node.attr}
    raise UnrecognizedSource(f"a value given as {type(node).__name__}")


def arithmetic(node: ast.expr):
    """An integer expression of names, config attributes and literals as a formula; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return {"name": node.id}
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("config", "self.config"):
        return {"config": node.attr}
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
        left, right = arithmetic(node.left), arithmetic(node.right)
        if left is not None and right is not None:
            return {OPERATIONS[type(node.op)]: [left, right]}
    return None


def sliding_schedule(node: ast.expr | None):
    """`is_sliding = ...` as data: every N-th layer full (N from config.json), or a per-layer config.json list."""
    if node is None:
        return None
    argument = node.args[0] if isinstance(node, ast.Call) and ast.unparse(node.func) == "bool" else None
    if isinstance(argument, ast.BinOp) and isinstance(argument.op, ast.Mod):  # the layer number modulo N
        return {"full_every": refers_to(argument.right)}
    if (
        isinstance(node, ast.Compare)
        and isinstance(node.ops[0], ast.Eq)
        and isinstance(node.left, ast.Subscript)
        and ast.unparse(node.left.slice) == "layer_idx"
        and isinstance(node.comparators[0], ast.Constant)
    ):
        return {"equals": node.comparators[0].value, "sliding_where": refers_to(node.left.value)}
    raise UnrecognizedSource("a sliding-layer schedule of another shape")


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name), None)


def _super_init(function: ast.FunctionDef) -> ast.Call | None:
    return next(
        (
            n
            for n in ast.walk(function)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "super().__init__" and n.keywords
        ),
        None,
    )


def _keyword_node(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _keyword(call: ast.Call, name: str):
    node = _keyword_node(call, name)
    return None if node is None else refers_to(node)


def _self_assigned_calls(function: ast.FunctionDef, callee: str) -> dict[str, ast.Call]:
    return {
        s.targets[0].attr: s.value
        for s in ast.walk(function)
        if isinstance(s, ast.Assign)
        and isinstance(s.targets[0], ast.Attribute)
        and ast.unparse(s.targets[0].value) == "self"
        and isinstance(s.value, ast.Call)
        and ast.unparse(s.value.func) == callee
    }


def config_reads(nodes: list[ast.AST]) -> tuple[set[str], set[str]]:
    """(attributes of the HF config read by plain attribute access, attributes defaulted when absent)."""
    config_names = {"config", "self.config", "model_config.pretrained_config", "self.pretrained_config"}
    guarded, defaulted, read = set(), set(), set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("getattr", "hasattr") and len(n.args) >= 2:
                guarded.add(n.args[1].value)
            if (
                isinstance(n, ast.If)
                and isinstance(n.test, ast.UnaryOp)
                and isinstance(n.test.op, ast.Not)
                and isinstance(n.test.operand, ast.Call)
                and ast.unparse(n.test.operand.func) == "hasattr"
            ):
                defaulted.add(n.test.operand.args[1].value)
        for n in ast.walk(node):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Load)
                and ast.unparse(n.value) in config_names
                and n.attr not in guarded
            ):
                read.add(n.attr)
    return read - COMMON_CONFIG - defaulted, defaulted


def _assigned(function: ast.FunctionDef, target: str) -> list[ast.expr]:
    """The values assigned to `target` (dotted) in `function`."""
    return [s.value for s in ast.walk(function) if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == target]


def attention_facts(cls: ast.ClassDef, qk_norm_base: ast.ClassDef | None) -> dict:
    init = _method(cls, "__init__")
    call = _super_init(init)
    base = ast.unparse(cls.bases[0])
    norms = _self_assigned_calls(init, "RMSNorm")
    if not norms and base == "QKNormRoPEAttention" and qk_norm_base is not None:
        norms = _self_assigned_calls(_method(qk_norm_base, "__init__"), "RMSNorm")
    window = next(
        (
            v
            for v in _assigned(init, "self.attention_window_size")
            if not (isinstance(v, ast.Constant) and v.value is None)
        ),
        None,
    )
    theta = next(iter(_assigned(init, "rope_params.theta")), None)  # a sliding layer's RoPE base, for rope_theta
    return {
        "attention_window": None if window is None else refers_to(window),
        "base": base,
        "bias": _keyword(call, "bias"),
        "class": cls.name,
        "dense_bias": _keyword(call, "dense_bias"),
        "qk_norm": {
            name: {"eps": _keyword(norms[name], "eps"), "hidden_size": _keyword(norms[name], "hidden_size")}
            for name in ("k_norm", "q_norm")
            if name in norms
        }
        or None,
        "sliding_rope_theta": None if theta is None else refers_to(theta),
    }


def _norm_offset(tree: ast.AST) -> dict | None:
    """A constant the loader adds to a weight it copies under `if "<part>" in <module name>:` (Gemma's norms)."""
    for n in ast.walk(tree):
        test = n.test if isinstance(n, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.ops[0], ast.In)
            and isinstance(test.left, ast.Constant)
            and "norm" in str(test.left.value)
        ):
            for m in ast.walk(n.body[0]):
                if isinstance(m, ast.BinOp) and isinstance(m.op, ast.Add) and isinstance(m.right, ast.Constant):
                    return {"add": m.right.value, "to_names_containing": test.left.value}
    return None


def _rows_compared(test: ast.expr) -> bool:
    """`a.shape[0] == b.shape[0]` somewhere in `test`: a scale split only when its rows are the weight's."""
    return any(
        isinstance(c, ast.Compare)
        and isinstance(c.ops[0], ast.Eq)
        and all(
            isinstance(side, ast.Subscript) and ast.unparse(side).endswith(".shape[0]")
            for side in (c.left, c.comparators[0])
        )
        for c in ast.walk(test)
    )


def fused_checkpoint_linears(load_weights: ast.FunctionDef) -> dict:
    """Per `if "<name>" in name:` branch of load_weights that splits rows: the row split of the checkpoint's fused
    weight (formulas of load_weights' integer locals, `bindings`), the tensor names each part's dict receives (dict
    literal keys and `part['key'] = ...` assignments), and when a weight_scale is split rather than shared."""
    function_locals = {
        s.targets[0].id: s.value
        for s in load_weights.body
        if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)
    }
    out = {}
    for n in ast.walk(load_weights):
        if not (
            isinstance(n, ast.If)
            and isinstance(n.test, ast.Compare)
            and isinstance(n.test.left, ast.Constant)
            and ast.unparse(n.test.comparators[0]) == "name"  # the module name, not a parameter's
        ):
            continue
        branch = ast.Module(body=n.body, type_ignores=[])
        passes = set()
        for m in ast.walk(branch):
            if isinstance(m, ast.Dict):
                passes |= {k.value for k in m.keys if isinstance(k, ast.Constant)}
            if isinstance(m, ast.Assign) and isinstance(m.targets[0], ast.Subscript):
                key = m.targets[0].slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    passes.add(key.value)
        branch_locals = {
            s.targets[0].id: s.value
            for s in ast.walk(branch)
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)
        }
        bounds = []
        for m in ast.walk(branch):
            if (
                isinstance(m, ast.Subscript)
                and isinstance(m.slice, ast.Tuple)
                and isinstance(m.slice.elts[0], ast.Slice)
            ):
                rows = m.slice.elts[0]
                for bound in (rows.lower, rows.upper):
                    if bound is not None:
                        resolved = branch_locals.get(bound.id, bound) if isinstance(bound, ast.Name) else bound
                        bounds.append(json.dumps(arithmetic(resolved)))
        if not bounds:  # a branch on the module name that splits no rows (Gemma's norm offset) fuses nothing
            continue
        bindings = {name: arithmetic(value) for name, value in (function_locals | branch_locals).items()}
        out[n.test.left.value] = {
            "bindings": {name: formula for name, formula in sorted(bindings.items()) if formula is not None},
            "passes": sorted(passes),
            "split_rows_at": [json.loads(bound) for bound in dict.fromkeys(bounds)],
            "weight_scale_split_when": next(
                (
                    "rows_equal_weight_rows"
                    for m in ast.walk(branch)
                    if isinstance(m, ast.If) and _rows_compared(m.test)
                ),
                None,
            ),
        }
    return out


def import_order(init: str) -> list[str]:
    """models/__init__.py's `from .modeling_x import ...` modules, in order."""
    return [n.module for n in ast.parse(init).body if isinstance(n, ast.ImportFrom) and n.level == 1]


def later_registration_wins(utils: str) -> bool:
    """Whether register_auto_model's decorator overwrites: it assigns the class to `<mapping>[name]`."""
    function = next(
        (n for n in ast.parse(utils).body if isinstance(n, ast.FunctionDef) and n.name == "register_auto_model"), None
    )
    return function is not None and any(
        isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Subscript)
        and ast.unparse(n.targets[0].slice) == "name"
        and ast.unparse(n.value) == "cls"
        for n in ast.walk(function)
    )


def never_named(module: str, source: str) -> list[str]:
    """The keys of NEVER_NAMED_CHECKS[module] that `source` (the whole file) never mentions."""
    return [key for key in NEVER_NAMED_CHECKS.get(module, ()) if not re.search(rf"\b{key}\b", source)]


def family_facts(files: dict[str, tuple[dict, str]]) -> dict:
    """architecture name -> what the PyTorch backend's model for it reads, from one release's files
    (path -> (citation, whole text))."""
    order = import_order(files[INIT][1])
    if not later_registration_wins(files[UTILS][1]):
        raise UnrecognizedSource("register_auto_model no longer overwrites: which registration holds a name is unknown")
    trees = {path: ast.parse(text) for path, (_, text) in files.items()}
    qk_base = next((c for t in trees.values() for c in _classes(t).values() if c.name == "QKNormRoPEAttention"), None)
    mapper_offsets = {  # @register_mapper("HF", "<architecture>") on a mapper whose copy adds an offset
        d.args[1].value: _norm_offset(c)
        for t in trees.values()
        for c in _classes(t).values()
        for d in c.decorator_list
        if isinstance(d, ast.Call) and ast.unparse(d.func) == "register_mapper"
    }
    out = {}
    for path, tree in trees.items():
        if f"{MODELS}/modeling_" not in path or path == UTILS:
            continue
        record, text = files[path]
        module = path.rsplit("/", 1)[1].removesuffix(".py")
        classes = _classes(tree)
        attention = next(
            (
                c
                for c in classes.values()
                if (i := _method(c, "__init__"))
                and (call := _super_init(i))
                and _keyword_node(call, "num_key_value_heads")
            ),
            None,
        )
        layer = next(
            (c for c in classes.values() if (i := _method(c, "__init__")) and _assigned(i, "self.self_attn")),
            None,
        )
        for cls in classes.values():
            names = [
                d.args[0].value
                for d in cls.decorator_list
                if isinstance(d, ast.Call) and ast.unparse(d.func) == "register_auto_model"
            ]
            for name in names:
                if name in out and order.index(out[name]["source"]["path"].rsplit("/", 1)[1][:-3]) > order.index(
                    module
                ):
                    out[name]["shadows"].append(path)
                    continue
                shadowed = [out[name]["source"]["path"], *out[name]["shadows"]] if name in out else []
                base = cls.bases[0]
                read, defaulted = config_reads([c for c in (attention, layer, cls) if c is not None])
                schedule = next(iter(_assigned(layer or cls, "is_sliding")), None)
                load_weights = _method(cls, "load_weights")
                out[name] = {
                    "attention": attention_facts(attention, qk_base) if attention is not None else None,
                    "class": cls.name,
                    "config_defaulted": sorted(defaulted),
                    "config_required": sorted(read),
                    "fused_checkpoint_linears": fused_checkpoint_linears(load_weights) if load_weights else {},
                    "layer_norms": sorted(_self_assigned_calls(_method(layer, "__init__"), "RMSNorm"))
                    if layer is not None
                    else None,
                    "model": ast.unparse(base.slice.elts[0]) if isinstance(base, ast.Subscript) else None,
                    "never_names": never_named(module, text),
                    "norm_weight_offset": _norm_offset(tree) or mapper_offsets.get(name),
                    "shadows": shadowed,  # modules registering the name earlier in the import order
                    "sliding_schedule": sliding_schedule(schedule),
                    "source": record,
                }
    return dict(sorted(out.items()))


def tabulate(upstream: Upstream) -> dict:
    releases = {}
    for release, spec in RELEASES.items():
        files = {
            path: (cite(REPO, path, commit, pinned=False), upstream.read(REPO, path, commit))
            for path, commit in spec["files"].items()
        }
        block = {
            "architectures": family_facts(files),
            "release_commit": spec["release_commit"],
            "source": {"files": [record for record, _ in files.values()], "note": spec["note"]},
        }
        releases[release] = json.loads(json.dumps(block, sort_keys=True))
    return {"releases": stored_releases(releases)}
