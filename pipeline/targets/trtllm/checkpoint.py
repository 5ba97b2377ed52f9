"""Conformance of a TensorRT-LLM checkpoint (`config.json` + `rank{N}.safetensors`) of a family the engine
workflow builds (LLaMA-layout classes: LLaMAForCausalLM, QWenForCausalLM), checked on CPU.

The exporter is not trusted: ModelOpt has been seen to write a checkpoint that TensorRT-LLM's loader
rejects (e.g. `pre_quant_scale: true` with no `prequant_scaling_factor` tensors for int4
round-to-nearest). Every expectation here is derived from the model's own HF config and the build
config, then compared with what was written: `config.json` fields against the model's true values,
and every tensor name, dtype and shape on every rank, with no tensor missing and none extra. What sets a family
apart (its MODEL_MAP class, the config keys its class reads without a default, its attention biases) comes from
upstream/trtllm_engine_models.json, tabulated from TensorRT-LLM's and ModelOpt's source by
scripts/dev/tabulate_trtllm_engine_models.py.
Written by hand because no library validates checkpoints against TensorRT-LLM's model definition.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.models import ModelFacts
from pipeline.safetensors_files import read_header, tensor_headers
from pipeline.upstream import facts

# tensorrt_llm/quantization/mode.py QuantAlgo values this pipeline produces, and the KV-cache ones.
QUANT_ALGOS = {None, "FP8", "W8A16", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "W4A8_AWQ"}
KV_CACHE_ALGOS = {None, "FP8", "INT8"}
# (weights, method) of the build config -> the quant_algo the checkpoint must declare
EXPECTED_ALGO = {
    ("none", "rtn"): None,
    ("fp8", "rtn"): "FP8",
    ("int8", "rtn"): "W8A16",
    ("int8", "smoothquant"): "W8A8_SQ_PER_CHANNEL",
    ("int4", "rtn"): "W4A16_AWQ",
    ("int4", "awq"): "W4A16_AWQ",
    ("int4", "w4a8_awq"): "W4A8_AWQ",
}
F32 = "F32"
# Facts tabulated from TensorRT-LLM's source by scripts/dev/tabulate_trtllm_checkpoint.py, with the commits read.
RULES = facts("trtllm_checkpoint")
# QuantConfig.from_dict is cls(**config): a key inside `quantization` that is not a field of the dataclass in
# every version read makes TensorRT-LLM's loader raise.
QUANT_CONFIG_KEYS = set(RULES["quant_config"]["accepted_in_every_version"])
# Mapping.from_dict is cls(**mapping): `mapping` may hold only parameters of Mapping.__init__ in every version read
# (ModelOpt inside NVIDIA's container writes the richer Mapping.to_dict(), e.g. cp_size, moe_tp_size, attn_tp_size).
MAPPING_KEYS = set(RULES["mapping"]["accepted_in_every_version"])
ENGINE_MODELS = facts("trtllm_engine_models")


class NotBuildable(ValueError):
    """An architecture the engine workflow cannot take from this pipeline; the message says why."""


def _where(source: dict) -> str:
    version = source["commit"][:8] if source["commit"] else "a copy of unknown commit"
    return f"{source['path']} @ {version}"


def modelopt_decoder_type(architecture: str) -> str | None:
    """The decoder type ModelOpt's own table gives the model class (model_utils.get_model_type: the first
    MODEL_NAME_TO_TYPE name contained in the class name), the one its TensorRT-LLM exporter is called with."""
    return next(
        (
            decoder
            for name, decoder in ENGINE_MODELS["modelopt"]["model_name_to_type"]
            if name.lower() in architecture.lower()
        ),
        None,
    )


@dataclass(frozen=True)
class EngineFamily:
    """What the engine workflow's class for an HF architecture reads from a checkpoint."""

    architecture: str  # HF name: ModelOpt writes it as config.json `architecture`, MODEL_MAP resolves it
    trtllm_class: str
    decoder_type: str  # ModelOpt's
    defaults: dict  # the config class's __init__ defaults: what a missing config.json key means
    derived: dict[str, str]  # config key -> the HF config attribute from_hugging_face takes it from
    required: tuple[str, ...]  # keys the decoder layer branches on that the config class has no default for
    dense_bias: bool | None  # the attention output projection's bias, when the layer fixes it


