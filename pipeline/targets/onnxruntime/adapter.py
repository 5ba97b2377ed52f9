"""The `onnxruntime` target (CPU): an ONNX decoder quantized by ONNX Runtime, served by Triton's python backend.

export: the fused graph of `graph.py` (every registered family) or optimum-onnx's export
(`target.onnx_graph`), checked against transformers' logits; engine: ORT weight-only quantization
(MatMulNBits, `quantize.py`), quality-gated against the exported fp32 graph (`scoring.py`); Triton: a decoupled
python model running `pipeline.targets.onnxruntime.runtime.scheduler` over the ModelRunner.

Why these tools (measured, see docs/research/onnx-export-study.md): optimum-onnx 0.1.0 runs with the
transformers 4.57 that the GGUF import and ModelOpt need, and its graph keeps the standard
`past_key_values.*` / `present.*` interface; ORT's MatMulNBits weight-only quantization kept
SmolLM2's perplexity within +0.3% at 8 bits where dynamic INT8 (weights and activations) cost +73%.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from pipeline import prequantized
from pipeline.errors import BuildStepError
from pipeline.targets import COMMON_FIELDS, TRITON_DEPLOY_FIELDS
from pipeline.targets.onnxruntime import ONNX_NAME

LLM_MODEL_FILE = Path(__file__).with_name("triton_model.py")
# Short, varied prompts for the export check: plain prose, code-like text and the chat template's special tokens.
CHECK_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


def choose_graph(hf_dir: Path, wanted: str) -> tuple[str, str | None]:
    """('fused' or 'optimum', why not fused) for target.onnx_graph ('auto': fused when the checkpoint allows it)."""
    from pipeline.targets.onnxruntime import graph as fused_onnx

    why_not = fused_onnx.supports(hf_dir)
    if wanted == "fused" and why_not:
        raise BuildStepError(f"target.onnx_graph is 'fused' but {why_not}; set target.onnx_graph: optimum (or auto)")
    return ("optimum" if wanted == "optimum" or why_not else "fused"), why_not


def export_decoder(hf_dir: Path, out_dir: Path, graph: str = "optimum", lora_modules: list[str] = ()) -> dict:
    """Export a causal LM to one ONNX decoder with KV cache in out_dir (tokenizer files stay upstream); the fused
    graph carries multi-LoRA on `lora_modules`."""
    import onnx

    started = time.perf_counter()
    if graph == "fused":
        from pipeline.targets.onnxruntime import graph as fused_onnx

        fused_onnx.build(hf_dir, out_dir / ONNX_NAME, lora_modules)
    else:
        _optimum_export(hf_dir, out_dir)
    onnx.checker.check_model(str(out_dir / ONNX_NAME))  # path form: works past protobuf's 2 GB limit
    model = onnx.load(str(out_dir / ONNX_NAME), load_external_data=False)
    return {
        "graph": graph,
        "export_seconds": round(time.perf_counter() - started, 1),
        "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "onnx_bytes": sum(f.stat().st_size for f in out_dir.glob("model.onnx*")),
        "inputs": len(model.graph.input),
        "outputs": len(model.graph.output),
    }


def _optimum_export(hf_dir: Path, out_dir: Path) -> None:
    from optimum.exporters.onnx import main_export

    work = out_dir / "optimum"
    main_export(str(hf_dir), output=str(work), task="text-generation-with-past", do_validation=False, device="cpu")
    onnx_files = list(work.glob("*.onnx"))
    if [f.name for f in onnx_files] != [ONNX_NAME]:
        raise BuildStepError(f"optimum-onnx wrote {[f.name for f in onnx_files]}, expected one {ONNX_NAME}")
    for file in work.glob("model.onnx*"):
        file.rename(out_dir / file.name)
    shutil.rmtree(work)


def compare_logits(hf_dir: Path, onnx_path: Path, prompts: list[str]) -> float:
    """Largest |logit difference| between ONNX Runtime and transformers (fp32, run first and freed) over the prompts;
    BuildStepError names the first logit either computes as NaN or infinity (their difference would be NaN)."""
    import numpy as np
    from transformers import AutoTokenizer

    from pipeline.nonfinite import nonfinite_weight
    from pipeline.quality import nonfinite_logits
    from pipeline.targets.onnxruntime.scoring import ort_logits_fn
    from pipeline.torch_models import hf_logits

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    inputs = [np.asarray([tokenizer(p, add_special_tokens=False)["input_ids"]], dtype=np.int64) for p in prompts]
    expected = hf_logits(hf_dir, inputs)  # one model at a time: the ONNX graph loads once transformers' is freed
    engine, worst = ort_logits_fn(onnx_path), 0.0
    for number, (prompt, ids, reference_logits) in enumerate(zip(prompts, inputs, expected)):
        logits = {"transformers'": reference_logits, "ONNX Runtime's": engine(ids)}
        for name, values in logits.items():
            if problem := nonfinite_logits(name, values, f"check prompt {number} ({prompt!r})"):
                cause = "the export is wrong" if name == "ONNX Runtime's" else f"the checkpoint in {hf_dir} computes it"
                weight = nonfinite_weight(hf_dir)
                raise BuildStepError(
                    f"{problem}; " + (f"the imported checkpoint is the cause: {weight}" if weight else cause)
                )
        worst = max(worst, float(np.abs(logits["transformers'"] - logits["ONNX Runtime's"]).max()))
    return worst


def engine_config(cfg, hf_config: dict, generation: dict) -> dict:
    """The engine's self-description, with TensorRT-LLM's top-level keys, so the Triton repository, the
    runner and the benchmarks read limits from the engine instead of re-typed numbers."""
    from importlib import metadata

    import pipeline
    from pipeline.models import ModelFacts

    q, b = cfg.quantization, cfg.build
    facts = ModelFacts.from_hf_config(hf_config)
    return {
        "version": pipeline.__version__,
        "target": OnnxRuntimeTarget.name,
        "onnxruntime_version": metadata.version("onnxruntime"),
        "pretrained_config": {
            "architecture": facts.architecture,
            "dtype": "float32",
            "vocab_size": facts.vocab_size,
            "hidden_size": facts.hidden_size,
            "intermediate_size": facts.intermediate_size,
            "num_hidden_layers": facts.num_hidden_layers,
            "num_attention_heads": facts.num_attention_heads,
            "num_key_value_heads": facts.num_key_value_heads,
            "head_size": facts.head_size,
            "max_position_embeddings": facts.max_position_embeddings,
            "rotary_base": hf_config.get("rope_theta", 10000.0),
            "norm_epsilon": hf_config.get("rms_norm_eps"),
            "tie_word_embeddings": hf_config.get("tie_word_embeddings", False),
            "quantization": {
                "weights": q.weights,
                "group_size": q.group_size if q.weights != "none" else None,
                "exclude_modules": q.exclude_modules,
                "int8_modules": q.int8_modules,
                "quantize_embedding": q.quantize_embedding,
            },
        },
        "build_config": {
            "max_batch_size": b.max_batch_size,
            "max_input_len": b.max_input_len,
            "max_seq_len": b.max_seq_len,
            "max_num_tokens": b.max_num_tokens,
            "max_beam_width": b.max_beam_width,
            "end_id": generation.get("eos_token_id"),
            "pad_id": generation.get("pad_token_id", generation.get("eos_token_id")),
        },
        **({"lora": cfg.lora.model_dump(include={"target_modules", "max_lora_rank", "max_loras"})} if cfg.lora else {}),
    }


class OnnxRuntimeTarget:
    name = "onnxruntime"
    summary = "CPU: fused ONNX Runtime decoder, int8/int4 weight-only, served by Triton's python backend"
    honours = COMMON_FIELDS | {
        "target.onnx_graph",
        "quantization.int8_modules",
        "quantization.gptq",
        "quantization.smoothquant",
        "quantization.module_group_sizes",
        "quantization.calibration",
        "quantization.quantize_embedding",
        "runtime.cpu_threads",
        "runtime.cpu_thread_spinning",
        "runtime.enable_kv_cache_reuse",
        "build.tokens_per_block",
        "runtime.speculative",
        "runtime.batch_invariant",
        "verify.max_export_logits_diff",
        "verify.reference_dtype",
        "lora",
        *TRITON_DEPLOY_FIELDS,
    }
    sources = {
        "export": (
            "pipeline.targets.onnxruntime.graph",
            "pipeline.targets.onnxruntime.config_rules",
            "pipeline.targets.onnxruntime.scoring",
            "pipeline.quality",
        ),
        "engine": (
            "pipeline.targets.onnxruntime.quantize",
            "pipeline.targets.onnxruntime.scoring",
            "pipeline.targets.onnxruntime.gptq",
            "pipeline.prequantized_packing",
            "pipeline.quality",
        ),
        "lora": ("pipeline.targets.onnxruntime.scoring", "pipeline.quality"),  # each adapter's quality gate
        "triton_repo": (LLM_MODEL_FILE, "pipeline.targets.onnxruntime.served_repository"),
        # its entry point (pyproject.toml); the build Job's memory request and the config's checks it runs
        "deploy": (
            "pipeline.targets.onnxruntime.deployment",
            "pipeline.targets.onnxruntime.build_memory",
            "pipeline.targets.onnxruntime.config_rules",
            "pipeline.targets.onnxruntime.graph",
        ),
    }
    gated_stage = "engine"
    tools = {
        "export": ("torch", "transformers", "onnx", "onnxruntime", "optimum-onnx"),
        "engine": ("onnx", "onnxruntime", "onnx-ir", "torch", "transformers"),
        "triton_repo": ("onnxruntime", "transformers"),
    }

    def unavailable(self) -> str | None:
        from importlib.util import find_spec

        return None if find_spec("onnxruntime") else "onnxruntime is not installed: pip install -e ."

    def variants(self) -> list[dict[str, str]]:
        return [{}]

    def architecture_support(self, cfg) -> dict[str, str | None]:
        from pipeline.architectures import ARCHITECTURES
        from pipeline.targets.onnxruntime.graph import FAMILIES

        return {name: None if name in FAMILIES else "the fused graph has no Family for it" for name in ARCHITECTURES}

    def config_problems(self, cfg) -> list:
        from pipeline.targets.onnxruntime.config_rules import config_problems

        return config_problems(cfg)

    def skips(self, stage: str, cfg) -> str | None:
        return "the onnxruntime target quantizes in the engine stage" if stage == "quantize" else None

    def writes(self, stage: str, cfg) -> str:
        return {
            "export": "ONNX decoder with KV cache (model.onnx)",
            "engine": "engine directory: config.json, model.onnx, tokenizer",
            "triton_repo": "Triton model repository (config.pbtxt per model; python backend LLM model)",
        }.get(stage, "")

    def quantize(self, cfg, ctx) -> dict:
        raise BuildStepError("the onnxruntime target quantizes in the engine stage")

    def convert_adapters(self, cfg, ctx) -> dict:
        return {}  # the runtime reads PEFT's files (pipeline.targets.onnxruntime.runtime.lora_slots)

    def export(self, cfg, ctx) -> dict:
        from pipeline.targets.onnxruntime.config_rules import optimum_too_large

        hf_dir = ctx.upstream("import")
        graph, why_not = choose_graph(hf_dir, cfg.target.onnx_graph)
        facts = cfg.model_facts()
        too_large = graph == "optimum" and facts and optimum_too_large(hf_dir, facts, why_not)
        if too_large:
            raise BuildStepError(too_large)
        if graph != "fused" and cfg.lora is not None:
            raise BuildStepError(f"lora needs the fused graph, but this checkpoint gets the optimum graph ({why_not})")
        ctx.log(
            "building the fused graph (GroupQueryAttention, in-place KV cache)"
            if graph == "fused"
            else "exporting the decoder with optimum-onnx (text-generation-with-past)"
            + (f", not the fused graph: {why_not}" if why_not and cfg.target.onnx_graph == "auto" else "")
        )
        metrics = export_decoder(hf_dir, ctx.out_dir, graph, cfg.lora.target_modules if cfg.lora else [])
        ctx.log("comparing ONNX Runtime logits with transformers")
        diff = compare_logits(hf_dir, ctx.out_dir / ONNX_NAME, list(CHECK_PROMPTS))
        limit = cfg.verify.max_export_logits_diff
        if not diff <= limit:  # NaN fails too
            raise BuildStepError(
                f"ONNX Runtime logits differ from transformers' by {diff:.2e} (> verify.max_export_logits_diff "
                f"{limit:.0e}); the export is wrong"
            )
        ctx.log(f"max |logits difference| vs transformers: {diff:.2e} (limit {limit:.0e})")
        return {**metrics, "max_abs_logits_diff": diff}

    def build_engine(self, cfg, ctx) -> dict:
        import json

        from pipeline.config import SmoothQuantSection
        from pipeline.targets.onnxruntime.quantize import quantize_graph

        hf_dir, export_dir = ctx.upstream("import"), ctx.upstream("export")
        q = cfg.quantization
        smoothquant = (q.smoothquant or SmoothQuantSection()) if q.method == "smoothquant" else None
        linears = self._integer_linears(cfg, ctx, hf_dir)
        smoothing = self._smoothing(cfg, ctx, hf_dir, export_dir, smoothquant.alpha) if smoothquant else None
        ctx.log(
            f"optimising the graph and quantizing the weights one at a time: {q.weights}"
            + (f" (block {q.group_size})" if q.weights != "none" else "")
        )
        metrics = quantize_graph(
            export_dir,
            ctx.out_dir,
            weights=q.weights,
            method=q.method,
            group_size=q.group_size,
            exclude_modules=q.exclude_modules,
            int8_modules=q.int8_modules,
            quantize_embedding=q.quantize_embedding,
            linears=linears,
            smoothing=smoothing,
            module_group_sizes=q.module_group_sizes,
            symmetric=smoothquant.sym if smoothquant else None,
        )
        hf_config = json.loads((hf_dir / "config.json").read_text())
        generation_file = hf_dir / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        (ctx.out_dir / "config.json").write_text(json.dumps(engine_config(cfg, hf_config, generation), indent=2) + "\n")
        return metrics

    @staticmethod
    def _integer_linears(cfg, ctx, hf_dir: Path) -> Mapping | None:
        """The codes the engine holds as they are: an already-quantized checkpoint's (kept), or GPTQ's; None where
        the quantizer rounds the graph's weights itself."""
        q = cfg.quantization
        kept = prequantized.kept(cfg)
        if kept is not None:
            from pipeline.prequantized_packing import quantized_linears

            ctx.log(f"placing the checkpoint's {kept.describe()} codes as they are")
            return quantized_linears(hf_dir / prequantized.QUANTIZED_DIR, kept)
        if q.method != "gptq":
            return None
        import fnmatch

        from pipeline.config import GptqSection
        from pipeline.fetch import load_text
        from pipeline.targets.onnxruntime.gptq import calibrated_linears

        def skipped(module: str) -> bool:
            return any(fnmatch.fnmatchcase(module, p) for p in [*q.exclude_modules, *q.int8_modules])

        options = q.gptq or GptqSection()
        ctx.log(
            f"GPTQ: int4, block {q.group_size}, damp_percent {options.damp_percent}, desc_act {options.desc_act}, "
            f"sym {options.sym}; {q.calibration.num_samples} samples x {q.calibration.seq_len} tokens of "
            f"{q.calibration.text}"
        )
        text = load_text(q.calibration.text, cfg.resolve_path("."), ctx.cache, ctx.log, calibration=True)
        started = time.perf_counter()
        linears = calibrated_linears(hf_dir, q, options, text, ctx.progress, skipped)
        ctx.log(f"GPTQ: {len(linears)} linears rounded in {time.perf_counter() - started:.0f} s")
        return linears

    @staticmethod
    def _smoothing(cfg, ctx, hf_dir: Path, export_dir: Path, alpha: float):
        """method smoothquant: each smoothable activation's per-channel range over the calibration text, measured
        on the float graph (`smoothquant`)."""
        from pipeline.fetch import load_text
        from pipeline.targets.onnxruntime.smoothquant import measured

        c = cfg.quantization.calibration
        ctx.log(f"SmoothQuant: alpha {alpha}; {c.num_samples} samples x {c.seq_len} tokens of {c.text}")
        text = load_text(c.text, cfg.resolve_path("."), ctx.cache, ctx.log, calibration=True)
        return measured(export_dir / ONNX_NAME, hf_dir, text, c, alpha, ctx.progress, ctx.out_dir)

    def fields_read(self, cfg) -> frozenset[str]:
        return self.honours

    def option_reading(self, cfg, field: str) -> str | None:
        return None

    def stage_reads(self, stage: str, cfg) -> tuple[str, ...]:
        """The graph carries LoRA on lora.target_modules; the engine's config.json records the limits."""
        lora = {
            "export": ("lora.target_modules",),
            "engine": ("lora.target_modules", "lora.max_lora_rank", "lora.max_loras"),
            "triton_repo": ("lora.max_cpu_loras", "lora.evict_idle_adapters", "lora.max_loras", "lora.adapters"),
        }
        return lora.get(stage, ()) if cfg.lora is not None else ()

    def triton_models(self, cfg, engine_dir: Path, engine: dict):
        """tensorrtllm_backend's layout around a decoupled python LLM model with in-flight batching; it imports
        the installed package (it runs in the project's environment), so model.py is the only file copied."""
        from pipeline.targets.onnxruntime.runtime import speculative
        from pipeline.triton import interface
        from pipeline.triton.model_config import ModelSpec, model_config
        from pipeline.triton.repo import inflight_batcher_models

        r, t = cfg.runtime, cfg.triton
        config = model_config(
            t.llm_model_name,
            max_batch_size=engine["build_config"]["max_batch_size"],
            inputs=interface.LLM_INPUTS + (interface.LORA_LLM_INPUTS if cfg.lora else []),
            outputs=[*interface.LLM_OUTPUTS, interface.LLM_TEXT_OUTPUT],
            decoupled=True,
            instances=t.llm_instance_count,
            queue_delay_us=r.max_queue_delay_microseconds,
            max_queue_size=t.max_queue_size,
            parameters={
                "engine_dir": engine_dir,
                "cpu_threads": r.cpu_threads or 0,
                "cpu_thread_spinning": r.cpu_thread_spinning != "off",
                "exclude_input_in_output": r.exclude_input_in_output,
                "enable_chunked_context": r.enable_chunked_context,
                "max_tokens_in_paged_kv_cache": r.max_tokens_in_paged_kv_cache or 0,
                "tokens_per_block": cfg.build.tokens_per_block,
                "enable_kv_cache_reuse": r.enable_kv_cache_reuse,
                "batch_invariant": r.batch_invariant,
                # the lora stage's adapters (pipeline/stages/lora.py), beside the engine in the build's output
                "lora_dir": engine_dir.parent / "lora" if cfg.lora and cfg.lora.adapters else "",
                "max_cpu_loras": cfg.lora.cpu_loras() if cfg.lora else 0,
                "evict_idle_adapters": bool(cfg.lora and cfg.lora.evict_idle_adapters),
                **speculative.to_parameters(speculative.from_config(r.speculative)),
            },
        )
        return inflight_batcher_models(cfg, ModelSpec(config, {"model.py": LLM_MODEL_FILE}), engine_dir, engine)

    def load_runner(self, engine_dir: Path, *, num_threads: int | None, runtime, thread_spinning: bool | None):
        from pipeline.targets.onnxruntime.runtime import speculative
        from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

        if thread_spinning is None:  # an offline run has the cores to itself: "auto" spins
            thread_spinning = runtime is None or runtime.cpu_thread_spinning != "off"
        return ModelRunner.from_dir(
            engine_dir,
            num_threads=num_threads,
            thread_spinning=thread_spinning,
            speculative=speculative.from_config(runtime.speculative) if runtime is not None else None,
            batch_invariant=runtime is not None and runtime.batch_invariant,
        )

    def scored(self, cfg, output: Path, built: Path, log):
        from pipeline.errors import PipelineError
        from pipeline.targets.onnxruntime.scoring import scored

        if not (built / "config.json").is_file():
            raise PipelineError(f"no engine in {built}; build it first: trtllm-pipeline build CONFIG")
        return scored(cfg, output, built)

    def scored_adapter(self, cfg, output: Path, name: str, adapter_dir: Path):
        from pipeline.targets.onnxruntime.scoring import adapter_scored

        return adapter_scored(cfg, output / "engine", output / "import", name, adapter_dir)

    def repository_checks(self, options) -> list:
        from pipeline.targets.onnxruntime.served_repository import check_llm_model

        return [check_llm_model]

    def serve_without_triton(self, repo: Path, host: str, port: int, openai_port, launcher=()) -> None:
        return None  # always served by tritonserver

    def triton_launch(self, repo: Path, report):
        return None  # the CPU tritonserver

    def served_adapters(self, report):
        from pipeline.targets.onnxruntime.served_repository import served_adapters

        return served_adapters(report)

    def build_phases(self, stage: str, cfg, shape):
        from pipeline.targets.onnxruntime.build_memory import build_phases

        return build_phases(stage, cfg, shape)

    def plan_notes(self, cfg, output: Path) -> list[str]:
        return []
