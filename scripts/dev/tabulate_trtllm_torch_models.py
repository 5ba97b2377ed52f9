"""Tabulate, per TensorRT-LLM release, which HF architectures the PyTorch backend registers and what each family's
model reads from a unified HF checkpoint beyond Llama's, from its own source.

Maintainer tool, not run by the pipeline. Reads with `ast` (never runs) verbatim excerpts of
tensorrt_llm/_torch/models/modeling_{llama,mistral,qwen,qwen3,gemma3,phi3}.py, modules/qk_norm_attention.py,
models/checkpoints/hf/gemma3_weight_mapper.py, models/__init__.py (the import order) and modeling_utils.py
(register_auto_model) (committed under tests/fixtures/upstream/models_*.py.txt /
modules_*.py.txt, each headed with its repository, path and index id; cached under
/work/upstream-cache/NVIDIA+TensorRT-LLM/index-id-<id>/<path>.excerpt-<name>, described in READS-trtllm-i11.json):
- `@register_auto_model("X")`: the architecture names, their class and the decoder model it wraps. Two modules
  register MistralForCausalLM (modeling_llama.py and modeling_mistral.py); register_auto_model assigns
  MODEL_CLASS_MAPPING[name] = cls, so the module models/__init__.py imports later holds the name;
- the attention class (the one whose `super().__init__` takes num_key_value_heads): `bias=` / `dense_bias=` (which
  q/k/v and o_proj biases its Linear layers hold, so load), q_norm / k_norm (its own RMSNorm or
  QKNormRoPEAttention's, with their eps), and whether it takes an attention window from config.sliding_window;
- the decoder layer's RMSNorm attributes (every norm weight the loader copies, subscripting, so requires);
- the config attributes read by plain attribute access (AttributeError when the loaded config lacks them), those
  defaulted when absent (`if not hasattr(...): ... = `), and the sliding/full layer schedule's source;
- load_weights / the weight mapper: a `+ 1` added to every `norm` weight when copied (Gemma's (1 + w) norms), and
  for checkpoint-fused linears (Phi-3's qkv_proj / gate_up_proj) the row split and the tensor names each part gets;
- names the whole file never mentions (softcapping), recorded in the excerpt as `never names: ...` after reading it.
Usage:
    python scripts/dev/tabulate_trtllm_torch_models.py tests/fixtures/upstream pipeline/trtllm_torch_models.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

REPO = "NVIDIA/TensorRT-LLM"
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
LLAMA = "models_llama_426411151.py.txt"
MISTRAL = "models_mistral_52281727364.py.txt"
INIT = "models_init_130844221.py.txt"
UTILS = "models_utils_1046435088.py.txt"
QWEN = "models_qwen_897439166.py.txt"
QWEN3 = "models_qwen3_2464033405.py.txt"
GEMMA3_PATTERN = "models_gemma3_3555689717.py.txt"
GEMMA3_LAYER_TYPES = ["models_gemma3_651856424.py.txt", "models_gemma3_mapper_838601826.py.txt"]
QK_NORM = "modules_qk_norm_attention_542261675.py.txt"
PHI3_WEIGHT_ONLY = "models_phi3_9325938422.py.txt"
PHI3_SCALES = "models_phi3_1151304321.py.txt"

# Which stored versions stand for which release. The index stores few release commits; the one anchor is
# modeling_phi3.py at commit 000a01de (index id 9325938422), whose tensorrt_llm/version.py says 1.0.0rc4. The rest
# is ordered by content, as tabulate_trtllm_torch_loader.py orders model_config.py / linear.py: modeling_gemma3.py
# 3555689717 (reads config.sliding_window_pattern, its own q/k norms, +1 in its load_weights; transformers < 4.56)
# < 651856424 (config.layer_types, QKNormRoPEAttention, the HF weight mapper's +1); modeling_phi3.py 9325938422
# (load_weights passes only `weight` to the split parts) < 1151304321 (also splits or shares weight_scale and
# passes input_scale / weight_scale_2). modeling_qwen.py has one stored version (897439166); modeling_qwen3.py's
# 2464033405 is the oldest stored with SpecDecOneEngineForCausalLM and is used for every release. Every stored
# models/__init__.py that imports modeling_phi3 also imports `Mistral3VLM, MistralForCausalLM` from modeling_mistral
# after modeling_llama: modeling_mistral.py 52281727364 (with Mistral3VLM, read whole) for every release.
RELEASES = {
    "1.0": {
        "files": [INIT, UTILS, LLAMA, MISTRAL, QWEN, QWEN3, GEMMA3_PATTERN, PHI3_WEIGHT_ONLY],
        "note": "modeling_phi3.py at commit 000a01de (version.py 1.0.0rc4): the anchor. modeling_gemma3.py "
        "3555689717 (sliding_window_pattern; TensorRT-LLM 1.0 pins transformers 4.53, whose Gemma3TextConfig has "
        "it). Others by content order; medium confidence.",
    },
    "1.1": {
        "files": [INIT, UTILS, LLAMA, MISTRAL, QWEN, QWEN3, GEMMA3_PATTERN, PHI3_SCALES],
        "note": "modeling_phi3.py 1151304321 (weight_scale split or shared, input_scale / weight_scale_2 passed: "
        "NVIDIA/TensorRT-LLM pull request 6761 'Accommodate Phi3/4 to work with ModelOpt's FP8 ckpts in Torch', "
        "reviewed 2025-08-08..15 on main, the 1.1 line); modeling_gemma3.py as 1.0. Low confidence that these "
        "are the 1.1.0 texts.",
    },
    "1.2": {
        "files": [INIT, UTILS, LLAMA, MISTRAL, QWEN, QWEN3, *GEMMA3_LAYER_TYPES, QK_NORM, PHI3_SCALES],
        "note": "modeling_gemma3.py 651856424 (config.layer_types, QKNormRoPEAttention, Gemma3HfWeightMapper): "
        "the newest stored line; modeling_phi3.py as 1.1. Low confidence for the exact 1.2.x texts.",
    },
}


def read_excerpt(path: Path) -> tuple[dict, ast.Module, list[str]]:
    """(source record, parsed body, names the excerpt says the whole file never mentions)."""
    text = path.read_text()
    lines = text.splitlines()
    match = re.match(
        r"# Excerpt of (\S+/\S+) (\S+) at the version the search index stores as id (\d+) \((?:commit (\w+)|[^)]*)\)",
        lines[0],
    )
    never = [n.strip() for line in lines for n in re.findall(r"never names: (.*)$", line) for n in n.split(",")]
    record = {"repo": match.group(1), "path": match.group(2), "index_id": match.group(3), "excerpt": path.name}
    if match.group(4):
        record["commit"] = match.group(4)
    return record, ast.parse(textwrap.dedent("\n".join(lines[3:]))), never


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


def _value(node: ast.expr):
    """A constant as itself, anything else as its source text."""
    return node.value if isinstance(node, ast.Constant) else ast.unparse(node)


def _keyword(call: ast.Call, name: str):
    node = next((k.value for k in call.keywords if k.arg == name), None)
    return None if node is None else _value(node)


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
            if isinstance(n, ast.If) and ast.unparse(n.test).startswith("not hasattr("):
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


def attention_facts(cls: ast.ClassDef, qk_norm_base: ast.ClassDef | None) -> dict:
    init = _method(cls, "__init__")
    call = _super_init(init)
    base = ast.unparse(cls.bases[0])
    norms = _self_assigned_calls(init, "RMSNorm")
    if not norms and base == "QKNormRoPEAttention" and qk_norm_base is not None:
        norms = _self_assigned_calls(_method(qk_norm_base, "__init__"), "RMSNorm")
    window = next(
        (
            ast.unparse(s.value)
            for s in ast.walk(init)
            if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "self.attention_window_size" and s.value
            if not (isinstance(s.value, ast.Constant) and s.value.value is None)
        ),
        None,
    )
    theta = next(  # the RoPE base a sliding layer gets in place of config.rope_theta
        (
            _value(s.value)
            for s in ast.walk(init)
            if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "rope_params.theta"
        ),
        None,
    )
    return {
        "class": cls.name,
        "base": base,
        "sliding_rope_theta": theta,
        "bias": _keyword(call, "bias"),
        "dense_bias": _keyword(call, "dense_bias"),
        "qk_norm": {
            name: {"eps": _keyword(norms[name], "eps"), "hidden_size": _keyword(norms[name], "hidden_size")}
            for name in ("q_norm", "k_norm")
            if name in norms
        }
        or None,
        "attention_window": window,
    }


def _norm_offset(tree: ast.Module) -> dict | None:
    """`p.data.copy_(module_weights[n][:] + 1)` under `if 'norm' in ...`: the offset the loader adds to norms."""
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and re.match(r"'norm' in ", ast.unparse(n.test)):
            for call in ast.walk(n.body[0]):
                if (
                    isinstance(call, ast.BinOp)
                    and isinstance(call.op, ast.Add)
                    and isinstance(call.right, ast.Constant)
                ):
                    return {"matching": "'norm' in the module name", "add": call.right.value}
    return None


def fused_checkpoint_linears(load_weights: ast.FunctionDef) -> dict:
    """Per `if "<name>" in name:` branch of load_weights: the row split of the checkpoint's fused weight and the
    tensor names each part's dict receives (dict literal keys and `part['key'] = ...` assignments)."""
    locals_ = {
        ast.unparse(s.targets[0]): ast.unparse(s.value)
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
        module = n.test.left.value
        branch = ast.Module(body=n.body, type_ignores=[])
        passes = set()
        for m in ast.walk(branch):
            if isinstance(m, ast.Dict):
                passes |= {k.value for k in m.keys if isinstance(k, ast.Constant)}
            if isinstance(m, ast.Assign) and isinstance(m.targets[0], ast.Subscript):
                key = m.targets[0].slice
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    passes.add(key.value)
        bounds = []
        for m in ast.walk(branch):
            if isinstance(m, ast.Subscript) and isinstance(m.slice, ast.Tuple):
                rows = m.slice.elts[0]
                if isinstance(rows, ast.Slice):
                    bounds += [ast.unparse(b) for b in (rows.lower, rows.upper) if b is not None]
        names = {
            ast.unparse(s.targets[0]): ast.unparse(s.value)
            for s in ast.walk(branch)
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)
        }
        resolved = [names.get(b, b) for b in dict.fromkeys(bounds)]
        scale_rule = next(
            (
                ast.unparse(m.test)
                for m in ast.walk(branch)
                if isinstance(m, ast.If) and "shape[0] ==" in ast.unparse(m.test)
            ),
            None,
        )
        out[module] = {
            "split_rows_at": list(dict.fromkeys(resolved)),
            "passes": sorted(passes),
            "weight_scale_split_when": scale_rule,
            "bindings": {  # the integer locals the split expressions use
                k: v for k, v in (locals_ | names).items() if not any(c in v for c in "([{")
            },
        }
    return out


