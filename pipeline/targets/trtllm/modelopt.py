"""ModelOpt calibration on CPU and the export of both checkpoints (TensorRT-LLM's and the unified HF one), with
the repairs a release's loader needs; shared by both backends (stages quantize and export)."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

from pipeline.fetch import calibration_windows
from pipeline.targets.trtllm.checkpoint import EXPECTED_ALGO, EngineFamily
from pipeline.targets.trtllm.dtypes import checkpoint_dtype

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


MODELOPT_MODULES = ("modelopt.torch.opt", "modelopt.torch.quantization", "modelopt.torch.export")


def import_modelopt() -> None:
    """Import ModelOpt on a thread of its own, before the caller holds a model. Its dependency pulp keeps the
    ImportError of each optional solver it lacks, traceback included, as a class attribute (`err = e`,
    pulp/apis/cplex_api.py, pulp 3.3.2, imported by modelopt/torch/opt/searcher.py): every frame that was importing
    it stays alive with its locals, which on the stage's thread held the calibrated model for the rest of the build.
    An import that fails fails again, with its message, where the caller imports the module."""
    import importlib
    import threading

    thread = threading.Thread(target=lambda: [importlib.import_module(name) for name in MODELOPT_MODULES])
    thread.start()
    thread.join()


def calibrate(hf_dir: Path, q, text: str, progress) -> object:
    """The HF model with ModelOpt quantizers inserted and calibrated on CPU (float32 forward passes)."""
    import_modelopt()
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


STATE_FILE = "modelopt_state.pth"
QUANTIZER_BUFFERS = "modelopt_state_weights"  # the key ModelOpt's own trainer stores them under (see save_calibrated)
REWRITTEN_WEIGHTS = "rewritten_weights"


def save_calibrated(model, hf_dir: Path, out_dir: Path) -> int:
    """ModelOpt's state of the calibrated `model` without its weights, which stay in `import`: the quantizer placement
    (`mto.modelopt_state`) and the quantizers' calibrated buffers (amax, pre_quant_scale), as ModelOpt's QATTrainer
    saves them (`_save_modelopt_state_with_weights`, modelopt/torch/quantization/plugins/transformers_trainer.py,
    nvidia-modelopt 0.47.0), plus any weight the calibration changed in a way `restored_weight` does not reproduce
    from `hf_dir` (none for the presets; kept so that a recipe's algorithm that rewrites weights still exports what it
    calibrated). Returns how many weights were kept."""
    import modelopt.torch.opt as mto
    import torch
    from modelopt.torch.quantization.utils import get_quantizer_state_dict

    state = mto.modelopt_state(model)
    state[QUANTIZER_BUFFERS] = get_quantizer_state_dict(model)
    state[REWRITTEN_WEIGHTS] = rewritten_weights(model, hf_dir)
    torch.save(state, out_dir / STATE_FILE)
    return len(state[REWRITTEN_WEIGHTS])


def load_calibrated(hf_dir: Path, quantize_dir: Path | None):
    """The imported model in the dtype it is stored in (a bfloat16 checkpoint is not upcast: float32 would double it)
    with the quantizers calibrated in `quantize_dir` restored onto it: ModelOpt's placement, then their buffers, then
    the weights smoothed by their pre_quant_scale as the calibration left them (rounded to that dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    import_modelopt()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, checkpoint_dtype(hf_dir))).eval()
    if quantize_dir is None:
        return model
    import modelopt.torch.opt as mto
    from modelopt.torch.quantization.utils import set_quantizer_state_dict

    state = mto.load_modelopt_state(quantize_dir / STATE_FILE)
    buffers, rewritten = state.pop(QUANTIZER_BUFFERS), state.pop(REWRITTEN_WEIGHTS)
    model = mto.restore_from_modelopt_state(model, state)
    set_quantizer_state_dict(model, buffers)
    with torch.no_grad():
        for linear in smoothed_linears(model):
            linear.weight.copy_(restored_weight(linear.weight, linear))
        for name, weight in rewritten.items():
            model.get_parameter(name).copy_(weight)
    return model


def smoothed_linears(model):
    """The quantized linears whose input quantizer applies a pre_quant_scale: SmoothQuant and AWQ fold its inverse
    into the weight (`apply_pre_quant_scale_and_smooth`, modelopt/torch/quantization/model_calib.py, nvidia-modelopt
    0.47.0), which `load_calibrated` repeats on the imported weight."""
    return [
        module
        for module in model.modules()
        if getattr(getattr(module, "input_quantizer", None), "pre_quant_scale", None) is not None
    ]


def restored_weight(original, linear):
    """`original` (the imported weight of `linear`) as the calibration left it: divided by the input's pre_quant_scale
    with ModelOpt's arithmetic (`_apply_weight_pre_quant_scale`: the float32 inverse, the product cast to the weight's
    dtype), so that a float32 import gives the calibrated weight bit for bit."""
    import torch

    scale = getattr(getattr(linear, "input_quantizer", None), "pre_quant_scale", None)
    if scale is None:
        return original
    return (original * (1.0 / scale.to(torch.float32)).squeeze()[None, :]).to(original.dtype)


def rewritten_weights(model, hf_dir: Path) -> dict:
    """The parameters of the calibrated `model` that `load_calibrated` would not reproduce from the checkpoint in
    `hf_dir`, in the dtype it loads; read one tensor at a time."""
    import torch
    from safetensors import safe_open

    dtype = getattr(torch, checkpoint_dtype(hf_dir))
    stored_in = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            stored_in |= dict.fromkeys(f.keys(), file)
    out = {}
    for name, parameter in model.named_parameters():
        calibrated = parameter.detach().to(dtype)
        if name in stored_in:
            with safe_open(stored_in[name], "pt") as f:
                imported = f.get_tensor(name).to(dtype)
            module_name, kind = name.rsplit(".", 1)
            if kind == "weight":
                imported = restored_weight(imported, model.get_submodule(module_name))
            if torch.equal(imported, calibrated):
                continue
        out[name] = calibrated.clone()
    return out


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
