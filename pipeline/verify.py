"""Quality before deployment: a built engine against the fp32 Hugging Face model, on the evaluation text
(perplexity, KL divergence, top-1 agreement from the same forward passes) and on the built-in chat set (the
same drift over the fp32 model's greedy answers, and how often the engine's greedy answer is the fp32 one).

Shared by the targets' quality gates (which fail the build past the `verify.*` thresholds) and the
`trtllm-pipeline verify` command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config import BuildConfig
from pipeline.fetch import load_text

WINDOW = 512  # tokens per scored window; windows do not overlap, so each token is scored once

# verify field -> (the report fields it bounds, "max" or "min"); a report field a target does not measure is
# absent from its report (chat fields without a chat template)
THRESHOLDS = {
    "max_perplexity_increase": (("perplexity_increase",), "max"),
    "max_kl_divergence": (("kl_divergence", "chat_kl_divergence"), "max"),
    "min_top1_agreement": (("top1_agreement", "chat_top1_agreement"), "min"),
    "min_chat_answer_match": (("chat_answer_match",), "min"),
}


def eval_token_ids(cfg: BuildConfig, hf_dir: Path, cache: Path, log=print) -> tuple[np.ndarray, list[int]]:
    """(the eval text's first eval_tokens tokens, the special prefix every scored window starts with)."""
    from transformers import AutoTokenizer

    from pipeline.quality import special_prefix

    text = load_text(cfg.verify.eval_text, cfg._base_dir, cache, log)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens]
    return np.asarray(ids, dtype=np.int64), special_prefix(tokenizer)


def compare_with_fp32(
    cfg: BuildConfig, hf_dir: Path, cache: Path, log, engine_fn, engine_greedy, end_id=None, chat=None
) -> tuple[dict, object]:
    """(the report, the fp32 chat reference) of a model given as a logits_fn and a greedy generator
    (`quality.chat_quality`'s) that ends answers with `end_id` (default: `quality.end_of_turn`); `chat`, a
    `quality.ChatReference` from an earlier call, saves regenerating the fp32 answers. Without a chat template,
    or without `verify.min_chat_answer_match` (and no `chat`), the report has no chat fields."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import quality

    ids, prefix = eval_token_ids(cfg, hf_dir, cache, log)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference_fn = quality.torch_logits_fn(model)
    log(f"scoring {len(ids)} tokens of {cfg.verify.eval_text} with the fp32 model and the engine")
    scores = quality.compare(reference_fn, engine_fn, quality.text_windows(ids, WINDOW, WINDOW, prefix))
    report = {
        **perplexity_summary(cfg, ids, np.exp(scores["reference_nll"].mean()), np.exp(scores["engine_nll"].mean())),
        **quality.drift(scores),
        "max_abs_logits_diff": float(f"{scores['abs_diff'].max():.4g}"),
    }
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if not tokenizer.chat_template:
        log("the tokenizer has no chat template: the chat set is not scored")
        return report, chat
    if chat is None and cfg.verify.min_chat_answer_match is None:  # 60 greedy answers: minutes on CPU for big models
        log("verify.min_chat_answer_match is not set: the chat set is not scored")
        return report, chat
    if chat is None:
        log(f"generating the fp32 model's greedy answers to {quality.CHAT_EVAL.name}")
        end_id = end_id if end_id is not None else quality.end_of_turn(model, tokenizer)
        chat = quality.chat_reference(model, tokenizer, end_id, cfg.verify.chat_max_new_tokens)
    log(f"scoring the engine on {len(chat.prompts)} chat answers and generating its own")
    return {**report, **quality.chat_quality(reference_fn, engine_fn, chat, engine_greedy)}, chat


def engine_quality(
    hf_dir: Path, engine_dir: Path, cache: Path, cfg: BuildConfig | None = None, log=print, chat=None
) -> tuple[dict, object]:
    """(quality report, fp32 chat reference) of an onnxruntime engine directory against the fp32 checkpoint in
    `hf_dir`, by `cfg.verify` (default: the defaults); `cache` holds the evaluation text (`pipeline.build.cache_dir()`).
    To score several engines of one model, pass the returned reference back as `chat`: the fp32 answers are
    generated once."""
    from functools import partial

    from pipeline import quality
    from pipeline.runtime import speculative
    from pipeline.runtime.model_runner import ModelRunner

    cfg = cfg or BuildConfig()
    runner = ModelRunner.from_dir(  # with the runtime settings that shape greedy tokens: users get those
        engine_dir,
        num_threads=cfg.runtime.cpu_threads,
        batch_invariant=cfg.runtime.batch_invariant,
        speculative=speculative.from_config(cfg.runtime.speculative),
    )
    engine_fn = quality.session_logits_fn(runner.session)
    greedy = partial(quality.runner_greedy, runner)
    return compare_with_fp32(cfg, hf_dir, cache, log, engine_fn, greedy, runner.end_id, chat)


def quality_report(cfg: BuildConfig, hf_dir: Path, engine_dir: Path, cache: Path, log=print) -> dict:
    """An onnxruntime engine's report (what its build records and `verify` prints)."""
    return engine_quality(hf_dir, engine_dir, cache, cfg, log)[0]


def perplexity_summary(cfg: BuildConfig, ids, reference: float, engine: float) -> dict:
    """The perplexity fields every quality report shares."""
    return {
        "eval_text": cfg.verify.eval_text,
        "eval_tokens": int(len(ids)),
        "reference_perplexity": round(float(reference), 4),
        "engine_perplexity": round(float(engine), 4),
        "perplexity_increase": round(float(engine / reference - 1), 5),
    }


def report_line(report: dict) -> str:
    """The report in one log line."""
    line = (
        f"perplexity: fp32 {report['reference_perplexity']:.2f}, engine {report['engine_perplexity']:.2f} "
        f"({report['perplexity_increase']:+.1%}); KL divergence {report['kl_divergence']:.4f} nats "
        f"(p99 {report['kl_divergence_p99']:.3f}), top-1 agreement {report['top1_agreement']:.1%}"
    )
    if "chat_answer_match" in report:
        line += (
            f"; chat: KL divergence {report['chat_kl_divergence']:.4f}, top-1 agreement "
            f"{report['chat_top1_agreement']:.1%}, greedy answer = fp32's on {report['chat_answer_match']:.0%}"
        )
    return line


def gate_problem(cfg: BuildConfig, report: dict) -> str | None:
    """Every `verify` threshold the report crosses, with the field to change; None when it passes."""
    problems = []
    for name, (fields, bound) in THRESHOLDS.items():
        limit = getattr(cfg.verify, name)
        if limit is None:
            continue
        measured = [f for f in fields if f in report]
        if not measured:
            problems.append(
                f"verify.{name} is set but nothing measured {' or '.join(fields)} (the chat set needs a tokenizer "
                f"with a chat template); set verify.{name}: null"
            )
        for field in measured:
            value = report[field]
            if (value > limit) if bound == "max" else (value < limit):
                problems.append(
                    f"{field} {value:.4g} {'exceeds' if bound == 'max' else 'is below'} verify.{name} {limit:.4g}"
                )
    if not problems:
        return None
    return (
        "; ".join(problems)
        + f" (fp32 perplexity {report['reference_perplexity']:.2f}, engine {report['engine_perplexity']:.2f}); "
        "use a milder quantization (e.g. int8, a smaller group_size, quantization.exclude_modules) or relax the "
        "named verify field"
    )
