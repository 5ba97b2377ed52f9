"""PEFT LoRA adapters: what a directory holds, the modules of a base model an adapter may target, and why an adapter
cannot be applied to a model. Every target reads adapters through here; what it builds from them is its own.

An adapter directory is what PEFT's `save_pretrained` writes: `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, whose tensors `base_model.model.<module>.lora_A.weight`
[rank, in] and `...lora_B.weight` [out, rank] add (x @ A.T @ B.T) * scale to the module's output, scale being
lora_alpha / rank (lora_alpha / sqrt(rank) with use_rslora), both overridable per module by alpha_pattern and
rank_pattern (peft 0.21.2, `peft/tuners/lora/config.py` and `layer.py`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.models import ModelFacts

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The linear modules of a decoder layer an adapter may target, by HF name, and their place in the layer.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
# adapter_config.json settings whose effect no target applies, with the value that means "not used".
UNSUPPORTED_SETTINGS = {
    "use_dora": (False, "DoRA rescales the merged weight's columns, which an unmerged x·A·B path cannot"),
    "bias": ("none", "LoRA biases"),
    "lora_bias": (False, "LoRA biases"),
    "modules_to_save": (None, "fully trained copies of modules (a second lm_head or embedding per adapter)"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights (Conv1D layouts, as in GPT-2), which these models do not have"),
}
_TENSOR = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def module_shapes(facts: ModelFacts) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targetable linear module of one decoder layer."""
    q, kv = facts.num_attention_heads * facts.head_size, facts.num_key_value_heads * facts.head_size
    hidden, inter = facts.hidden_size, facts.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass
class Adapter:
    """One PEFT LoRA adapter: per (layer, module) its A [rank, in] and B [out, rank] with the scale folded into B."""

    path: Path
    config: dict
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module in self.weights}, key=LINEAR_MODULES.index)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def shapes(self) -> dict[tuple[int, str], tuple[list, list]]:
        return {key: (list(a.shape), list(b.shape)) for key, (a, b) in self.weights.items()}

    @property
    def base_model(self) -> str | None:
        return self.config.get("base_model_name_or_path")

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_config(path: Path) -> dict:
    """adapter_config.json of the adapter directory `path`. Raises PipelineError naming the file and what is wrong."""
    config_file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise PipelineError(
            f"{path}: not a directory; a LoRA adapter is a PEFT directory ({ADAPTER_CONFIG} + "
            f"{ADAPTER_WEIGHTS}, as peft's save_pretrained writes it)"
        )
    if not config_file.is_file():
        raise PipelineError(
            f"{config_file} not found: a LoRA adapter is a PEFT directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{config_file}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA").upper() != "LORA":
        raise PipelineError(f"{config_file}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    return config


@dataclass(frozen=True)
class Fit:
    """What an engine takes of an adapter: the model's sizes, the largest rank and the modules carrying LoRA."""

    facts: ModelFacts
    max_rank: int
    target_modules: list[str]


# The safetensors dtypes an adapter's weights may have: the floating-point ones numpy reads (no bfloat16).
FLOAT_DTYPES = ("F16", "F32", "F64")


def load(path: Path, fit: Fit | None = None) -> Adapter:
    """The adapter in `path`, its scales folded into B (float32). With `fit`, the safetensors header (names, dtypes,
    shapes, rank, modules) is checked against the engine before any tensor is read, so a forged or mismatched file
    costs no memory. Raises PipelineError naming the file, the tensor and the fix; a weight that is not finite is
    refused (it would turn its rows' outputs into NaN)."""
    from safetensors import SafetensorError, safe_open

    config = read_config(path)
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        found = sorted(p.name for p in path.iterdir())
        raise PipelineError(
            f"{weights_file} not found (the directory holds {found}); save the adapter with safetensors "
            "(peft's save_pretrained does by default)"
        )
    try:
        with safe_open(weights_file, framework="numpy") as file:
            pairs = _header_pairs(weights_file, file)
            if fit is not None:
                shapes = {key: (a[1], b[1]) for key, (a, b) in pairs.items()}
                found = header_problems(config, shapes, fit)
                if found:
                    raise PipelineError(f"{weights_file}: {'; '.join(found)}")
            weights = {}
            for (layer, module), ((a_name, _), (b_name, _)) in sorted(pairs.items()):
                a, b = _finite(weights_file, file, a_name), _finite(weights_file, file, b_name)
                weights[layer, module] = (a, b * np.float32(scale(config, f"model.layers.{layer}.{module}", len(a))))
    except (SafetensorError, OSError) as exc:
        raise PipelineError(f"{weights_file}: cannot read ({exc})") from None
    return Adapter(path, config, weights)


def _header_pairs(weights_file: Path, file) -> dict[tuple[int, str], tuple[tuple[str, list], tuple[str, list]]]:
    """Per (layer, module), the (name, shape) of its lora_A and lora_B, from the header alone."""
    halves: dict[tuple[int, str], dict[str, tuple[str, list]]] = {}
    for name in file.keys():
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise PipelineError(
                f"{weights_file}: tensor {name} is not the LoRA A or B of a decoder layer's linear module "
                f"({', '.join(LINEAR_MODULES)}); embedding and lm_head adapters are not served"
            )
        tensor = file.get_slice(name)
        if tensor.get_dtype() not in FLOAT_DTYPES:
            raise PipelineError(
                f"{weights_file}: tensor {name} is {tensor.get_dtype()}; LoRA weights must be "
                f"{', '.join(FLOAT_DTYPES)}: save the adapter in float16 or float32"
            )
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = (name, tensor.get_shape())
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise PipelineError(f"{weights_file}: layer {layer} {module} has lora_{''.join(pair)} alone")
        a, b = pair["A"][1], pair["B"][1]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise PipelineError(
                f"{weights_file}: layer {layer} {module}: lora_A {a} and lora_B {b} do not make a rank-r pair "
                "([r, in] and [out, r])"
            )
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}