def import_order(trees) -> list[str]:
    """models/__init__.py's `from .modeling_x import ...` modules, in order."""
    init = next(t for rec, t, _ in trees if rec["path"].endswith("models/__init__.py"))
    return [n.module for n in init.body if isinstance(n, ast.ImportFrom) and n.level == 1]


def later_registration_wins(trees) -> bool:
    """Whether register_auto_model's decorator overwrites: `MODEL_CLASS_MAPPING[name] = cls`."""
    utils = next(t for rec, t, _ in trees if rec["path"].endswith("models/modeling_utils.py"))
    function = next(n for n in utils.body if isinstance(n, ast.FunctionDef) and n.name == "register_auto_model")
    return any(ast.unparse(n) == "MODEL_CLASS_MAPPING[name] = cls" for n in ast.walk(function))


def family_facts(trees: list[tuple[dict, ast.Module, list[str]]]) -> dict:
    """architecture name -> what the PyTorch backend's model for it reads, from the excerpts of one release."""
    order = import_order(trees)
    if not later_registration_wins(trees):
        raise ValueError("register_auto_model no longer overwrites: which registration holds a name is unknown")
    qk_base = next(
        (c for _, t, _ in trees for c in _classes(t).values() if c.name == "QKNormRoPEAttention"),
        None,
    )
    mapper_offsets = {  # @register_mapper("HF", "<architecture>") on a mapper whose copy adds an offset
        d.args[1].value: _norm_offset(ast.Module(body=[c], type_ignores=[]))
        for _, t, _ in trees
        for c in _classes(t).values()
        for d in c.decorator_list
        if isinstance(d, ast.Call) and ast.unparse(d.func) == "register_mapper"
    }
    out = {}
    for record, tree, never in trees:
        if "/models/modeling_" not in record["path"]:
            continue
        classes = _classes(tree)
        attention = next(
            (
                c
                for c in classes.values()
                if (i := _method(c, "__init__")) and (call := _super_init(i)) and _keyword(call, "num_key_value_heads")
            ),
            None,
        )
        layer = next(
            (c for c in classes.values() if (i := _method(c, "__init__")) and "self.self_attn =" in ast.unparse(i)),
            None,
        )
        for cls in classes.values():
            names = [
                d.args[0].value
                for d in cls.decorator_list
                if isinstance(d, ast.Call) and ast.unparse(d.func) == "register_auto_model"
            ]
            module = record["path"].rsplit("/", 1)[1].removesuffix(".py")
            for name in names:
                if name in out and order.index(out[name]["source"]["path"].rsplit("/", 1)[1][:-3]) > order.index(
                    module
                ):
                    out[name]["shadows"].append(record["path"])
                    continue
                shadowed = [out[name]["source"]["path"], *out[name]["shadows"]] if name in out else []
                base = cls.bases[0]
                read, defaulted = config_reads([c for c in (attention, layer, cls) if c is not None])
                schedule = next(  # how a layer is told sliding from full attention
                    (ast.unparse(s.value) for s in ast.walk(layer or cls) if ast.unparse(s).startswith("is_sliding =")),
                    None,
                )
                load_weights = _method(cls, "load_weights")
                out[name] = {
                    "source": record,
                    "class": cls.name,
                    "model": ast.unparse(base.slice.elts[0]) if isinstance(base, ast.Subscript) else None,
                    "attention": attention_facts(attention, qk_base) if attention is not None else None,
                    "layer_norms": sorted(_self_assigned_calls(_method(layer, "__init__"), "RMSNorm"))
                    if layer is not None
                    else None,
                    "sliding_schedule": schedule,
                    "config_required": sorted(read),
                    "config_defaulted": sorted(defaulted),
                    "norm_weight_offset": _norm_offset(tree) or mapper_offsets.get(name),
                    "fused_checkpoint_linears": fused_checkpoint_linears(load_weights)
                    if load_weights is not None
                    else {},
                    "never_names": never,
                    "shadows": shadowed,  # modules registering the name earlier in the import order
                }
    return out


def tabulate(fixtures: Path) -> dict:
    table = {}
    for release, spec in RELEASES.items():
        trees = [read_excerpt(fixtures / name) for name in spec["files"]]
        table[release] = {
            "source": {"repo": REPO, "note": spec["note"], "files": [record for record, _, _ in trees]},
            "architectures": family_facts(trees),
        }
    return table


if __name__ == "__main__":
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(tabulate(fixtures), indent=1, sort_keys=True) + "\n")
