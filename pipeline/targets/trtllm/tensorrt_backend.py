"""The trtllm target's `tensorrt` backend: TensorRT engines built by `trtllm-build`, served by Triton's C++
`tensorrtllm` backend (the engine workflow TensorRT-LLM 0.18 to 1.2 ship; removed from main in 2026).

The families it builds are those every stored version of TensorRT-LLM's MODEL_MAP gives a class whose checkpoint
layout is tabulated and ModelOpt 0.47 exports (pipeline/targets/trtllm/checkpoint.py engine_family, from
upstream/trtllm_engine_models.json): Llama, Mistral (LLaMAForCausalLM; its sliding window is the runtime's
max_attention_window_size) and Qwen2 (QWenForCausalLM); `architecture_support` names the source ruling out the rest.

The engine stage runs `trtllm-build` on the verified TensorRT-LLM checkpoint (here it stops with exit 4 and the
exact command). The Triton repository's `tensorrt_llm` model config has every tensor of the real template of the
targeted release (tabulated from the upstream backend and templates by scripts/dev/tabulate_trtllm_backend.py into
upstream/tensorrtllm_backend.json, which also lists the parameters the C++ backend cannot load without) and every
parameter filled from the build config and the engine's own recorded build config.

Guided decoding (structured outputs, 0.19 on) is on: the engine stage writes the xgrammar tokenizer info the C++
backend loads into the engine directory, and the model names it with `guided_decoding_backend: xgrammar`
(guided.py); a request then picks a guide with `guided_decoding_guide_type` / `guided_decoding_guide`.

LoRA (0.19 on, float16 engines): trtllm-build gets the LoRA plugin, modules and rank; the lora stage writes each
adapter's request tensors and the prefetch folder the model names in `lora_prefetch_dir`, so a request selects an
adapter by `lora_task_id` alone (lora_conversion.py).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import BuildStepError
from pipeline.targets import COMMON_FIELDS, TRITON_DEPLOY_FIELDS, Problem
from pipeline.targets.trtllm import lora_conversion
from pipeline.targets.trtllm.backend import (
    CHECKPOINT_FIELDS,
    GPU_DEPLOY_FIELDS,
    lacking,
)
from pipeline.targets.trtllm.checkpoint import EXPECTED_ALGO, padding_problems
from pipeline.targets.trtllm.guided import (
    TOKENIZER_INFO_FILE,
    engine_parameters,
    takes_guided_decoding,
    write_tokenizer_info,
)
from pipeline.targets.trtllm.image import whole_config_commands
from pipeline.targets.trtllm.modelopt import LOADER_QUANTIZED
from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS, required_parameters, template

EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
# Every template parameter neither template_parameters nor guided.engine_parameters /
# lora_conversion.engine_parameters fills is
# read inside a try block with a default (the table's optional_parameters), so leaving it out keeps the release's
# default: the lora_cache_* ones among them (upstream/trtllm_lora.json cache_parameters).
DTYPES = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}
# What the engine stage records beside trtllm-build's config.json for the runtime: the sliding window is no field of
# the checkpoint or the engine config (LLaMAConfig has none), so ModelRunnerCpp would attend to every cached token.
RUNTIME_FILE = "pipeline_runtime.json"


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
        "executor_worker_path": EXECUTOR_WORKER,
        "gpu_weights_percent": 1.0,
        "enable_context_fmha_fp32_acc": False,
        "multi_block_mode": True,
        "cuda_graph_mode": r.cuda_graph_mode,
        "cuda_graph_cache_size": r.cuda_graph_cache_size,
        "speculative_decoding_fast_logits": False,
        "tokenizer_dir": engine_dir,  # read without a fallback from 0.19 on, though unused by the C++ workflow
    }
    if r.max_tokens_in_paged_kv_cache:
        values["max_tokens_in_paged_kv_cache"] = r.max_tokens_in_paged_kv_cache
    facts = cfg.model_facts()
    if facts is not None and facts.sliding_window:
        # Mistral's window is no checkpoint field (LLaMAConfig has none: upstream/trtllm_engine_models.json); the engine
        # attends to the last max_attention_window_size tokens, which the backend reads from this parameter.
        values["max_attention_window_size"] = facts.sliding_window
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
    filled = (
        template_parameters(cfg, engine_dir, engine)
        | engine_parameters(cfg.target.trtllm_version, engine_dir)
        | lora_conversion.engine_parameters(cfg, engine_dir)
    )
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


# ---------------------------------------------------------------- engine (trtllm-build)


def _switch(flag: bool) -> str:
    return "enable" if flag else "disable"


def trtllm_build_command(cfg, checkpoint: Path, out_dir: Path) -> list[str]:
    """The `trtllm-build` invocation for the config.

    Every flag is one that tensorrt_llm/commands/build.py (parse_arguments) or plugin.py (add_plugin_argument)
    defines in every version tabulated into upstream/trtllm_build_flags.json by scripts/dev/tabulate_trtllm_build.py,
    with a value within its choices there (tests/targets/test_trtllm.py checks it); the LoRA flags where the config
    has a lora section.
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
        *lora_conversion.build_flags(cfg),
    ]


