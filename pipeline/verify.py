"""Quality before deployment: perplexity of a built engine against the fp32 Hugging Face model.

Shared by the `engine` stage (which fails the build past `verify.max_perplexity_increase`) and the
`trtllm-pipeline verify` command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config import BuildConfig
from pipeline.fetch import load_text

WINDOW = 512  # tokens per scored window; windows do not overlap, so each token is scored once


def eval_token_ids(cfg: BuildConfig, hf_dir: Path, cache: Path, log=print):
    import numpy as np
    from transformers import AutoTokenizer

    text = load_text(cfg.verify.eval_text, cfg._base_dir, cache, log)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens]
    return np.asarray(ids, dtype=np.int64)


def perplexity_report(cfg: BuildConfig, hf_dir: Path, engine_dir: Path, cache: Path, log=print) -> dict:
    """Perplexity of the fp32 reference and of the engine on the same tokens, and the relative increase."""
    from pipeline import quality

    ids = eval_token_ids(cfg, hf_dir, cache, log)
    log(f"scoring {len(ids)} tokens of {cfg.verify.eval_text} with the fp32 model and the engine")
    reference = quality.perplexity(quality.hf_logits_fn(hf_dir), ids, WINDOW, WINDOW)
    engine = quality.perplexity(quality.ort_logits_fn(engine_dir / "model.onnx", cfg.runtime.cpu_threads), ids, WINDOW, WINDOW)
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
        return (f"perplexity {report['engine_perplexity']:.2f} vs fp32 {report['reference_perplexity']:.2f} "
                f"(+{report['perplexity_increase']:.1%}) exceeds verify.max_perplexity_increase {limit:.0%}; "
                "use a milder quantization (e.g. int8, a smaller group_size) or raise the limit")
    return None


def checkpoint_report(cfg: BuildConfig, hf_dir: Path, checkpoint: Path, cache: Path, log=print) -> dict:
    """TensorRT-LLM checkpoint vs the fp32 HF model: perplexity, top-1 agreement, logits difference, a greedy sample."""
    import torch
    from transformers import AutoTokenizer

    from pipeline import quality
    from pipeline.trtllm_reference import load_reference

    ids = eval_token_ids(cfg, hf_dir, cache, log)
    log(f"scoring {len(ids)} tokens of {cfg.verify.eval_text} with the fp32 model and the checkpoint's reference forward")
    hf_fn = quality.hf_logits_fn(hf_dir)
    reference = load_reference(checkpoint, hf_dir)
    ckpt_fn = quality.torch_logits_fn(reference)
    window = ids[None, :WINDOW]
    hf_logits, ckpt_logits = hf_fn(window), ckpt_fn(window)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        sample = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    ref_ppl, ckpt_ppl = (quality.perplexity(fn, ids, WINDOW, WINDOW) for fn in (hf_fn, ckpt_fn))
    return {
        "eval_text": cfg.verify.eval_text,
        "eval_tokens": int(len(ids)),
        "reference_perplexity": round(ref_ppl, 4),
        "engine_perplexity": round(ckpt_ppl, 4),
        "perplexity_increase": round(ckpt_ppl / ref_ppl - 1, 5),
        "top1_agreement": round(quality.top1_agreement(hf_logits, ckpt_logits), 4),
        "max_abs_logits_diff": round(float(np.abs(hf_logits - ckpt_logits).max()), 5),
        "greedy_sample": tokenizer.decode(sample[0, prompt.shape[1]:], skip_special_tokens=True),
    }


def checkpoint_gate(cfg: BuildConfig, hf_dir: Path, checkpoint: Path, ctx) -> dict:
    """The quality gate before any GPU work: fails the export stage when the checkpoint is too lossy."""
    from pipeline.errors import StageError

    report = checkpoint_report(cfg, hf_dir, checkpoint, ctx.cache, ctx.log)
    ctx.log(f"checkpoint perplexity {report['engine_perplexity']:.2f} vs fp32 {report['reference_perplexity']:.2f} "
            f"({report['perplexity_increase']:+.1%}), top-1 agreement {report['top1_agreement']:.1%}, "
            f"max |logits diff| {report['max_abs_logits_diff']:.3g}; greedy: {report['greedy_sample']!r}")
    problem = gate_problem(cfg, report)
    if problem:
        raise StageError("export", "TensorRT-LLM checkpoint " + problem)
    return report
