"""ModelOpt calibration on CPU and the export of both checkpoints (TensorRT-LLM's and the unified HF one), with
the repairs a release's loader needs; shared by both backends (stages quantize and export)."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

from pipeline.fetch import calibration_windows
from pipeline.targets.trtllm.checkpoint import EXPECTED_ALGO, EngineFamily

# (weights, method) -> the ModelOpt preset; int4 presets get their block size from quantization.group_size.
MODELOPT_PRESETS = {
    ("fp8", "rtn"): "FP8_DEFAULT_CFG",
    ("int8", "smoothquant"): "INT8_SMOOTHQUANT_CFG",
    ("int4", "rtn"): "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    ("int4", "awq"): "INT4_AWQ_CFG",
    ("int4", "w4a8_awq"): "W4A8_AWQ_BETA_CFG",
}
# Weights TensorRT-LLM's checkpoint loader quantizes itself: `weight_only_quantize_dict` (models/convert_utils.py,
# called by preprocess_weights) quantizes W8A16 weights only when they are not int8 already, so ModelOpt's
# int8 + weights_scaling_factor export cannot load; TensorRT-LLM's own ModelOpt flow exports int8_wo unquantized
# too (quantization/quantize_by_modelopt.py). We export float weights and declare the algorithm.
LOADER_QUANTIZED = {("int8", "rtn")}  # declared as EXPECTED_ALGO says (W8A16)


def loader_quantized(q) -> str | None:
    """The quant_algo to declare for float weights TensorRT-LLM's loader quantizes, or None."""
    return EXPECTED_ALGO[(q.weights, q.method)] if (q.weights, q.method) in LOADER_QUANTIZED else None