# The HF architectures whose TensorRT-LLM checkpoint this module checks tensor by tensor and reference.py
# rebuilds: the LLaMA layout, plus Qwen2's q/k/v biases. Qwen3's per-head q/k RMSNorm (q_layernorm / k_layernorm,
# which ModelOpt writes) is in neither.
CHECKED_LAYOUTS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# What the conformance check and the reference forward lack for a family MODEL_MAP and ModelOpt would take
UNCHECKED = {"Qwen3ForCausalLM": "Qwen3's per-head q/k RMSNorm tensors (q_norm, k_norm)"}


def release_key(release: str) -> tuple[int, ...]:
    """A TensorRT-LLM release ("1.2", "0.18") as numbers, to order releases ("1.10" after "1.9")."""
    return tuple(int(part) for part in release.split("."))


def excluded(module: str, patterns) -> bool:
    """Whether quantization.exclude_modules `patterns` leave `module` unquantized, as ModelOpt decides it:
    modelopt_config (targets/trtllm/modelopt.py) disables the quantizers matching `*{pattern}*` (fnmatch) on their
    full names, so `module` is a full name (model.layers.0.self_attn.qkv_proj) and `qkv_proj`, `*.qkv_proj` and
    `self_attn.qkv_proj` all match it."""
    return any(fnmatch.fnmatchcase(module, f"*{pattern}*") for pattern in patterns)


def model_map_class(architecture: str, release: str) -> str:
    """The class `release`'s MODEL_MAP gives `architecture`: the one of every stored version, or, for an entry only
    newer versions have, theirs from the release whose notes say it was added on."""
    maps = ENGINE_MODELS["model_map"]
    classes = {m["classes"].get(architecture) for m in maps}
    added = ENGINE_MODELS["added_in_release"].get(architecture)
    if None not in classes and len(classes) == 1:
        return classes.pop()
    lacking = ", ".join(_where(m["source"]) for m in maps if architecture not in m["classes"])
    if added is None or len(classes - {None}) != 1:
        raise NotBuildable(
            f"the class registry (MODEL_MAP) has no class for it in {lacking}, and no release note says which "
            "release added one"
        )
    (trtllm_class,) = classes - {None}
    if release_key(release) < release_key(added["release"]):
        raise NotBuildable(
            f"the class registry has no class for it (MODEL_MAP in {lacking}); {added['release']} added one "
            f"({trtllm_class}; {added['source']['path']} lists it among the models {added['release']} adds)"
        )
    return trtllm_class


def engine_family(architecture: str, release: str) -> EngineFamily:
    """The tabulated facts for `architecture` in `release`, or NotBuildable naming the source that rules it out."""
    trtllm_class = model_map_class(architecture, release)
    modelopt = ENGINE_MODELS["modelopt"]
    decoder = modelopt_decoder_type(architecture)
    if decoder not in modelopt["config_writer_decoder_types"]:
        raise NotBuildable(
            f"MODEL_MAP maps it to {trtllm_class}, but ModelOpt {modelopt['version']} cannot export it as a "
            f"TensorRT-LLM checkpoint: its decoder type {decoder!r} (modelopt/torch/export/model_utils.py "
            f"MODEL_NAME_TO_TYPE) is not one convert_to_tensorrt_llm_config writes "
            f"({', '.join(modelopt['config_writer_decoder_types'])}; for any other it raises "
            f"{modelopt['config_writer_otherwise_raises']})"
        )
    if architecture not in CHECKED_LAYOUTS:
        raise NotBuildable(
            f"MODEL_MAP maps it to {trtllm_class}, but this pipeline checks and references only the "
            f"{', '.join(CHECKED_LAYOUTS)} checkpoint layouts of the engine workflow: it does not check or "
            f"reference {UNCHECKED.get(architecture, f'the {architecture} layout')}"
        )
    model = ENGINE_MODELS["model_classes"][trtllm_class]  # tabulated for every class of CHECKED_LAYOUTS
    config = ENGINE_MODELS["config_classes"][model["config_class"]]
    layer = ENGINE_MODELS["decoder_layers"][model["decoder_layer"]]
    dense_bias = layer["attention"].get("dense_bias")  # a literal when the layer fixes it
    return EngineFamily(
        architecture=architecture,
        trtllm_class=trtllm_class,
        decoder_type=decoder,
        defaults=config["init_defaults"],
        derived={key: taken["hf_config"] for key, taken in config["from_hugging_face"].items()},
        required=tuple(k for k in layer["compares"] if k not in config["init_defaults"]),
        dense_bias=dense_bias,
    )


