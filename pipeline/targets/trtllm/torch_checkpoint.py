"""The unified HF checkpoint (`export/hf_unified/`) against what TensorRT-LLM's PyTorch backend reads, on CPU.

TensorRT-LLM 1.x's PyTorch backend (LLM API, `trtllm-serve`) loads a ModelOpt unified checkpoint directly. What it
requires is tabulated from its source into upstream/trtllm_torch_loader.json
(per release: the hf_quant_config.json keys read, the LinearMethod each quant_algo gets or the ValueError it raises,
the tensors each method's loaders read next to `weight` without a fallback, the dtypes they assert). What each
family's model reads beyond Llama's (biases, q/k norms, Gemma's extra norms, Phi-3's checkpoint-fused linears and
how its load_weights splits them, config.json keys read without a fallback) is tabulated per release by
scripts/dev/tabulate_trtllm_torch_models.py into upstream/trtllm_torch_models.json. The shapes are ModelOpt's layout,
derived from config.json and group_size. Whether the deployed values are good is measured on the unified
checkpoint itself: pipeline/targets/trtllm/reference.py load_unified_reference (checkpoint_model kind="unified").
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict
from pathlib import Path

from pipeline.models import ModelFacts
from pipeline.safetensors_files import tensor_headers
from pipeline.targets.trtllm.checkpoint import EXPECTED_ALGO, excluded, release_key
from pipeline.upstream import facts

TABLE = facts("trtllm_torch_loader")["releases"]
MODELS = facts("trtllm_torch_models")["releases"]
RELEASES = tuple(r for r in TABLE if r in MODELS)
# HF Llama linears; the PyTorch backend fuses q/k/v into qkv_proj and gate/up into gate_up_proj (their fused
# loaders) and loads o_proj / down_proj alone (load_weights_vanilla). A family whose HF checkpoint holds qkv_proj /
# gate_up_proj already fused (Phi-3) has them in place of the parts (family_linears).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
VANILLA = ("o_proj", "down_proj")
FUSED_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
# The Llama decoder layer's norms: what a family whose decoder layer was not tabulated (Llama, Mistral) holds.
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
# The operations of a tabulated formula (upstream/trtllm_torch_models.json bindings, split_rows_at), and their signs.
OPS = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "floor_divide": operator.floordiv}
SIGNS = {"add": "+", "subtract": "-", "multiply": "*", "floor_divide": "//"}
INT = ("I8", "U8")  # int4 pairs packed in a byte (ModelOpt writes U8; the loader takes .to(torch.int8))
FLOAT = ("F32", "F16", "BF16")
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SCALAR = ([], [1])


def family(config: dict, release: str) -> dict | None:
    """What TensorRT-LLM `release`'s PyTorch model for config.json's architecture reads, or None if unregistered."""
    return MODELS[release]["architectures"].get((config.get("architectures") or [""])[0])


def family_linears(fused: dict) -> tuple[str, ...]:
    """The decoder linears (relative to a layer) of a checkpoint whose family's load_weights takes the
    `fused` modules (upstream/trtllm_torch_models.json fused_checkpoint_linears) already fused."""
    out = []
    for group, parts in (("self_attn", ATTENTION), ("mlp", MLP)):
        whole = next((m for m in fused if m.startswith(f"{group}.")), None)
        out += [whole] if whole else []
        out += [f"{group}.{p}" for p in parts if not (whole and p in FUSED_PARTS[whole])]
    return tuple(out)


def loader_groups(fused: dict) -> list[tuple[str, ...]]:
    """The decoder linears (relative to a layer) of a checkpoint whose family's load_weights takes the `fused`
    modules already fused, grouped as the PyTorch backend loads them: the parts of one fused linear (q/k/v into
    qkv_proj, gate/up into gate_up_proj: its fused loaders) together, a checkpoint-fused or vanilla linear alone."""
    groups: dict[str, list[str]] = {}
    for module in family_linears(fused):
        group, short = module.split(".")
        whole = next((w for w, parts in FUSED_PARTS.items() if w.startswith(f"{group}.") and short in parts), module)
        groups.setdefault(whole, []).append(module)
    return [tuple(g) for g in groups.values()]


def linear_shapes(config: dict, fused: dict | None = None) -> dict[str, tuple[int, int]]:
    """HF module name -> (out_features, in_features) of every decoder linear."""
    facts = ModelFacts.from_hf_config(config)
    heads, kv, head = facts.num_attention_heads, facts.num_key_value_heads, facts.head_size
    hidden, inter = facts.hidden_size, facts.intermediate_size
    sizes = {
        "q_proj": (heads * head, hidden),
        "k_proj": (kv * head, hidden),
        "v_proj": (kv * head, hidden),
        "o_proj": (hidden, heads * head),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "qkv_proj": ((heads + 2 * kv) * head, hidden),
        "gate_up_proj": (2 * inter, hidden),
    }
    return {
        f"model.layers.{i}.{module}": sizes[module.rsplit(".", 1)[1]]
        for i in range(facts.num_hidden_layers)
        for module in family_linears(fused or {})
    }


def evaluate(formula, config: dict, bindings: dict) -> int:
    """A tabulated integer formula of load_weights on config.json: an integer, {"config": key}, {"name": local} (one
    of load_weights' `bindings`, itself a formula) or {operation: [left, right]}."""
    if isinstance(formula, int):
        return formula
    if "config" in formula:
        return config[formula["config"]]
    if "name" in formula:
        return evaluate(bindings[formula["name"]], config, bindings)
    ((operation, (left, right)),) = formula.items()
    return OPS[operation](evaluate(left, config, bindings), evaluate(right, config, bindings))


def shown(formula) -> str:
    """A formula as arithmetic, for a message (`hidden_size // num_heads`)."""
    if isinstance(formula, int):
        return str(formula)
    if "config" in formula or "name" in formula:
        return formula.get("config") or formula["name"]
    ((operation, (left, right)),) = formula.items()
    return f"{shown(left)} {SIGNS[operation]} {shown(right)}"


def cited(source: dict) -> str:
    """A tabulated source file for a message: its name at the commit read, or that the commit is not known."""
    name = source["path"].rsplit("/", 1)[1]
    return f"{name}@{source['commit'][:8]}" if source["commit"] else f"{name}, a copy of unknown commit"


def ignored_window(model: dict, release: str, window: int | None, max_seq_len: int | None) -> str | None:
    """Why a sliding window every layer of the checkpoint has (config.json's sliding_window) is lost on `release`'s
    `model` (the family row of upstream/trtllm_torch_models) at this max_seq_len, or None: the model takes no attention
    window from config.json (Mistral never names sliding_window; Phi-3, Qwen2 take none), so it attends to the
    whole sequence, which differs from the trained model once a sequence is longer than the window."""
    attention = model["attention"] or {}
    if not window or attention.get("attention_window") is not None or (max_seq_len and max_seq_len <= window):
        return None
    where = f"TensorRT-LLM {release}'s {model['class']} ({cited(model['source'])})"
    read = "never names sliding_window" if "sliding_window" in model["never_names"] else "takes no window from it"
    return (
        f"config.json sets sliding_window {window} (below max_seq_len {max_seq_len}), but {where} {read}: its "
        f"{attention.get('class')} attends to the whole sequence in every layer; set build.max_seq_len <= {window}, "
        "the window"
    )


def config_problems(config: dict, loaded, model: dict, release: str, max_seq_len: int | None) -> list[str]:
    """What `model` (the family row of upstream/trtllm_torch_models) reads from config.json that it lacks or ignores.
    `loaded` is the transformers config object (class defaults count as present)."""
    where = f"TensorRT-LLM {release}'s {model['class']} ({cited(model['source'])})"
    problems = [
        f"config.json has no {key}, which {where} reads without a fallback (AttributeError, or whatever default the "
        "release's own transformers gives it)"
        for key in model["config_required"]
        if key not in config and not hasattr(loaded, key)
    ]
    attention = model["attention"] or {}
    period = (model["sliding_schedule"] or {}).get("full_every", {}).get("config")
    pattern, kinds = config.get(period) if period else None, config.get("layer_types")
    if pattern and kinds:
        derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(kinds))]
        if derived != kinds:
            problems.append(
                f"{where} makes every {period}-th layer ({pattern}) full attention and the others sliding: "
                f"{derived}, but config.json's layer_types is {kinds}"
            )
    theta = attention.get("sliding_rope_theta")
    if isinstance(theta, (int, float)) and config.get("rope_local_base_freq") not in (None, theta):
        problems.append(
            f"{where} gives sliding layers RoPE base {theta}, not config.json's rope_local_base_freq "
            f"{config['rope_local_base_freq']}"
        )
    # validate refuses a uniform window from the model's facts (PytorchBackend.config_problems); this is the backstop
    # for a checkpoint whose config.json validate could not read, and for a window only some layers have
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if (problem := ignored_window(model, release, window, max_seq_len)) is not None:
        problems.append(problem)
    for key in model["never_names"]:
        if key != "sliding_window" and config.get(key) is not None:
            problems.append(f"config.json sets {key} {config[key]}, which {where} never reads (its output differs)")
    return problems