KV_QUANTIZER = "*[kv]_bmm_quantizer"
CHECKPOINT_DTYPES = {"auto": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


# ModelOpt warnings that are expected here and say nothing actionable: it tries to import tensorrt_llm
# (absent on CPU) before writing config.json itself; the float32 import is exported as float16 on purpose;
# tied-weight deduplication and lm_head smoothing do not apply (lm_head stays unquantized).
BENIGN_MODELOPT_WARNINGS = (
    "Cannot export tensorrt_llm checkpoint config",
    "Model's original dtype",
    "may contain tied/shared weights",
    "is not calibrated, skip smoothing",
    "Enable lm_head quantization",
    "Cannot export model to the model_config",
)


@contextmanager
def quiet_modelopt():
    with warnings.catch_warnings():
        for message in BENIGN_MODELOPT_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{message}.*")
        yield


def modelopt_config(q) -> dict:
    """The ModelOpt quantization config for the `quantization` section (a copy of a preset, adjusted)."""
    import copy

    import modelopt.torch.quantization as mtq

    entries = []
    if (q.weights, q.method) in MODELOPT_PRESETS:
        preset = copy.deepcopy(getattr(mtq, MODELOPT_PRESETS[(q.weights, q.method)]))
        entries = preset["quant_cfg"]
        for entry in entries:
            for cfg in entry.get("cfg") if isinstance(entry.get("cfg"), list) else [entry.get("cfg")]:
                if isinstance(cfg, dict) and "block_sizes" in cfg:
                    cfg["block_sizes"] = {**cfg["block_sizes"], -1: q.group_size}
        algorithm = preset.get("algorithm", "max")
    else:
        entries, algorithm = [{"quantizer_name": "*", "enable": False}], "max"
    if q.kv_cache != "none":
        entries.append(
            {"quantizer_name": KV_QUANTIZER, "cfg": {"num_bits": (4, 3) if q.kv_cache == "fp8" else 8, "axis": None}}
        )
    entries += [{"quantizer_name": f"*{pattern}*", "enable": False} for pattern in q.exclude_modules]
    return {"quant_cfg": entries, "algorithm": algorithm}


def calibrate(hf_dir: Path, q, text: str, progress) -> object:
    """The HF model with ModelOpt quantizers inserted and calibrated on CPU (float32 forward passes)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    calibration = q.calibration
    batches = calibration_windows(
        AutoTokenizer.from_pretrained(hf_dir), text, calibration.num_samples, calibration.seq_len
    )
    if q.modelopt_recipe:
        from modelopt.recipe.loader import load_recipe

        config = load_recipe(q.modelopt_recipe).quantize.model_dump()
    else:
        config = modelopt_config(q)
    algorithm = config.get("algorithm") or "max"
    algorithm = algorithm.get("method", "max") if isinstance(algorithm, dict) else algorithm
    passes = 2 if algorithm != "max" else 1  # AWQ/SmoothQuant search, then calibrate

    def forward_loop(m):
        with torch.no_grad():
            for batch in progress(batches, f"calibrating ({algorithm})", total=len(batches) * passes):
                m(batch)

    with quiet_modelopt():
        return mtq.quantize(model, config, forward_loop)


def save_calibrated(model, out_dir: Path) -> None:
    """ModelOpt's state (quantizer placement and amax values) next to nothing else: the weights stay in `import`."""
    import modelopt.torch.opt as mto

    mto.save(model, out_dir / "modelopt_state.pth")


def load_calibrated(hf_dir: Path, quantize_dir: Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if quantize_dir is not None:
        import modelopt.torch.opt as mto

        model = mto.restore(model, quantize_dir / "modelopt_state.pth")
    return model


def export_checkpoints(
    model,
    out_dir: Path,
    dtype: str,
    tp_size: int,
    pp_size: int,
    loader_quantized: str | None,
    trtllm_release: str | None,
) -> None:
    """The unified HF checkpoint (`hf_unified/`: what TensorRT-LLM's PyTorch backend, vLLM and SGLang load) and,
    for a `trtllm_release`, the TensorRT-LLM checkpoint (`trtllm_checkpoint/`, what that release's trtllm-build reads)
    from one calibration, exported with the decoder type ModelOpt's table gives the family.
    `loader_quantized` is the quant_algo declared for float weights TensorRT-LLM's engine loader quantizes."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from pipeline.targets.trtllm.checkpoint import engine_family
    from pipeline.targets.trtllm.torch_checkpoint import export_unified

    torch_dtype = getattr(torch, dtype)
    checkpoint = out_dir / "trtllm_checkpoint"
    hf_config = model.config.to_dict()
    family = engine_family(hf_config["architectures"][0], trtllm_release) if trtllm_release else None
    with quiet_modelopt():
        if family:
            export_tensorrt_llm_checkpoint(
                model,
                family.decoder_type,
                torch_dtype,
                checkpoint,
                inference_tensor_parallel=tp_size,
                inference_pipeline_parallel=pp_size,
            )
        export_unified(model, torch_dtype, out_dir / "hf_unified")  # last: it casts the model to the dtype
    if not family:
        return
    repair_pre_quant_scale(checkpoint)
    repair_family_keys(checkpoint, hf_config, family)
    if loader_quantized:
        config_file = checkpoint / "config.json"
        config = json.loads(config_file.read_text())
        config["quantization"] = {**(config.get("quantization") or {}), "quant_algo": loader_quantized}
        config_file.write_text(json.dumps(config, indent=4))


def repair_family_keys(checkpoint: Path, hf_config: dict, family: EngineFamily) -> bool:
    """ModelOpt 0.47 writes the TensorRT-LLM config by hand without tensorrt_llm installed and leaves out the keys a
    family's class reads without a default (QWenConfig's `qwen_type`, which QWenDecoderLayer branches on and
    from_hugging_face takes from the HF model_type): write them as from_hugging_face would."""
    from pipeline.targets.trtllm.checkpoint import family_values

    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    missing = {k: v for k, v in family_values(family, hf_config).items() if k not in config}
    if missing:
        config_file.write_text(json.dumps(config | missing, indent=4))
    return bool(missing)


def repair_pre_quant_scale(checkpoint: Path) -> bool:
    """ModelOpt 0.47 declares `pre_quant_scale: true` for int4 round-to-nearest but writes no
    `prequant_scaling_factor` tensors, which TensorRT-LLM's AWQ layers then require: write the
    identity factors (ones) it implies, per rank and linear."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    if not config.get("quantization", {}).get("pre_quant_scale"):
        return False
    repaired = False
    for file in sorted(checkpoint.glob("rank*.safetensors")):
        tensors = load_file(file)
        missing = {
            name.removesuffix(".weights_scaling_factor")
            for name in tensors
            if name.endswith(".weights_scaling_factor")
            and tensors[name].dim() == 2
            and f"{name.removesuffix('.weights_scaling_factor')}.prequant_scaling_factor" not in tensors
        }
        if missing:
            dtype = getattr(torch, config["dtype"])
            tensors |= {
                f"{p}.prequant_scaling_factor": torch.ones(tensors[f"{p}.weight"].shape[1], dtype=dtype)
                for p in missing
            }
            save_file(tensors, file)
            repaired = True
    return repaired
