"""The unified HF checkpoint (`export/hf_unified/`) against what TensorRT-LLM's PyTorch backend reads, on CPU.

TensorRT-LLM 1.x's PyTorch backend (LLM API, `trtllm-serve`) loads a ModelOpt unified checkpoint directly. What it
requires is tabulated from its source by scripts/dev/tabulate_trtllm_torch_loader.py into trtllm_torch_loader.json
(per release: the hf_quant_config.json keys read, the LinearMethod each quant_algo gets or the ValueError it raises,
the tensors each method's loaders read next to `weight` without a fallback, the dtypes they assert). The shapes
are ModelOpt's layout, derived from config.json and group_size. Whether the deployed values are good is measured on
the unified checkpoint itself: pipeline/trtllm_reference.py load_unified_reference (checkpoint_report kind="unified").
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from pipeline.models import ModelFacts
from pipeline.trtllm_checkpoint import EXPECTED_ALGO

TABLE = json.loads((Path(__file__).parent / "trtllm_torch_loader.json").read_text())
RELEASES = tuple(TABLE)
# HF Llama linears; the PyTorch backend fuses q/k/v into qkv_proj and gate/up into gate_up_proj (their fused
# loaders) and loads o_proj / down_proj alone (load_weights_vanilla).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
VANILLA = ("o_proj", "down_proj")
INT = ("I8", "U8")  # int4 pairs packed in a byte (ModelOpt writes U8; the loader takes .to(torch.int8))
FLOAT = ("F32", "F16", "BF16")
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SCALAR = ([], [1])


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
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
    }
    return {
        f"model.layers.{i}.{'self_attn' if short in ATTENTION else 'mlp'}.{short}": sizes[short]
        for i in range(facts.num_hidden_layers)
        for short in ATTENTION + MLP
    }


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


def _headers(unified_dir: Path) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    out = {}
    for file in sorted(unified_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (piece.get_dtype(), list(piece.get_shape()))
    return out


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, f"*{p}*") for p in patterns)


def torch_loader_problems(unified_dir: Path, release: str) -> list[str]:
    """Everything in `unified_dir` TensorRT-LLM `release`'s PyTorch backend would fail on or misread."""
    if release not in TABLE:
        return [f"TensorRT-LLM {release}: no PyTorch-backend facts tabulated (have {', '.join(RELEASES)})"]
    facts = TABLE[release]
    config = json.loads((unified_dir / "config.json").read_text())
    tensors = _headers(unified_dir)
    if not tensors:
        return [f"{unified_dir}: no *.safetensors"]
    problems: list[str] = []
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
            f"{release} reads ModelOpt configs only from hf_quant_config.json ({facts['quant_config_source'][0]})"
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
    for module, (out, inp) in linear_shapes(config).items():
        short = module.rsplit(".", 1)[1]
        weight = tensors.get(f"{module}.weight")
        if weight is None:
            problems.append(f"missing {module}.weight")
            continue
        if algo is None or _excluded(module, patterns):
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
            for name, why in reads["required"].items()
            if not why.startswith("load_weights_vanilla") or name == "weight_scale" or short in VANILLA
        }
        for name in ["weight", *sorted(required | set(reads["optional"]))]:
            full = f"{module}.{name}"
            if name in ("k_scale", "v_scale") and short != name[0] + "_proj":
                continue
            if full not in tensors:
                if name in required or name == "weight":
                    why = reads["required"].get(name, "the linear's weight")
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
            assertion = reads["dtypes"].get(name)
            if assertion and "module.dtype" in assertion and model_dtype and have_dtype != model_dtype:
                problems.append(
                    f"{full} is {have_dtype} but the model dtype is {model_dtype}: {row['method']} asserts "
                    f"`{assertion}`"
                )
    return problems


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


def export_unified(model, dtype, unified_dir: Path) -> list[str]:
    """ModelOpt's unified HF checkpoint of the calibrated `model` in `dtype` (a torch dtype); returns the identity
    pre_quant_scale tensors repair_pre_quant_scale added (int4 round-to-nearest).

    export_hf_checkpoint's dtype only casts the weights it quantizes: everything else (norms, embeddings, lm_head,
    pre_quant_scale) and config.json's dtype are saved as the model holds them, float32 after the CPU calibration.
    So the model is cast first. This mutates `model` (as export_hf_checkpoint itself does): call it after the
    TensorRT-LLM checkpoint export."""
    from modelopt.torch.export import export_hf_checkpoint

    model.to(dtype)
    export_hf_checkpoint(model, dtype, unified_dir)
    return repair_pre_quant_scale(unified_dir)


def repair_pre_quant_scale(unified_dir: Path) -> list[str]:
    """Write the identity pre_quant_scale (ones, in the model dtype of config.json, which W4A8_AWQ_LinearMethod
    asserts) that ModelOpt leaves out for int4 round-to-nearest on the linears the W4A16_AWQ loader reads it from;
    returns the tensors written. export_checkpoints calls it on `hf_unified/` right after export_hf_checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    quant_file = unified_dir / "hf_quant_config.json"
    if not quant_file.is_file():
        return []
    quant = json.loads(quant_file.read_text()).get("quantization", {})
    if quant.get("quant_algo") not in ("W4A16_AWQ", "W4A8_AWQ"):
        return []
    config = json.loads((unified_dir / "config.json").read_text())
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float16")
    written = []
    for file in sorted(unified_dir.glob("*.safetensors")):
        tensors = load_file(file)
        for name in list(tensors):
            prefix = name.removesuffix(".weight_scale")
            if (
                name.endswith(".weight_scale")
                and prefix.rsplit(".", 1)[-1] in VANILLA
                and f"{prefix}.pre_quant_scale" not in tensors
            ):
                packed = tensors[f"{prefix}.weight"]
                tensors[f"{prefix}.pre_quant_scale"] = torch.ones(packed.shape[1], dtype=dtype)
                written.append(f"{prefix}.pre_quant_scale")
        if written:
            save_file(tensors, file, metadata={"format": "pt"})
    return written
