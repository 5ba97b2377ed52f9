"""Quality before deployment: perplexity of a built engine against the fp32 Hugging Face model.

Shared by the targets' quality gates (which fail the build past `verify.max_perplexity_increase`) and
the `trtllm-pipeline verify` command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config import BuildConfig
from pipeline.fetch import load_text

WINDOW = 512  # tokens per scored window; windows do not overlap, so each token is scored once


def eval_token_ids(cfg: BuildConfig, hf_dir: Path, cache: Path, log=print) -> tuple[np.ndarray, list[int]]:
    """(the eval text's first eval_tokens tokens, the special prefix every scored window starts with)."""
    from transformers import AutoTokenizer

    from pipeline.quality import special_prefix

    text = load_text(cfg.verify.eval_text, cfg._base_dir, cache, log)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens]
    return np.asarray(ids, dtype=np.int64), special_prefix(tokenizer)


def perplexity_report(cfg: BuildConfig, hf_dir: Path, engine_dir: Path, cache: Path, log=print) -> dict:
    """Perplexity of the fp32 reference and of the engine on the same tokens, and the relative increase."""
    from pipeline import quality

    ids, prefix = eval_token_ids(cfg, hf_dir, cache, log)
    log(f"scoring {len(ids)} tokens of {cfg.verify.eval_text} with the fp32 model and the engine")
    reference = quality.perplexity(quality.hf_logits_fn(hf_dir), ids, WINDOW, WINDOW, prefix)
    engine = quality.perplexity(
        quality.ort_logits_fn(engine_dir / "model.onnx", cfg.runtime.cpu_threads), ids, WINDOW, WINDOW, prefix
    )
    return perplexity_summary(cfg, ids, reference, engine)


def perplexity_summary(cfg: BuildConfig, ids, reference: float, engine: float) -> dict:
    """The report fields every quality gate shares (the gate reads `perplexity_increase`)."""
    return {
        "eval_text": cfg.verify.eval_text,
        "eval_tokens": int(len(ids)),
        "reference_perplexity": round(reference, 4),
        "engine_perplexity": round(engine, 4),
        "perplexity_increase": round(engine / reference - 1, 5),
    }


def gate_problem(cfg: BuildConfig, report: dict) -> str | None:
    limit = cfg.verify.max_perplexity_increase
    if limit is not None and report["perplexity_increase"] > limit:
        return (
            f"perplexity {report['engine_perplexity']:.2f} vs fp32 {report['reference_perplexity']:.2f} "
            f"(+{report['perplexity_increase']:.1%}) exceeds verify.max_perplexity_increase {limit:.0%}; "
            "use a milder quantization (e.g. int8, a smaller group_size) or raise the limit"
        )
    return None