def family_values(family: EngineFamily, hf: dict) -> dict:
    """The config.json keys the family's class reads without a default, as its from_hugging_face derives them."""
    return {key: hf[family.derived[key]] for key in family.required}


def hf_biases(hf_dir: Path) -> dict[str, bool]:
    """Which HF linears of the model carry a bias, from its own checkpoint (Qwen2 has q/k/v biases and no
    config key saying so)."""
    names = set(tensor_headers(hf_dir))
    return {
        "attn": any(n.endswith("self_attn.q_proj.bias") for n in names),
        "dense": any(n.endswith("self_attn.o_proj.bias") for n in names),
        "mlp": any(n.endswith(("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")) for n in names),
    }


@dataclass(frozen=True)
class Linear:
    name: str  # TensorRT-LLM module path inside a layer
    hf: str  # the HF module it comes from (for exclude_modules patterns)
    out_features: int  # per rank
    in_features: int  # per rank


def llama_linears(facts: ModelFacts, tp: int) -> list[Linear]:
    """The linears of one decoder layer with per-rank shapes: column-parallel layers split their
    outputs, row-parallel ones (dense, proj) their inputs; KV heads are duplicated when fewer than tp."""
    hidden, heads, head_size = facts.hidden_size, facts.num_attention_heads, facts.head_size
    inter = facts.intermediate_size
    kv_per_rank = max(1, facts.num_key_value_heads // tp)
    return [
        Linear("attention.qkv", "self_attn.q_proj", (heads // tp + 2 * kv_per_rank) * head_size, hidden),
        Linear("attention.dense", "self_attn.o_proj", hidden, heads * head_size // tp),
        Linear("mlp.fc", "mlp.gate_proj", inter // tp, hidden),  # TensorRT-LLM's fc is HF's gate_proj
        Linear("mlp.gate", "mlp.up_proj", inter // tp, hidden),  # and its gate is HF's up_proj
        Linear("mlp.proj", "mlp.down_proj", hidden, inter // tp),
    ]


ROW_PARALLEL = ("attention.dense", "mlp.proj")


def padding_multiple(algo: str | None, group_size: int, tp: int) -> int | None:
    """What TensorRT-LLM's weight-only linears round in_features and out_features up to (RULES
    weight_only_layers: WeightOnlyQuantLinear `64 * tp_size`, WeightOnlyGroupwiseQuantLinear
    `max(128 if use_w4a8_awq else 64, group_size) * tp_size`); None for layers that do not pad."""
    if algo == "W8A16":
        return 64 * tp
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        return max(128 if algo == "W4A8_AWQ" else 64, group_size) * tp
    return None


def padding_problems(facts: ModelFacts, tp: int, algo: str | None, group_size: int) -> list[str]:
    """Linears whose sizes TensorRT-LLM pads: the checkpoint holds them unpadded (ModelOpt and its loader do not
    pad), so the engine build's shape check fails on them."""
    multiple = padding_multiple(algo, group_size, tp)
    if multiple is None:
        return []
    problems = []
    for linear in llama_linears(facts, tp):
        row = linear.name in ROW_PARALLEL  # the layer's own sizes: the split dimension times tp
        sizes = {
            "in_features": linear.in_features * (tp if row else 1),
            "out_features": linear.out_features * (1 if row else tp),
        }
        problems += [
            f"{linear.name} ({linear.hf}) has {name} {size}, which TensorRT-LLM's {algo} linear pads to a multiple "
            f"of {multiple} (quantization/layers.py); the checkpoint is written unpadded and would not load"
            for name, size in sizes.items()
            if size % multiple
        ]
    return problems


def linear_tensors(prefix: str, linear: Linear, quant: dict, dtype: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of one linear under the checkpoint's quant_algo."""
    algo, out, inp = quant.get("quant_algo"), linear.out_features, linear.in_features
    if algo is None:
        return {f"{prefix}.weight": (dtype, [out, inp])}
    if algo == "FP8":
        return {
            f"{prefix}.weight": ("F8_E4M3", [out, inp]),
            f"{prefix}.weights_scaling_factor": (F32, [1]),
            f"{prefix}.activation_scaling_factor": (F32, [1]),
        }
    if algo == "W8A16":  # float: the loader quantizes it (weight_only_quantize_dict skips int8 weights)
        return {f"{prefix}.weight": (dtype, [out, inp])}
    if algo == "W8A8_SQ_PER_CHANNEL":
        return {
            f"{prefix}.weight": ("I8", [out, inp]),
            f"{prefix}.weights_scaling_factor": (F32, [out]),
            f"{prefix}.activation_scaling_factor": (F32, [1]),
            f"{prefix}.prequant_scaling_factor": (dtype, [inp]),
        }
    group = quant["group_size"]  # W4A16_AWQ / W4A8_AWQ: two int4 values per int8 along the output dimension
    tensors = {
        f"{prefix}.weight": ("I8", [out // 2, inp]),
        f"{prefix}.weights_scaling_factor": (F32, [out, inp // group]),
    }
    if quant.get("pre_quant_scale"):
        tensors[f"{prefix}.prequant_scaling_factor"] = (dtype, [inp])
    if algo == "W4A8_AWQ":
        tensors |= {f"{prefix}.activation_scaling_factor": (F32, [1]), f"{prefix}.weights_scaling_factor_2": (F32, [1])}
    return tensors


def padded_vocab(vocab: int, tp: int, quant_algo: str | None) -> int:
    import math

    multiple = math.lcm(64, tp) if quant_algo in ("W4A16_AWQ", "W4A8_AWQ") else tp  # AWQ kernels want 64-row multiples
    return -(-vocab // multiple) * multiple


def expected_tensors(ckpt: dict, hf: dict, rank: int, family: EngineFamily) -> dict[str, tuple]:
    """name -> (dtype, shape[, "optional"]) of every tensor TensorRT-LLM reads from this rank's file."""
    mapping, quant = ckpt["mapping"], ckpt.get("quantization", {})
    tp, pp = mapping["tp_size"], mapping["pp_size"]
    pp_rank = rank // tp  # every tp rank of a pipeline stage holds the same names and shapes
    dtype = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[ckpt["dtype"]]
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    exclude = quant.get("exclude_modules") or []
    vocab = padded_vocab(hf["vocab_size"], tp, quant.get("quant_algo"))
    qkv_bias = ckpt.get("attn_bias", family.defaults["attn_bias"])  # what the class builds Attention(bias=) with
    out: dict[str, tuple[str, list[int]]] = {}
    if pp_rank == 0:
        rows = vocab // tp if ckpt.get("use_parallel_embedding") else hf["vocab_size"]
        out["transformer.vocab_embedding.weight"] = (dtype, [rows, hidden])
    for local in range(layers // pp):
        base = f"transformer.layers.{local}"
        global_index = pp_rank * (layers // pp) + local
        out[f"{base}.input_layernorm.weight"] = (dtype, [hidden])
        out[f"{base}.post_layernorm.weight"] = (dtype, [hidden])
        for linear in llama_linears(ModelFacts.from_hf_config(hf), tp):
            names = (f"{base}.{linear.name}", f"model.layers.{global_index}.{linear.hf}")
            skip = any(excluded(n, exclude) for n in names)
            out |= linear_tensors(f"{base}.{linear.name}", linear, {} if skip else quant, dtype)
            if qkv_bias and linear.name == "attention.qkv":  # (a model with other biases is refused: family_problems)
                out[f"{base}.{linear.name}.bias"] = (dtype, [linear.out_features])  # biases stay in the model dtype
        if quant.get("kv_cache_quant_algo"):
            out[f"{base}.attention.kv_cache_scaling_factor"] = (F32, [1])
            # separate K and V scales are also read: preprocess_weights (0.18+) replaces the KV scale by their max
            out |= {f"{base}.attention.{kv}_cache_scaling_factor": (F32, [1], "optional") for kv in "kv"}
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = (dtype, [hidden])
        if not ckpt.get("share_embedding_table"):
            out["lm_head.weight"] = (dtype, [vocab // tp, hidden])
    return out


def family_problems(ckpt: dict, hf: dict, biases: dict[str, bool], family: EngineFamily) -> list[str]:
    """The family's own config.json keys (read without a default) and its bias switches (read with the config
    class's default when absent) against the model's values."""
    problems = [
        f"config.json: {key} is {ckpt.get(key)!r}; TensorRT-LLM's {family.trtllm_class} reads it without a default "
        f"and from_hugging_face takes it from the HF config's {family.derived[key]}: {value!r}"
        for key, value in family_values(family, hf).items()
        if ckpt.get(key) != value
    ]
    for key, hf_key in (("attn_bias", "attn"), ("mlp_bias", "mlp")):
        built = ckpt.get(key, family.defaults[key])
        if built != biases[hf_key]:
            problems.append(
                f"config.json: {key} is {ckpt.get(key, f'absent (default {built})')}, so {family.trtllm_class} "
                f"{'builds' if built else 'drops'} those biases, but the model {'has' if biases[hf_key] else 'has no'} "
                "them"
            )
    if biases["mlp"] or (biases["attn"] and family.dense_bias != biases["dense"]):
        problems.append(
            f"the model's {'MLP' if biases['mlp'] else 'attention output'} biases are not modelled for "
            f"{family.trtllm_class} by this check"
        )
    return problems


def config_problems(ckpt: dict, hf: dict, cfg, biases: dict[str, bool], family: EngineFamily) -> list[str]:
    """Every config.json field TensorRT-LLM's config class for the family reads, against the model's true value."""
    heads = hf["num_attention_heads"]
    q, p = cfg.quantization, cfg.parallel
    want = {
        "architecture": hf["architectures"][0],  # what ModelOpt writes; MODEL_MAP resolves it to the class
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads", heads),
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "head_size": ModelFacts.from_hf_config(hf).head_size,
        "max_position_embeddings": hf["max_position_embeddings"],
        "hidden_act": hf.get("hidden_act", "silu"),
        "norm_epsilon": hf["rms_norm_eps"],
        "rotary_base": hf.get("rope_theta", 10000.0),
        "rotary_scaling": hf.get("rope_scaling"),
        "position_embedding_type": "rope_gpt_neox",
    }
    problems = [
        f"config.json: {key} is {ckpt.get(key)!r}, the model's value is {value!r}"
        for key, value in want.items()
        if _differs(ckpt.get(key), value)
        and not (
            key == "vocab_size"
            and ckpt.get(key) == padded_vocab(value, p.tp_size, ckpt.get("quantization", {}).get("quant_algo"))
        )
    ]
    problems += family_problems(ckpt, hf, biases, family)
    problems += mapping_problems(ckpt.get("mapping"), p.tp_size, p.pp_size)
    quant = ckpt.get("quantization", {})
    unknown = sorted(set(quant) - QUANT_CONFIG_KEYS)
    if unknown:
        problems.append(
            f"config.json: quantization has keys TensorRT-LLM's QuantConfig does not take (loading fails): {unknown}"
        )
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo in ("W4A16_AWQ", "W4A8_AWQ") and not quant.get("pre_quant_scale"):
        problems.append(f"config.json: {algo} needs quantization.pre_quant_scale: true")
    if algo not in QUANT_ALGOS:
        problems.append(f"config.json: quantization.quant_algo {algo!r} is not one of {sorted(map(str, QUANT_ALGOS))}")
    expected = EXPECTED_ALGO.get((q.weights, q.method))
    if algo != expected:
        problems.append(
            f"config.json: quantization.quant_algo is {algo!r}, but quantization {q.weights}/{q.method} needs "
            f"{expected!r}"
        )
    expected_kv = {"none": None, "fp8": "FP8", "int8": "INT8"}[q.kv_cache]
    if kv not in KV_CACHE_ALGOS or kv != expected_kv:
        problems.append(
            f"config.json: quantization.kv_cache_quant_algo is {kv!r}, but kv_cache {q.kv_cache} needs {expected_kv!r}"
        )
    problems += [
        f"config.json: {problem}"
        for problem in padding_problems(ModelFacts.from_hf_config(hf), p.tp_size, algo, quant.get("group_size") or 0)
    ]
    if algo in ("W4A16_AWQ", "W4A8_AWQ") and quant.get("group_size") != q.group_size:
        problems.append(
            f"config.json: quantization.group_size is {quant.get('group_size')}, the config asks {q.group_size}"
        )
    return problems


def mapping_problems(mapping, tp: int, pp: int) -> list[str]:
    """`mapping` against the parallel config: world/tp/pp sizes must match, no context parallelism (the pipeline
    builds none, and Mapping requires world_size == tp_size * pp_size * cp_size), and no key that some
    version's Mapping.__init__ lacks."""
    want = {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    if not isinstance(mapping, dict):
        return [f"config.json: mapping is {mapping!r}, expected a dict with {want}"]
    problems = []
    have = {key: mapping.get(key) for key in want}
    if have != want or mapping.get("cp_size", 1) != 1:
        problems.append(f"config.json: mapping is {mapping}, the parallel config needs {want} (and cp_size 1)")
    unknown = sorted(set(mapping) - MAPPING_KEYS)
    if unknown:
        problems.append(
            f"config.json: mapping has keys that TensorRT-LLM's Mapping does not take in every version tabulated "
            f"(loading fails where it lacks them): {unknown}"
        )
    return problems


def _differs(actual, wanted) -> bool:
    if isinstance(wanted, float) and isinstance(actual, (int, float)):
        return abs(actual - wanted) > 1e-9 * max(1.0, abs(wanted))
    return actual != wanted


def hf_config(hf_dir: Path) -> dict:
    """The model's config.json with the transformers defaults of the keys it omits (rms_norm_eps,
    max_position_embeddings, ...): the values the loaded model, and so ModelOpt's export, has."""
    from transformers import AutoConfig

    saved = json.loads((hf_dir / "config.json").read_text())
    return AutoConfig.from_pretrained(hf_dir).to_dict() | saved


def check_checkpoint(checkpoint: Path, hf_dir: Path, cfg) -> list[str]:
    """All problems found (empty when the checkpoint conforms)."""
    ckpt = json.loads((checkpoint / "config.json").read_text())
    hf = hf_config(hf_dir)
    try:
        family = engine_family(hf["architectures"][0], cfg.target.trtllm_version)
    except NotBuildable as e:
        return [f"{hf['architectures'][0]}: {e}"]
    problems = config_problems(ckpt, hf, cfg, hf_biases(hf_dir), family)
    if ckpt.get("dtype") not in ("float16", "bfloat16", "float32"):
        return problems + [f"config.json: dtype {ckpt.get('dtype')!r} is not float16, bfloat16 or float32"]
    world = ckpt["mapping"]["world_size"]
    files = sorted(checkpoint.glob("rank*.safetensors"))
    if [f.name for f in files] != [f"rank{r}.safetensors" for r in range(world)]:
        problems.append(
            f"expected rank0..rank{world - 1}.safetensors for world_size {world}, found {[f.name for f in files]}"
        )
    for rank in range(world):
        file = checkpoint / f"rank{rank}.safetensors"
        if not file.is_file():
            continue
        want = expected_tensors(ckpt, hf, rank, family)
        have = {name: (entry["dtype"], list(entry["shape"])) for name, entry in read_header(file)[0].items()}
        optional = {name for name, spec in want.items() if len(spec) == 3}
        want = {name: spec[:2] for name, spec in want.items()}
        for name in sorted(set(want) - set(have) - optional):
            problems.append(f"{file.name}: missing {name} ({want[name][0]} {want[name][1]})")
        for name in sorted(set(have) - set(want)):
            problems.append(
                f"{file.name}: stray tensor {name} ({have[name][0]} {have[name][1]}) that TensorRT-LLM does not declare"
            )
        for name in sorted(set(want) & set(have)):
            if ckpt.get("quantization", {}).get("quant_algo") == "W8A16" and have[name][0] == "I8":
                problems.append(
                    f"{file.name}: {name} is int8, but TensorRT-LLM's loader quantizes W8A16 weights itself and "
                    "leaves int8 ones without the per_channel_scale its WeightOnlyQuantLinear requires "
                    "(weight_only_quantize_dict); export float weights"
                )
            elif want[name] != have[name]:
                problems.append(
                    f"{file.name}: {name} is {have[name][0]} {have[name][1]}, TensorRT-LLM expects "
                    f"{want[name][0]} {want[name][1]}"
                )
    return problems