def family_tensors(config: dict, model: dict, tied: bool) -> dict[str, tuple[str, list[int]]]:
    """The non-linear tensors (and biases) `model` copies from the checkpoint without a fallback: name ->
    (what reads it, shape). `tied`: the loaded config's tie_word_embeddings (lm_head is then not loaded)."""
    facts = ModelFacts.from_hf_config(config)
    hidden, head = facts.hidden_size, facts.head_size
    attention = model["attention"] or {}
    out = {
        "model.embed_tokens.weight": ("the embedding", [None, hidden]),
        "model.norm.weight": ("the final norm", [hidden]),
    }
    if not tied:
        out["lm_head.weight"] = ("lm_head (tie_word_embeddings is false)", [None, hidden])
    shapes = linear_shapes(config, model["fused_checkpoint_linears"])
    for i in range(facts.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for norm in model["layer_norms"] or LLAMA_NORMS:
            out[f"{prefix}.{norm}.weight"] = (f"the decoder layer's {norm}", [hidden])
        for norm in attention.get("qk_norm") or {}:
            out[f"{prefix}.self_attn.{norm}.weight"] = (f"{attention['class']}.{norm}", [head])
        for module, (rows, _) in shapes.items():
            if not module.startswith(f"{prefix}.self_attn."):
                continue
            # o_proj takes dense_bias; Attention's dense_bias=None means "as bias" (modules/attention.py, not
            # tabulated)
            flag = attention.get("dense_bias") if module.endswith("o_proj") else None
            flag = attention.get("bias") if flag is None else flag
            if flag is True or (isinstance(flag, dict) and config.get(flag["config"])):
                out[f"{module}.bias"] = (f"{attention['class']} (bias={bias_text(flag)})", [rows])
    return out


def bias_text(flag) -> str:
    """A tabulated `bias=` of an attention class for a message: a literal, or the config.json key it is read from."""
    return f"config.json's {flag['config']}" if isinstance(flag, dict) else str(flag)


def split_problems(
    module: str, out: int, split: dict, config: dict, tensors: dict, required: set[str], where: str
) -> list[str]:
    """How `where` (a load_weights) would mis-split the quantized checkpoint-fused `module` of `out` rows (Phi-3's
    qkv_proj / gate_up_proj): tensors the parts never get, a packed int4 weight split at unpacked row counts, a
    per-row weight_scale handed whole to every part, a head_dim other than config.json's."""
    facts = ModelFacts.from_hf_config(config)
    problems = []
    dropped = sorted(n for n in required if n not in split["passes"])
    if dropped:
        problems.append(
            f"{module}: {where} hands the split parts only {split['passes']}, so the fused loader finds no "
            f"{dropped} (KeyError); exclude {module.rsplit('.', 1)[1]} from quantization or target a newer release"
        )
    bindings = split["bindings"]
    head_dim = evaluate(bindings["head_dim"], config, bindings) if "head_dim" in bindings else facts.head_size
    if head_dim != facts.head_size:
        problems.append(
            f"{module}: {where} splits at head_dim = {shown(bindings['head_dim'])} = {head_dim}, but config.json's "
            f"head_dim is {facts.head_size}"
        )
    weight = tensors.get(f"{module}.weight")
    if weight is not None and weight[1][0] != out:
        bounds = [evaluate(b, config, bindings) for b in split["split_rows_at"]]
        problems.append(
            f"{module}.weight has {weight[1][0]} rows (packed int4: two output rows a byte) but {where} splits its "
            f"rows at {bounds}, counted unpacked: the parts get the wrong rows"
        )
    scale = tensors.get(f"{module}.weight_scale")
    if "weight_scale" in split["passes"] and weight and scale and scale[1] and scale[1][0] == out != weight[1][0]:
        problems.append(
            f"{module}.weight_scale has {out} rows, not the weight's {weight[1][0]}: {where} (which splits it only "
            "when its rows are the weight's) gives every part the whole scale"
        )
    return problems


def expected(algo: str, name: str, out: int, inp: int, group: int | None) -> tuple[tuple[str, ...], list | tuple]:
    """(accepted safetensors dtypes, shape or tuple of accepted shapes) of one tensor of a linear."""
    if name == "weight":
        if algo == "FP8":
            return ("F8_E4M3",), [out, inp]
        if algo == "W8A16":
            return ("I8",), [out, inp]  # the loader's weight parameter is torch.int8
        return INT, [out // 2, inp]  # W4A16_AWQ / W4A8_AWQ
    if name == "weight_scale":
        if algo == "FP8":
            return ("F32",), SCALAR
        if algo == "W8A16":
            return FLOAT, [out]
        return FLOAT, [out, inp // group] if group else [out, None]
    if name == "pre_quant_scale":
        return FLOAT, [inp]
    return ("F32",), SCALAR  # input_scale, weight_scale_2, k_scale, v_scale


def torch_loader_problems(unified_dir: Path, release: str, max_seq_len: int | None = None) -> list[str]:
    """Everything in `unified_dir` TensorRT-LLM `release`'s PyTorch backend would fail on or misread.
    `max_seq_len`: the deployment's, which a sliding window the model ignores must not be below."""
    from transformers import AutoConfig

    if release not in RELEASES:
        return [f"TensorRT-LLM {release}: no PyTorch-backend facts tabulated (have {', '.join(RELEASES)})"]
    facts = TABLE[release]
    config = json.loads((unified_dir / "config.json").read_text())
    model = family(config, release)
    if model is None:
        return [
            f"config.json architecture {(config.get('architectures') or ['<none>'])[0]}: TensorRT-LLM {release}'s "
            "tensorrt_llm/_torch/models registers no such class"
        ]
    tensors = tensor_headers(unified_dir)
    if not tensors:
        return [f"{unified_dir}: no *.safetensors"]
    loaded = AutoConfig.from_pretrained(unified_dir)
    problems = config_problems(config, loaded, model, release, max_seq_len)
    where = f"TensorRT-LLM {release}'s {model['class']}.load_weights ({cited(model['source'])})"
    wanted = family_tensors(config, model, loaded.tie_word_embeddings)
    for name, (reader, shape) in wanted.items():
        have = tensors.get(name)
        if have is None:
            problems.append(f"missing {name}, which {reader} reads (TensorRT-LLM {release}, {model['class']})")
        elif (
            have[0] not in FLOAT
            or len(have[1]) != len(shape)
            or any(a not in (b, None) for a, b in zip(shape, have[1]))
        ):
            problems.append(f"{name} is {have[0]} {have[1]}, {reader} expects a float tensor of shape {shape}")
    problems += [
        f"{name}: {model['attention']['class']} has no such bias (bias={bias_text(model['attention']['bias'])}), so "
        f"TensorRT-LLM "
        f"{release} would compute without it"
        for name in tensors
        if name.endswith(".bias") and name not in wanted
    ]
    quant_file = unified_dir / "hf_quant_config.json"
    quant: dict = {}
    if quant_file.is_file():
        document = json.loads(quant_file.read_text())
        missing = [k for k in facts["hf_quant_config"]["required_top_level"] if k not in document]
        if missing:
            return [
                f"hf_quant_config.json: no {missing} section, which load_modelopt_quant_config subscripts (KeyError)"
            ]
        quant = document[facts["hf_quant_config"]["required_top_level"][0]]
    elif (config.get("quantization_config") or {}).get("quant_method") == "modelopt":
        problems.append(
            "config.json declares a ModelOpt quantization_config but there is no hf_quant_config.json: TensorRT-LLM "
            f"{release} reads ModelOpt configs only from hf_quant_config.json "
            f"({facts['quant_config_source'][0]['reader']})"
        )
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    group = quant.get("group_size")
    patterns = quant.get("exclude_modules") or []
    if kv not in (None, "FP8"):
        problems.append(f"hf_quant_config.json: kv_cache_quant_algo {kv!r} is not one this table covers (FP8)")
    row = facts["quant_algos"].get(algo) if algo else None
    if algo and row is None:
        return problems + [f"hf_quant_config.json: quant_algo {algo!r} is not tabulated for TensorRT-LLM {release}"]
    if row is not None and row["method"] is None:
        return problems + [
            f"hf_quant_config.json: quant_algo {algo}: TensorRT-LLM {release}'s PyTorch backend has no linear method "
            f"for it (get_quant_method raises {row.get('raises') or row.get('why')})"
        ]
    if algo in ("W4A16_AWQ", "W4A8_AWQ") and not isinstance(group, int):
        problems.append(f"hf_quant_config.json: {algo} needs an integer group_size (weight_scale is per group)")
        group = None
    model_dtype = DTYPES.get(config.get("torch_dtype") or config.get("dtype"))
    fused = model["fused_checkpoint_linears"]
    for module, (out, inp) in linear_shapes(config, fused).items():
        short = module.rsplit(".", 1)[1]
        weight = tensors.get(f"{module}.weight")
        if weight is None:
            problems.append(f"missing {module}.weight")
            continue
        if algo is None or excluded(module, patterns):
            if weight[0] not in FLOAT:
                problems.append(
                    f"{module}.weight is {weight[0]} but the module is "
                    f"{'excluded from quantization' if algo else 'unquantized'}: the loader expects float weights"
                )
            stray = [n for n in ("weight_scale", "input_scale", "weight_scale_2") if f"{module}.{n}" in tensors]
            if algo and stray:
                problems.append(f"{module} is excluded from quantization but has {stray}")
            continue
        reads = row["tensors"]
        required = {
            name
            for name, read in reads["required"].items()
            if read["function"] != "load_weights_vanilla" or name == "weight_scale" or short in VANILLA
        }
        split = fused.get(module.split(".", 3)[3])
        if split is not None:
            problems += split_problems(module, out, split, config, tensors, required, where)
        for name in ["weight", *sorted(required | set(reads["optional"]))]:
            full = f"{module}.{name}"
            if name in ("k_scale", "v_scale") and short != name[0] + "_proj":
                continue
            if full not in tensors:
                if name in required or name == "weight":
                    read = reads["required"].get(name)
                    why = f"{read['function']}, without a fallback" if read else "the linear's weight"
                    problems.append(f"missing {full}, which TensorRT-LLM {release}'s {row['method']} reads ({why})")
                continue
            dtypes, shape = expected(algo, name, out, inp, group)
            have_dtype, have_shape = tensors[full]
            shapes = shape if isinstance(shape, tuple) else (shape,)
            if have_dtype not in dtypes:
                problems.append(f"{full} is {have_dtype}, {row['method']} expects {' or '.join(dtypes)}")
            if not any(
                len(s) == len(have_shape) and all(a in (b, None) for a, b in zip(s, have_shape)) for s in shapes
            ):
                problems.append(f"{full} has shape {have_shape}, expected {' or '.join(map(str, shapes))}")
            if reads["asserted_dtypes"].get(name) == "module_dtype" and model_dtype and have_dtype != model_dtype:
                problems.append(
                    f"{full} is {have_dtype} but the model dtype is {model_dtype}: {row['method']} asserts that they "
                    "are the same"
                )
    return problems


def fused_split_refusal(
    arch: str, release: str, weights: str, method: str, exclude: list[str], facts: ModelFacts | None = None
) -> str | None:
    """Why TensorRT-LLM `release`'s model for `arch` cannot load this quantization of its checkpoint-fused linears
    (Phi-3's qkv_proj / gate_up_proj, which its load_weights splits), or None. `exclude`: quantization.exclude_modules
    (an excluded linear stays float and splits fine), matched as ModelOpt matches it, on every layer's full module
    name. `facts`: the checkpoint's (its layer count, and the rows the split is at); None: layer 0 only."""
    model = MODELS.get(release, {}).get("architectures", {}).get(arch)
    algo = EXPECTED_ALGO.get((weights, method))
    row = TABLE.get(release, {}).get("quant_algos", {}).get(algo) or {}
    if model is None or not row.get("method"):
        return None
    where = f"{model['class']}.load_weights ({cited(model['source'])})"
    layers = range(facts.num_hidden_layers if facts else 1)
    for module, split in model["fused_checkpoint_linears"].items():
        if all(excluded(f"model.layers.{i}.{module}", exclude) for i in layers):
            continue
        dropped = sorted(n for n in row["tensors"]["required"] if n not in split["passes"])
        packed = algo in ("W4A16_AWQ", "W4A8_AWQ")
        if dropped or packed:
            at = ""
            if facts is not None:
                bounds = [evaluate(b, asdict(facts), split["bindings"]) for b in split["split_rows_at"]]
                at = f" at {bounds}"
            why = (
                f"splits the packed int4 weight's rows{at}, counted unpacked (the weight holds two rows a byte)"
                if packed
                else f"hands the split parts only {split['passes']}, so {row['method']} finds no {dropped}"
            )
            newer = [
                r
                for r in sorted(MODELS, key=release_key)
                if release_key(r) > release_key(release)
                and not fused_split_refusal(arch, r, weights, method, exclude, facts)
            ]
            fix = f"set target.trtllm_version: {newer[0]}, or " if newer else ""
            return (
                f"TensorRT-LLM {release}'s {where} {why} ({module}, {algo}); {fix}add "
                f"{', '.join(m.rsplit('.', 1)[1] for m in model['fused_checkpoint_linears'])} to "
                "quantization.exclude_modules"
            )
    return None


def unsupported_quantization(weights: str, method: str, kv_cache: str, release: str) -> str | None:
    """Why TensorRT-LLM `release`'s PyTorch backend cannot load this pipeline's unified checkpoint for the
    combination, or None when it can."""
    if release not in TABLE:
        return f"TensorRT-LLM {release}: no PyTorch-backend facts tabulated (have {', '.join(RELEASES)})"
    algo = EXPECTED_ALGO.get((weights, method))
    if kv_cache not in ("none", "fp8"):
        return f"{kv_cache} KV cache: only FP8 KV-cache scales are exported and tabulated for the PyTorch backend"
    if algo is None:
        return None
    row = TABLE[release]["quant_algos"].get(algo)
    if row is None or row["method"] is None:
        return (
            f"TensorRT-LLM {release}'s PyTorch backend cannot load {algo} ({weights}/{method}): get_quant_method has "
            f"no linear method for it and raises {(row or {}).get('raises', 'ValueError')}; use fp8 or int4 awq"
        )
    if (weights, method) == ("int8", "rtn"):
        return (
            f"TensorRT-LLM {release}'s PyTorch backend loads W8A16 only as int8 weights with a weight_scale "
            f"({row['method']} reads weight_scale without a fallback and takes the weight as int8), but this pipeline "
            "exports int8 weight-only as float weights for the engine loader to quantize, so the unified checkpoint "
            "is unquantized; use fp8 or int4 awq"
        )
    return None
