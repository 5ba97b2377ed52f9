"""The `trtllm` target (GPU): TensorRT-LLM engines served by Triton's `tensorrtllm` backend.

This module holds what the target needs from the Triton repository stage: the `tensorrt_llm` model
config, with every tensor of the real template of the targeted release (tabulated from
tensorrtllm_backend by scripts/dev/tabulate_trtllm_template.py into tensorrt_llm_templates.json)
and every parameter filled from the build config and the engine's own recorded build config.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from pipeline.errors import StageError

TEMPLATES = Path(__file__).parent.parent / "triton" / "tensorrt_llm_templates.json"
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
# Template parameters left out on purpose: they switch on features this pipeline does not build
# (encoder-decoder, LoRA prefetch, speculative decoding, guided decoding, multi-node), and the
# backend reads an absent key as "off". Filling them with a placeholder would break the config.
OMITTED_PARAMETERS = {
    "encoder_model_path": "encoder-decoder models are not built",
    "cross_kv_cache_fraction": "encoder-decoder models only",
    "max_attention_window_size": "defaults to the engine's max_seq_len",
    "sink_token_length": "no attention sinks",
    "gpu_device_ids": "all visible GPUs",
    "participant_ids": "single-node orchestrator mode",
    "num_nodes": "single node",
    "lora_prefetch_dir": "no LoRA adapters",
    "decoding_mode": "chosen by the backend from the sampling parameters",
    "lookahead_window_size": "no lookahead decoding",
    "lookahead_ngram_size": "no lookahead decoding",
    "lookahead_verification_set_size": "no lookahead decoding",
    "medusa_choices": "no Medusa heads",
    "eagle_choices": "no EAGLE heads",
    "guided_decoding_backend": "no guided decoding",
    "xgrammar_tokenizer_info_path": "no guided decoding",
    "max_tokens_in_paged_kv_cache": "set runtime.max_tokens_in_paged_kv_cache to bound it; otherwise the free-memory fraction decides",
}
DTYPES = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}
# NGC tritonserver:<tag>-trtllm-python-py3 holding each TensorRT-LLM release (NVIDIA's Triton compatibility
# matrix; the 0.20 -> 25.06 row was checked here, the older rows are from the release notes' sequence).
TRITON_CONTAINERS = {"0.18": "25.03", "0.19": "25.05", "0.20": "25.06"}


def template(version: str) -> dict:
    templates = json.loads(TEMPLATES.read_text())
    if version not in templates:
        raise StageError("triton_repo", f"no tensorrt_llm template tabulated for TensorRT-LLM {version} (have: {', '.join(templates)}); "
                         "tabulate it with scripts/dev/tabulate_trtllm_template.py or target one of those")
    return templates[version]


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
    from pipeline.triton.repo import ModelSpec, model_config

    spec = template(cfg.target.trtllm_version)
    r, t = cfg.runtime, cfg.triton
    built = engine["build_config"]
    dtype = DTYPES.get(engine.get("pretrained_config", {}).get("dtype", "float16"), "TYPE_FP16")
    variables = {"${logits_datatype}": "TYPE_FP32", "${encoder_input_features_data_type}": dtype}
    config = model_config(t.llm_model_name, backend="tensorrtllm", max_batch_size=built["max_batch_size"], inputs=[], outputs=[],
                          decoupled=r.streaming, instances=t.llm_instance_count, queue_delay_us=r.max_queue_delay_microseconds,
                          max_queue_size=t.max_queue_size)
    config.dynamic_batching.preferred_batch_size.append(built["max_batch_size"])
    for row in spec["inputs"]:
        tensor = config.input.add(name=row["name"], data_type=mc.DataType.Value(variables.get(row["data_type"], row["data_type"])),
                                  dims=row["dims"], optional=row["optional"], allow_ragged_batch=row["allow_ragged_batch"])
        if "reshape" in row:
            tensor.reshape.shape.extend(row["reshape"])
    for row in spec["outputs"]:
        config.output.add(name=row["name"], data_type=mc.DataType.Value(variables.get(row["data_type"], row["data_type"])), dims=row["dims"])
    values = {k: v for k, v in template_parameters(cfg, engine_dir, engine).items() if k in spec["parameters"]}  # older templates lack some
    missing = set(spec["parameters"]) - set(values) - set(OMITTED_PARAMETERS)
    if missing:  # a newer template grew a key this table does not know: fail rather than deploy without it
        raise StageError("triton_repo", f"tensorrt_llm {cfg.target.trtllm_version} template parameters not filled: {sorted(missing)}")
    for key, value in values.items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return ModelSpec(config)


# ---------------------------------------------------------------- calibration and checkpoint export (ModelOpt)

# (weights, method) -> the ModelOpt preset; int4 presets get their block size from quantization.group_size.
MODELOPT_PRESETS = {
    ("fp8", "rtn"): "FP8_DEFAULT_CFG",
    ("int8", "smoothquant"): "INT8_SMOOTHQUANT_CFG",
    ("int8", "rtn"): "INT8_WEIGHT_ONLY_CFG",
    ("int4", "rtn"): "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    ("int4", "awq"): "INT4_AWQ_CFG",
    ("int4", "w4a8_awq"): "W4A8_AWQ_BETA_CFG",
}
KV_QUANTIZER = "*[kv]_bmm_quantizer"
CHECKPOINT_DTYPES = {"auto": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


# ModelOpt warnings that are expected here and say nothing actionable: it tries to import tensorrt_llm
# (absent on CPU) before writing config.json itself; the float32 import is exported as float16 on purpose;
# tied-weight deduplication and lm_head smoothing do not apply (lm_head stays unquantized).
BENIGN_MODELOPT_WARNINGS = ("Cannot export tensorrt_llm checkpoint config", "Model's original dtype", "may contain tied/shared weights",
                            "is not calibrated, skip smoothing", "Enable lm_head quantization", "Cannot export model to the model_config")


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
    if q.weights != "none":
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
        entries.append({"quantizer_name": KV_QUANTIZER, "cfg": {"num_bits": (4, 3) if q.kv_cache == "fp8" else 8, "axis": None}})
    entries += [{"quantizer_name": f"*{pattern}*", "enable": False} for pattern in q.exclude_modules]
    return {"quant_cfg": entries, "algorithm": algorithm}


def calibration_batches(tokenizer, text: str, num_samples: int, seq_len: int) -> list:
    """num_samples windows of seq_len tokens spread evenly over the calibration text (repeated if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    ids = ids.repeat(max(1, -(-2 * seq_len // len(ids))))
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).long().tolist()
    return [ids[start:start + seq_len].unsqueeze(0) for start in starts]


def calibrate(hf_dir: Path, q, text: str, progress) -> object:
    """The HF model with ModelOpt quantizers inserted and calibrated on CPU (float32 forward passes)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    calibration = q.calibration
    batches = calibration_batches(AutoTokenizer.from_pretrained(hf_dir), text, calibration.num_samples, calibration.seq_len)
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


def export_checkpoints(model, out_dir: Path, dtype: str, tp_size: int, pp_size: int) -> tuple[Path, Path]:
    """The TensorRT-LLM checkpoint (`trtllm_checkpoint/`) and the unified HF checkpoint (`hf_unified/`)
    from one calibration: the second is what TensorRT-LLM's PyTorch workflow, vLLM and SGLang load."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    torch_dtype = getattr(torch, dtype)
    checkpoint, unified = out_dir / "trtllm_checkpoint", out_dir / "hf_unified"
    with quiet_modelopt():
        export_tensorrt_llm_checkpoint(model, "llama", torch_dtype, checkpoint, inference_tensor_parallel=tp_size,
                                       inference_pipeline_parallel=pp_size)
        export_hf_checkpoint(model, torch_dtype, unified)
    repair_pre_quant_scale(checkpoint)
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
        missing = {name.removesuffix(".weights_scaling_factor") for name in tensors if name.endswith(".weights_scaling_factor")
                   and tensors[name].dim() == 2 and f"{name.removesuffix('.weights_scaling_factor')}.prequant_scaling_factor" not in tensors}
        if missing:
            dtype = getattr(torch, config["dtype"])
            tensors |= {f"{p}.prequant_scaling_factor": torch.ones(tensors[f"{p}.weight"].shape[1], dtype=dtype) for p in missing}
            save_file(tensors, file)
            repaired = True
    return repaired


# ---------------------------------------------------------------- engine (trtllm-build)


def _switch(flag: bool) -> str:
    return "enable" if flag else "disable"


def trtllm_build_command(cfg, checkpoint: Path, out_dir: Path) -> list[str]:
    """The `trtllm-build` invocation for the config (flags of tensorrt_llm/commands/build.py and plugin.py, 0.18-0.20)."""
    b = cfg.build
    return [
        "trtllm-build", f"--checkpoint_dir={checkpoint}", f"--output_dir={out_dir}",
        f"--max_batch_size={b.max_batch_size}", f"--max_input_len={b.max_input_len}", f"--max_seq_len={b.max_seq_len}",
        f"--max_num_tokens={b.max_num_tokens}", f"--max_beam_width={b.max_beam_width}", f"--kv_cache_type={b.kv_cache_type}",
        f"--gpt_attention_plugin={b.gpt_attention_plugin}", f"--gemm_plugin={b.gemm_plugin}",
        f"--context_fmha={_switch(b.context_fmha)}", f"--use_paged_context_fmha={_switch(b.use_paged_context_fmha)}",
        f"--use_fp8_context_fmha={_switch(b.use_fp8_context_fmha)}", f"--remove_input_padding={_switch(b.remove_input_padding)}",
        f"--tokens_per_block={b.tokens_per_block}", f"--multiple_profiles={_switch(b.multiple_profiles)}",
        f"--workers={cfg.parallel.tp_size * cfg.parallel.pp_size}",
    ]


def missing_for_engine() -> list[str]:
    """What this machine lacks to run trtllm-build (empty on a GPU machine with TensorRT-LLM)."""
    import shutil

    return [what for what, present in (("the trtllm-build command (pip install tensorrt_llm from NVIDIA's index)", shutil.which("trtllm-build")),
                                       ("an NVIDIA GPU (/dev/nvidia0)", Path("/dev/nvidia0").exists())) if not present]


def build_engine(cfg, checkpoint: Path, out_dir: Path, final_dir: Path, log) -> dict:
    """Run trtllm-build into out_dir, or stop naming what this machine lacks; an engine is never faked."""
    import shlex
    import subprocess

    from pipeline.errors import StageError, TargetUnavailable

    command = trtllm_build_command(cfg, checkpoint.resolve(), out_dir)
    missing = missing_for_engine()
    if missing:
        suggested = trtllm_build_command(cfg, checkpoint.resolve(), final_dir.resolve())
        tag = TRITON_CONTAINERS.get(cfg.target.trtllm_version, "<tag>")
        raise TargetUnavailable(f"the trtllm engine needs {' and '.join(missing)}. The checkpoint is built and verified: "
                                f"{checkpoint}; on a GPU machine run:\n  {shlex.join(suggested)}\nor build the whole config there in "
                                f"NVIDIA's tritonserver:{tag}-trtllm-python-py3 container: docker build --target gpu --build-arg "
                                f"TRITON_TAG={tag} --build-arg CONFIG=<config> .")
    log(shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise StageError("engine", f"trtllm-build failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return {"trtllm_build": shlex.join(command)}