def _finite(weights_file: Path, file, name: str) -> np.ndarray:
    tensor = file.get_tensor(name).astype(np.float32)
    if not np.isfinite(tensor).all():
        kind = "NaN" if np.isnan(tensor).any() else "an infinite value"
        raise PipelineError(
            f"{weights_file}: tensor {name} holds {kind}; a LoRA weight must be finite (the training diverged or "
            "the file is damaged): retrain or re-save the adapter"
        )
    return tensor


def scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / rank, or alpha / sqrt(rank) with use_rslora (alpha_pattern overrides
    lora_alpha for the modules its keys match, as rank_pattern does r; the rank is the weights')."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first key that matches the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def problems(adapter: Adapter, facts: ModelFacts, max_rank: int, target_modules: list[str]) -> list[str]:
    """Why `adapter` cannot be applied to a model of `facts` by an engine carrying LoRA on `target_modules` up to
    rank `max_rank` (empty when it can)."""
    return header_problems(adapter.config, adapter.shapes, Fit(facts, max_rank, target_modules))


def header_problems(config: dict, shapes: dict[tuple[int, str], tuple[list, list]], fit: Fit) -> list[str]:
    """Why an adapter of `config` whose lora_A / lora_B have `shapes` per (layer, module) cannot be applied by the
    engine `fit` describes (empty when it can); needs no tensor read."""
    out = []
    for key, (expected, why) in UNSUPPORTED_SETTINGS.items():
        if config.get(key, expected) not in (expected, [], {}):
            out.append(f"{ADAPTER_CONFIG} sets {key}: {config[key]!r}; {why} cannot be served; retrain without it")
    rank = max((a[0] for a, _ in shapes.values()), default=0)
    if rank > fit.max_rank:
        out.append(f"rank {rank} exceeds lora.max_lora_rank {fit.max_rank}; raise max_lora_rank to {rank}")
    facts, model_shapes = fit.facts, module_shapes(fit.facts)
    unknown = sorted({module for _, module in shapes if module not in model_shapes})
    if unknown:
        return out + [f"targets {unknown}, which this architecture does not have (it has {', '.join(model_shapes)})"]
    modules = sorted({module for _, module in shapes}, key=LINEAR_MODULES.index)
    missing = [m for m in modules if m not in fit.target_modules]
    if missing:
        out.append(f"targets {missing}, which lora.target_modules {fit.target_modules} leaves out; add them")
    base = config.get("base_model_name_or_path")
    base = f" (the adapter was trained on {base})" if base else ""
    for (layer, module), (a, b) in sorted(shapes.items()):
        if layer >= facts.num_hidden_layers:
            out.append(
                f"has weights for layer {layer}, the model has {facts.num_hidden_layers} layers: a base-model "
                f"mismatch{base}"
            )
            break
        fan_in, fan_out = model_shapes[module]
        if a[1] != fan_in or b[0] != fan_out:
            out.append(
                f"layer {layer} {module}: lora_A {list(a)} and lora_B {list(b)} do not fit the model's "
                f"{module} ({fan_in} in, {fan_out} out): a base-model mismatch{base}"
            )
            break
    return out
