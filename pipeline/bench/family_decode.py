"""Decode speed of the fused ONNX graph per architecture family, as ratios to Llama's at the same size.

Why ratios: a family's graph should cost what its features cost, not more (issue #13: within 10% of Llama).
Each registered family gets a random checkpoint of one size (SmolLM2-135M's by default) with its own
features switched on, and an engine (int8 by default, the default build's); all engines decode the same
random prompts through the ModelRunner, families interleaved and every round repeated, so machine drift hits
them all alike. The report is each family's median decode tok/s per sequence and the median of its per-round
ratios to Llama.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

# SmolLM2-135M's shape, with an explicit head_dim so every family keeps it.
SIZE = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
# Features the config classes leave off (or set beyond the benchmark's lengths); the rest (Qwen2's biases,
# Qwen3's and Gemma 3's q/k norms, Gemma 3's sliding/global layer pattern) are on by default.
FEATURES = {
    "MistralForCausalLM": {"sliding_window": 64},
    "Gemma3ForCausalLM": {"sliding_window": 64, "query_pre_attn_scalar": 64, "final_logit_softcapping": 30.0},
    "Phi3ForCausalLM": {"partial_rotary_factor": 0.75},  # Phi-4-mini's
}
REFERENCE = "LlamaForCausalLM"


def settings(architecture: str, **size) -> dict:
    """The config values a benchmark checkpoint of `architecture` is made with."""
    return {**SIZE, **size, **FEATURES.get(architecture, {})}


def random_checkpoint(architecture: str, path: Path, seed: int = 0, **size) -> Path:
    """A randomly initialised checkpoint of a registered architecture (weights only, no tokenizer); one already
    at `path` is reused (callers key `path` on `settings`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.architectures import architecture as registered

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    config = AutoConfig.for_model(registered(architecture).model_type, **settings(architecture, **size))
    config.architectures = [architecture]
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def make_engine(
    hf_dir: Path,
    engine_dir: Path,
    *,
    max_batch_size: int,
    max_seq_len: int,
    graph: str = "fused",
    weights: str = "none",
) -> Path:
    """An engine directory as the export and engine stages write it (weights: none, int8, int4 with their
    default blocks; no perplexity gate)."""
    from pipeline.config import BuildConfig
    from pipeline.targets.onnxruntime.adapter import engine_config, export_decoder
    from pipeline.targets.onnxruntime.quantize import quantize_graph

    if not (engine_dir / "config.json").is_file():
        cfg = BuildConfig.model_validate(
            {
                "model": {"source": "hf", "path": str(hf_dir)},
                "quantization": {"weights": weights},
                "build": {
                    "max_batch_size": max_batch_size,
                    "max_input_len": max_seq_len - 1,
                    "max_seq_len": max_seq_len,
                    "max_num_tokens": max_batch_size * max_seq_len,
                },
            }
        )
        export = engine_dir.with_name(engine_dir.name + "-export")
        export_decoder(hf_dir, export, graph)
        q = cfg.quantization
        quantize_graph(export, engine_dir, weights=q.weights, method=q.method, group_size=q.group_size)
        hf_config = json.loads((hf_dir / "config.json").read_text())
        (engine_dir / "config.json").write_text(json.dumps(engine_config(cfg, hf_config, {}), indent=1))
    return engine_dir


def decode_speed_per_family(
    work: Path,
    architectures: list[str],
    batches: list[int],
    input_len: int,
    output_len: int,
    repeats: int,
    threads: int,
    thread_spinning: bool,
    weights: str = "none",
    log=print,
    size: dict | None = None,
) -> list[dict]:
    """Rows of {architecture, batch, weights, decode_tok_s_per_seq (median), ratio_to_llama (median), raw}."""
    import hashlib

    from pipeline.bench.peers.ours import time_runner
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    archs = [REFERENCE] + [a for a in architectures if a != REFERENCE]
    runners = {}
    for arch in archs:
        log(f"building {arch}")
        # kept between runs, keyed on what shapes them (a changed size, batch or length builds anew)
        key = hashlib.sha256(json.dumps(settings(arch, **(size or {})), sort_keys=True).encode()).hexdigest()[:12]
        checkpoint = random_checkpoint(arch, work / arch / f"hf-{key}", **(size or {}))
        max_batch_size, max_seq_len = max(batches), input_len + output_len + 64
        engine = make_engine(
            checkpoint,
            checkpoint.with_name(f"hf-{key}-engine-{weights}-b{max_batch_size}-s{max_seq_len}"),
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            weights=weights,
        )
        runners[arch] = ModelRunner.from_dir(engine, num_threads=threads, thread_spinning=thread_spinning)
    rng = np.random.default_rng(0)
    vocab = settings(REFERENCE, **(size or {}))["vocab_size"]
    prompts = {b: [rng.integers(3, vocab, input_len).tolist() for _ in range(b)] for b in batches}
    speeds = {(a, b): [] for a in archs for b in batches}
    for arch in archs:
        for b in batches:
            time_runner(runners[arch], prompts[b], 2)  # warm-up
    for round_ in range(repeats):
        log(f"round {round_ + 1}/{repeats}")
        for b in batches:
            for arch in archs:
                first, total = time_runner(runners[arch], prompts[b], output_len)
                speeds[arch, b].append((output_len - 1) / (total - first))
    rows = []
    for b in batches:
        for arch in archs:
            ratios = [s / r for s, r in zip(speeds[arch, b], speeds[REFERENCE, b])]
            rows.append(
                {
                    "architecture": arch,
                    "batch": b,
                    "weights": weights,
                    "input_len": input_len,
                    "output_len": output_len,
                    "decode_tok_s_per_seq": round(statistics.median(speeds[arch, b]), 1),
                    "ratio_to_llama": round(statistics.median(ratios), 3),
                    "raw_tok_s": [round(s, 1) for s in speeds[arch, b]],
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    from pipeline.bench.report import markdown_table

    return markdown_table(
        ["architecture", "weights", "batch", "decode tok/s per seq (median)", "ratio to Llama (median of rounds)"],
        [[r["architecture"], r["weights"], r["batch"], r["decode_tok_s_per_seq"], r["ratio_to_llama"]] for r in rows],
    )