def missing_for_engine() -> list[str]:
    """What this machine lacks to run trtllm-build (empty on a GPU machine with TensorRT-LLM)."""
    import shutil

    return lacking(
        ("the trtllm-build command (pip install tensorrt_llm from NVIDIA's index)", shutil.which("trtllm-build")),
        ("an NVIDIA GPU (/dev/nvidia0)", Path("/dev/nvidia0").exists()),
    )


def build_engine(cfg, checkpoint: Path, tokenizer_dir: Path, out_dir: Path, final_dir: Path, log) -> dict:
    """Run trtllm-build into out_dir, or stop naming what this machine lacks; an engine is never faked. Beside it,
    the runtime record and, where the release decodes guided, the xgrammar tokenizer info of `tokenizer_dir`."""
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
            f"NVIDIA's TensorRT-LLM {cfg.target.trtllm_version} container:\n  {whole_config_commands(cfg)}"
        )
    log(shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise BuildStepError(f"trtllm-build failed ({result.returncode}):\n{result.stderr[-2000:]}")
    record_runtime(cfg, out_dir)
    if takes_guided_decoding(cfg.target.trtllm_version):
        write_tokenizer_info(tokenizer_dir, out_dir)
    return {"trtllm_build": shlex.join(command)}


def record_runtime(cfg, engine_dir: Path) -> dict:
    """Write RUNTIME_FILE: the uniform sliding window (ModelFacts.sliding_window) the runner must apply, as the
    Triton model's max_attention_window_size does."""
    import json

    facts = cfg.model_facts()
    window = facts.sliding_window if facts is not None else None
    recorded = {"max_attention_window_size": [window] if window else None}
    (engine_dir / RUNTIME_FILE).write_text(json.dumps(recorded, indent=2) + "\n")
    return recorded


def runner_options(engine_dir: Path, runtime) -> dict:
    """The keyword arguments load_runner passes to ModelRunnerCpp.from_dir.

    max_attention_window_size is a list (one window per layer, repeated over the layers) in from_dir's signature
    (tensorrt_llm/runtime/model_runner_cpp.py: `max_attention_window_size: Optional[list[int]]`, given to
    KvCacheConfig(max_attention_window=...)); an engine directory without RUNTIME_FILE attends to everything.
    """
    import json

    options = (
        {}
        if runtime is None
        else {
            "kv_cache_free_gpu_memory_fraction": runtime.kv_cache_free_gpu_mem_fraction,
            "enable_chunked_context": runtime.enable_chunked_context,
            "kv_cache_enable_block_reuse": runtime.enable_kv_cache_reuse,
            "cuda_graph_mode": runtime.cuda_graph_mode,
        }
    )
    recorded = engine_dir / RUNTIME_FILE
    window = json.loads(recorded.read_text()).get("max_attention_window_size") if recorded.is_file() else None
    if window:
        options["max_attention_window_size"] = window
    return options


# ---------------------------------------------------------------- the backend


class TensorrtBackend:
    name = "tensorrt"
    summary = "TensorRT engines (trtllm-build, Triton tensorrtllm backend)"
    releases = SUPPORTED_VERSIONS
    group_gateway = False  # a group's leader runs tritonserver's ranks under mpirun, not `serve`
    honours = (
        COMMON_FIELDS
        | CHECKPOINT_FIELDS
        | {
            "build",
            "runtime.batching_strategy",
            "runtime.kv_cache_free_gpu_mem_fraction",
            "runtime.enable_kv_cache_reuse",
            "runtime.cuda_graph_mode",
            "runtime.cuda_graph_cache_size",
            "runtime.streaming",
        }
        | GPU_DEPLOY_FIELDS
        | TRITON_DEPLOY_FIELDS
        | lora_conversion.backend_fields("tensorrt")
    )

    def engine_reads(self, cfg) -> tuple[str, ...]:
        # trtllm-build takes build, quantization, parallel and the LoRA modules and rank; runtime knobs go to
        # triton_repo, the adapters to the lora stage
        return lora_conversion.ENGINE_FIELDS if cfg.lora is not None else ()

    def missing(self) -> list[str]:
        return missing_for_engine()

    def architecture_support(self, cfg) -> dict[str, str | None]:
        """Supported: the architectures every stored MODEL_MAP gives a class whose checkpoint layout is tabulated
        and ModelOpt exports (trtllm_checkpoint.engine_family); the rest name the source that rules them out."""
        from pipeline.architectures import ARCHITECTURES
        from pipeline.targets.trtllm.checkpoint import NotBuildable, engine_family

        support: dict[str, str | None] = {}
        for name in ARCHITECTURES:
            try:
                engine_family(name, cfg.target.trtllm_version)
                support[name] = None
            except NotBuildable as e:
                support[name] = (
                    f"TensorRT-LLM {cfg.target.trtllm_version}'s engine workflow cannot take {name} here: {e}; "
                    "use target.trtllm_backend: pytorch"
                )
        return support

    def config_problems(self, cfg) -> list[Problem]:
        q, b, r = cfg.quantization, cfg.build, cfg.runtime
        out: list[Problem] = []
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
        if (q.weights, q.method) in LOADER_QUANTIZED and q.exclude_modules:
            out.append(
                (
                    ("quantization", "exclude_modules"),
                    "int8 weight-only checkpoints are quantized by TensorRT-LLM's loader, which quantizes every "
                    "attention and MLP linear (weight_only_quantize_dict); not every release reads an exclusion "
                    "list there, so remove exclude_modules or use fp8 or int4",
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
        if facts is not None and (q.weights, q.method) in EXPECTED_ALGO:
            algo = EXPECTED_ALGO[(q.weights, q.method)]
            out += [
                (("parallel", "tp_size"), f"{problem}; use a tp_size for which it divides, or fp8 / int8 smoothquant")
                for problem in padding_problems(facts, cfg.parallel.tp_size, algo, q.group_size)
            ]
        return out

    def writes(self, stage: str, cfg) -> str:
        ranks = cfg.parallel.tp_size * cfg.parallel.pp_size
        return {
            "export": f"TensorRT-LLM checkpoint (config.json, rank0..{ranks - 1}.safetensors; every tensor checked) "
            "and unified HF checkpoint",
            "engine": f"engine directory: config.json, rank*.engine, tokenizer, {RUNTIME_FILE} (sliding window)"
            + (
                f", {TOKENIZER_INFO_FILE} (guided decoding)" if takes_guided_decoding(cfg.target.trtllm_version) else ""
            ),
            "triton_repo": "Triton model repository (config.pbtxt per model; tensorrtllm backend LLM model)",
            "lora": f"{', '.join(lora_conversion.request_facts()['converter']['files'].values())} per adapter and "
            f"{lora_conversion.PREFETCH_DIR}/<task id>/ (lora_prefetch_dir)",
        }.get(stage, "")

    def export_problems(self, cfg, hf_dir: Path, export_dir: Path) -> list[str]:
        from pipeline.targets.trtllm.checkpoint import check_checkpoint

        return check_checkpoint(export_dir / "trtllm_checkpoint", hf_dir, cfg)

    def deployed_checkpoint(self, export_dir: Path) -> tuple[Path, str]:
        return export_dir / "trtllm_checkpoint", "trtllm"

    def build_engine(self, cfg, ctx) -> dict:
        return build_engine(
            cfg,
            ctx.upstream("export") / "trtllm_checkpoint",
            ctx.upstream("import"),
            ctx.out_dir,
            ctx.upstream("engine"),
            ctx.log,
        )

    def triton_models(self, cfg, engine_dir: Path, engine: dict) -> list:
        from pipeline.triton.repo import inflight_batcher_models

        return inflight_batcher_models(cfg, triton_llm_model(cfg, engine_dir, engine), engine_dir, engine)

    def load_runner(self, engine_dir: Path, engine: dict, runtime):
        from pipeline.errors import TargetUnavailable

        try:
            from tensorrt_llm.runtime import ModelRunnerCpp
        except ImportError:
            raise TargetUnavailable(
                f"{engine_dir} is a TensorRT-LLM engine; running it needs an NVIDIA GPU and the tensorrt_llm "
                "package, which this machine lacks"
            ) from None
        return ModelRunnerCpp.from_dir(str(engine_dir), **runner_options(engine_dir, runtime))

    def plan_notes(self, cfg, output: Path) -> list[str]:
        import shlex

        command = trtllm_build_command(
            cfg, (output / "export" / "trtllm_checkpoint").resolve(), (output / "engine").resolve()
        )
        return [
            f"engine command (TensorRT-LLM {cfg.target.trtllm_version}):\n  {shlex.join(command)}",
            f"or the whole config in NVIDIA's container:\n  {whole_config_commands(cfg)}",
        ]

    def memory_plan(self, cfg, facts):
        from pipeline.targets.trtllm.gpu_memory import plan_memory

        return plan_memory(cfg, facts)
