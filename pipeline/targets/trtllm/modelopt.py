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


class UnsupportedModelOpt(RuntimeError):
    """The installed ModelOpt's presets hold `quant_cfg` in a form `modelopt_config` does not write."""


def modelopt_config(q) -> dict:
    """The ModelOpt quantization config for the `quantization` section: a copy of the installed ModelOpt's preset with
    its int4 block size, the KV-cache quantizer and the excluded modules added, in the preset's own format. Up to
    ModelOpt 0.43 `quant_cfg` is a dict of pattern -> quantizer attributes (its key "default" applies first, the rest in
    order); from 0.44 a list of {quantizer_name, cfg and/or enable} entries applied in order (upstream/
    triton_trtllm_images.json `modelopt`: the presets read at each tag, and 0.44's changelog). Each container keeps
    the ModelOpt its TensorRT-LLM pins (0.37 on 1.1 and 1.2), our CPU environment has 0.47: both are written here.

    Raises UnsupportedModelOpt, naming the version and what was found, for a quant_cfg of neither form or of the form
    the table says that version does not have."""
    import copy

    import modelopt.torch.quantization as mtq

    version = installed_modelopt()
    key = (q.weights, q.method)
    preset = copy.deepcopy(getattr(mtq, MODELOPT_PRESETS[key] if key in MODELOPT_PRESETS else "FP8_DEFAULT_CFG"))
    form = quant_cfg_form(preset.get("quant_cfg"), version)
    if key in MODELOPT_PRESETS:
        quant_cfg, algorithm = preset["quant_cfg"], preset.get("algorithm", "max")
        for cfg in attribute_dicts(quant_cfg, form):
            if "block_sizes" in cfg:
                cfg["block_sizes"] = {**cfg["block_sizes"], -1: q.group_size}
    else:  # nothing quantized but what is added below
        quant_cfg, algorithm = (
            ([{"quantizer_name": "*", "enable": False}] if form == "list" else {"default": {"enable": False}}),
            "max",
        )
    if q.kv_cache != "none":
        kv = {"num_bits": (4, 3) if q.kv_cache == "fp8" else 8, "axis": None}
        add_entry(quant_cfg, form, KV_QUANTIZER, kv)
    for pattern in q.exclude_modules:
        add_entry(quant_cfg, form, f"*{pattern}*", None)
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def installed_modelopt() -> str:
    import modelopt

    return getattr(modelopt, "__version__", None) or "unknown"


def tabulated_quant_cfg_form(version: str) -> str | None:
    """'dict' or 'list': the quant_cfg format of ModelOpt `version` as tabulated (None for a version not parsed)."""
    from packaging.version import InvalidVersion, Version

    from pipeline.upstream import facts

    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    list_from = Version(facts("triton_trtllm_images")["modelopt"]["quant_cfg_list_from"]).release
    return "list" if release >= list_from else "dict"


def quant_cfg_form(quant_cfg, version: str) -> str:
    """'dict' or 'list': the form of a preset's quant_cfg, checked entry by entry and against the table."""
    if isinstance(quant_cfg, dict) and all(
        isinstance(name, str) and isinstance(cfg, (dict, list)) for name, cfg in quant_cfg.items()
    ):
        form = "dict"
    elif isinstance(quant_cfg, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("quantizer_name"), str) for entry in quant_cfg
    ):
        form = "list"
    else:
        raise UnsupportedModelOpt(
            f"ModelOpt {version}'s presets hold quant_cfg as {type(quant_cfg).__name__} "
            f"{str(quant_cfg)[:120]}: neither a dict of pattern -> attributes (up to 0.43) nor a list of "
            "{quantizer_name, cfg/enable} entries (from 0.44)"
        )
    expected = tabulated_quant_cfg_form(version)
    if expected and expected != form:
        raise UnsupportedModelOpt(
            f"ModelOpt {version}'s presets hold quant_cfg as a {form}, but the table (pipeline/upstream/"
            f"triton_trtllm_images.json `modelopt`) says ModelOpt {version} holds a {expected}: re-tabulate it"
        )
    return form


def attribute_dicts(quant_cfg, form: str) -> list[dict]:
    """The quantizer-attribute dicts of a quant_cfg (a W4A8 weight quantizer has a list of two)."""
    if form == "list":
        cfgs = [entry.get("cfg") for entry in quant_cfg]
    else:
        cfgs = list(quant_cfg.values())
    flat = [cfg for item in cfgs for cfg in (item if isinstance(item, list) else [item])]
    return [cfg for cfg in flat if isinstance(cfg, dict)]


def add_entry(quant_cfg, form: str, pattern: str, cfg: dict | None) -> None:
    """Append the quantizers matching `pattern`: quantized as `cfg`, or disabled (None). Applied after the preset's
    entries, so it overrides them: in a dict, the pattern is moved to the end."""
    if form == "list":
        quant_cfg.append({"quantizer_name": pattern, **({"cfg": cfg} if cfg else {"enable": False})})
    else:
        quant_cfg.pop(pattern, None)
        quant_cfg[pattern] = {**cfg, "enable": True} if cfg else {"enable": False}


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


def load_state(path: Path) -> dict:
    """The state `save_calibrated` wrote. `mto.load_modelopt_state` exists from ModelOpt 0.43 (tabulated:
    load_modelopt_state_from); before it, ModelOpt's own way is a torch.load of the whole dict (its
    restore_from_modelopt_state docstring at 0.37.0), which is what 0.43's loads and then validates."""
    import modelopt.torch.opt as mto
    import torch

    if hasattr(mto, "load_modelopt_state"):
        return mto.load_modelopt_state(path)
    return torch.load(path, map_location="cpu", weights_only=False)


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

    state = load_state(quantize_dir / STATE_FILE)
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
    from pipeline.targets.trtllm.unified_export import export_unified

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
        identity_pre_quant_scales(model)
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


def identity_pre_quant_scales(model) -> int:
    """Before the unified export under a ModelOpt older than `pre_quant_scale_optional_from` (0.45, tabulated from
    fuse_prequant_layernorm in modelopt/torch/export/quant_utils.py): that export folds the input quantizer's
    pre_quant_scale of a group of linears in an AWQ format into the layernorm before them and fails where there is
    none, as for int4 round-to-nearest, which it exports in that format (AttributeError: no _pre_quant_scale, under
    0.37). Give those linears the identity scale they stand for (ones, what repair_pre_quant_scale writes for 0.47's
    export): the fold then changes nothing. Returns how many were given one."""
    from packaging.version import InvalidVersion, Version

    from pipeline.upstream import facts

    fixed_in = facts("triton_trtllm_images")["modelopt"]["pre_quant_scale_optional_from"]
    try:
        if Version(installed_modelopt()).release >= Version(fixed_in).release:
            return 0
    except InvalidVersion:  # a ModelOpt of no version: the repair changes nothing where the export needs none
        pass
    import torch
    from modelopt.torch.export.quant_utils import get_quantization_format

    given = 0
    for module in model.modules():
        quantizer, weight = getattr(module, "input_quantizer", None), getattr(module, "weight", None)
        if quantizer is None or weight is None or getattr(quantizer, "pre_quant_scale", None) is not None:
            continue
        if "awq" in str(get_quantization_format(module)):
            quantizer.pre_quant_scale = torch.ones(weight.shape[1], dtype=weight.dtype, device=weight.device)
            given += 1
    return given


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
