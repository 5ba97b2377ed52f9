"""Stage `engine`: the deployable engine directory, laid out like a TensorRT-LLM engine directory.

`config.json` holds `version`, `pretrained_config` (the model's shape) and `build_config` (limits,
quantization, target), so the Triton repository, the runner and the benchmarks read limits from the
engine instead of re-typed numbers. onnxruntime: graph optimisation + ORT weight quantization, then
the perplexity gate (`verify.*`); trtllm: `trtllm-build` (lands with that target).
Inputs: `build`, `quantization`, `parallel`, `target`, `verify`, the `import` and `export` outputs.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path

import pipeline
from pipeline.config import BuildConfig
from pipeline.errors import StageError
from pipeline.verify import gate_problem, perplexity_report

NAME = "engine"
READS = ("build", "quantization", "parallel", "target", "verify", "runtime.cpu_threads")
TOOLS = ("onnxruntime", "onnx", "transformers")
TARGETS = ("onnxruntime", "trtllm")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def applies(cfg: BuildConfig) -> str | None:
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return f"engine directory: config.json, {'model.onnx' if cfg.target.name == 'onnxruntime' else 'rank*.engine'}, tokenizer"


def engine_config(cfg: BuildConfig, hf_config: dict, generation: dict) -> dict:
    """The engine's self-description, with TensorRT-LLM's top-level keys."""
    q, b = cfg.quantization, cfg.build
    return {
        "version": pipeline.__version__,
        "target": cfg.target.name,
        "onnxruntime_version": metadata.version("onnxruntime"),
        "pretrained_config": {
            "architecture": hf_config["architectures"][0],
            "dtype": "float32",
            "vocab_size": hf_config["vocab_size"],
            "hidden_size": hf_config["hidden_size"],
            "intermediate_size": hf_config["intermediate_size"],
            "num_hidden_layers": hf_config["num_hidden_layers"],
            "num_attention_heads": hf_config["num_attention_heads"],
            "num_key_value_heads": hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]),
            "head_size": hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"],
            "max_position_embeddings": hf_config["max_position_embeddings"],
            "rotary_base": hf_config.get("rope_theta", 10000.0),
            "norm_epsilon": hf_config.get("rms_norm_eps"),
            "tie_word_embeddings": hf_config.get("tie_word_embeddings", False),
            "quantization": {"weights": q.weights, "group_size": q.group_size if q.weights == "int4" else None,
                             "exclude_modules": q.exclude_modules, "int8_modules": q.int8_modules,
                             "quantize_embedding": q.quantize_embedding},
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
    }


def run(cfg: BuildConfig, ctx) -> dict:
    if cfg.target.name == "trtllm":
        from pipeline.memory import plan_memory
        from pipeline.targets import trtllm

        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            for line in plan_memory(cfg, facts).lines():
                ctx.log(line)

        metrics = trtllm.build_engine(cfg, ctx.upstream("export") / "trtllm_checkpoint", ctx.out_dir, ctx.upstream(NAME), ctx.log)
        copy_tokenizer(ctx.upstream("import"), ctx.out_dir)
        return metrics
    return run_onnxruntime(cfg, ctx)


def copy_tokenizer(hf_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, out_dir / name)


def run_onnxruntime(cfg: BuildConfig, ctx) -> dict:
    from pipeline.targets import onnxruntime as ort_target

    hf_dir, export_dir = ctx.upstream("import"), ctx.upstream("export")
    q = cfg.quantization
    ctx.log(f"optimising the graph and quantizing weights: {q.weights}" + (f" (block {q.group_size})" if q.weights == "int4" else ""))
    metrics = ort_target.build_engine(export_dir, ctx.out_dir, weights=q.weights, method=q.method, group_size=q.group_size, exclude_modules=q.exclude_modules,
                                         int8_modules=q.int8_modules, quantize_embedding=q.quantize_embedding)
    copy_tokenizer(hf_dir, ctx.out_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    generation = json.loads((hf_dir / "generation_config.json").read_text()) if (hf_dir / "generation_config.json").exists() else {}
    (ctx.out_dir / "config.json").write_text(json.dumps(engine_config(cfg, hf_config, generation), indent=2) + "\n")

    report = perplexity_report(cfg, hf_dir, ctx.out_dir, ctx.cache, ctx.log)
    ctx.log(f"perplexity: fp32 {report['reference_perplexity']:.2f}, engine {report['engine_perplexity']:.2f} ({report['perplexity_increase']:+.1%})")
    problem = gate_problem(cfg, report)
    if problem:
        raise StageError(NAME, problem)
    return {**metrics, **report}
