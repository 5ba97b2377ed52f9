"""The quality gate: a built model against its fp32 reference, on the evaluation text (perplexity, KL divergence
of the next-token distribution, top-1 agreement: llama.cpp's `perplexity --kl-divergence` measures, from the same
forward passes) and on the built-in chat set (the same drift over the reference's greedy answers, and how often the
model's own greedy answer is the reference's), failing the build past the `verify.*` thresholds.

The stage a target gates (`Target.gated_stage`: onnxruntime's engine, trtllm's exported checkpoint) calls `gate`
once the target has built; the `verify` command (`pipeline.build.verify_output`) calls `measure` on what
`Target.scored` returns. The target says how this machine runs what it built and its reference (as `Model`s; fp32
unless `verify.reference_dtype` says bfloat16); everything else is here (the transformers models it runs:
`pipeline.torch_models`). A library below the targets: it imports none.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Generic, Iterable, Iterator, TypeVar

import numpy as np

from pipeline.errors import BuildStepError
from pipeline.fetch import load_text
from pipeline.lock import sha256_json, write_json_atomic
from pipeline.nonfinite import nonfinite

if TYPE_CHECKING:
    from pipeline.config import BuildConfig

LogitsFn = Callable[[np.ndarray], np.ndarray]  # int64 token ids [1, n] -> float logits [1, n, vocab]
# (prompt token ids, max_new_tokens, end_id) -> the greedy answer, ending with end_id when the model ends its turn
GreedyFn = Callable[[list[int], int, int], list[int]]

CHAT_EVAL = Path(__file__).with_name("chat_eval.json")  # everyday questions; see its "provenance"
WINDOW = 512  # tokens per scored window; windows do not overlap, so each token is scored once

T = TypeVar("T")


class Loaded(Generic[T]):
    """What a `Model` runs (a session, a torch model), built on first use and dropped by `release`: the gate holds
    one model at a time, so a build's peak is one model's weights, not the engine's and its reference's together."""

    def __init__(self, load: Callable[[], T]):
        self._load, self._value = load, None

    def __call__(self) -> T:
        if self._value is None:
            self._value = self._load()
        return self._value

    def release(self) -> None:
        import gc

        self._value = None
        gc.collect()


# verify field -> (the report fields it bounds, "max" or "min"); a report field a target does not measure is
# absent from its report (chat fields without a chat template)
THRESHOLDS = {
    "max_perplexity_increase": (("perplexity_increase",), "max"),
    "max_kl_divergence": (("kl_divergence", "chat_kl_divergence"), "max"),
    "min_top1_agreement": (("top1_agreement", "chat_top1_agreement"), "min"),
    "min_chat_answer_match": (("chat_answer_match",), "min"),
}


@dataclass
class Model:
    """A model as the gate runs it on this machine: the same forward for every scored position, and greedy
    decoding as users get it."""

    name: str  # in log lines and errors: "engine", "fp32 ONNX graph", "rank0.safetensors checkpoint"
    path: Path  # what is scored (the `verify` table's title)
    logits: LogitsFn
    greedy: GreedyFn
    end_id: int | None = None  # the token its chat answers end with; None: the reference's
    notes: dict = field(default_factory=dict)  # facts recorded beside its report (trtllm: a greedy sample)
    # what its greedy answers depend on (checkpoint hash, library versions), so they are kept in the cache and
    # generated once; None: generated every time (a fast reference)
    answers_key: str | None = None
    release: Callable[[], None] = lambda: None  # frees what `logits` and `greedy` loaded (a `Loaded`'s release)
    # the greedy answers to many prompts at once, each what `greedy` would answer; None: `greedy` one at a time
    greedy_all: Callable[[list[list[int]], int, int], list[list[int]]] | None = None


def gate(cfg: BuildConfig, model: Model, reference: Model, ctx) -> dict:
    """`measure`'s report of what a stage built (its metrics); raises BuildStepError naming every `verify`
    threshold it crosses."""
    report = measure(cfg, model, reference, ctx.upstream("import"), ctx.cache, ctx.log)
    ctx.log(f"{model.name}: {report_line(report)}" + "".join(f"; {k}: {v!r}" for k, v in model.notes.items()))
    problem = gate_problem(cfg, report)
    if problem:
        raise BuildStepError(f"{model.name}: {problem}")
    return report


def measure(cfg: BuildConfig, model: Model, reference: Model, hf_dir: Path, cache: Path, log=print) -> dict:
    """The report of `model` against `reference` by `cfg.verify`, tokenized by the checkpoint in `hf_dir`;
    `cache` holds the evaluation text (`pipeline.build.cache_dir()`). One model is loaded at a time: the reference
    runs first and is released, then the model (`reference_scores`). Without a chat template, or without
    `verify.min_chat_answer_match`, the report has no chat fields."""
    with reference_scores(cfg, reference, hf_dir, cache, log, model.end_id) as stored:
        return stored.report(model, log)


@contextmanager
def reference_scores(
    cfg: BuildConfig, reference: Model, hf_dir: Path, cache: Path, log=print, end_id: int | None = None
) -> Iterator[ReferenceScores]:
    """The reference's side of `measure`, computed before any model it scores loads, then `reference.release()`d:
    its logits over the evaluation windows and the chat set (its greedy answers ending with `end_id`, None: its
    own end token), kept in .npy files under `cache` until the block ends (not /tmp, often memory)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    text = load_text(cfg.verify.eval_text, cfg._base_dir, cache, log)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens], dtype=np.int64)
    log(f"scoring {len(ids)} tokens of {cfg.verify.eval_text} with the {reference.name}")
    windows = list(text_windows(ids, WINDOW, WINDOW, special_prefix(tokenizer)))
    cache.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_logits(cache)
    with tempfile.TemporaryDirectory(prefix=f"reference-logits-{os.getpid()}-", dir=cache) as folder:
        stored = ReferenceScores(reference.name, cfg.verify.eval_text, len(ids), windows, Path(folder))
        stored.keep("eval-text window", reference, windows)
        if not tokenizer.chat_template:
            log("the tokenizer has no chat template: the chat set is not scored")
        elif cfg.verify.min_chat_answer_match is None:  # 60 greedy answers: minutes on CPU for big models
            log("verify.min_chat_answer_match is not set: the chat set is not scored")
        else:
            end_id = end_id if end_id is not None else reference.end_id
            stored.chat = chat_reference(reference, tokenizer, end_id, cfg.verify.chat_max_new_tokens, cache, log)
            stored.keep("chat prompt", reference, stored.chat.sequences())
        reference.release()
        yield stored


def _remove_orphaned_logits(cache: Path) -> None:
    """Remove what killed gates left (gigabytes each at a 128K vocabulary): folders of processes no longer running."""
    import shutil

    for folder in cache.glob("reference-logits-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class ReferenceScores:
    """What `measure` needs of the reference, so that the model it scores runs alone: the reference's logits at the
    scored positions of every sequence, on disk and mapped when read (a 128K vocabulary makes them gigabytes), its
    greedy chat answers, and the first non-finite logits it computed."""

    reference: str  # its name: the report's "reference"
    eval_text: str
    eval_tokens: int
    windows: list[tuple[np.ndarray, np.ndarray]]
    folder: Path
    chat: ChatReference | None = None
    nonfinite: dict[str, tuple[int, str]] = field(default_factory=dict)  # see `watched`

    def keep(self, sequences: str, reference: Model, items) -> None:
        """Store the reference's logits at the scored positions of each (token ids, scored positions) of `items`,
        float32 (or whatever it computes) exactly as it returned them."""
        logits = watched(reference, sequences, self.nonfinite)
        for number, (ids, scored) in enumerate(items):
            np.save(self.folder / f"{sequences}-{number}.npy", logits(ids[None, :])[0, scored])

    def logits(self, sequences: str, count: int) -> Iterator[np.ndarray]:
        """The stored logits of `sequences` 0 .. count-1, each mapped from its file, not read into memory."""
        for number in range(count):
            yield np.asarray(np.load(self.folder / f"{sequences}-{number}.npy", mmap_mode="r"))

    def report(self, model: Model, log=print) -> dict:
        """`measure`'s report of `model` against the stored reference; `model.release()`d at the end."""
        if self.chat and model.end_id not in (None, self.chat.end_id):
            raise ValueError(
                f"the {model.name} ends its answers with token {model.end_id}, the stored chat answers with "
                f"{self.chat.end_id}: score it against a reference_scores of its own end_id"
            )
        found: dict[str, tuple[int, str]] = {}
        log(f"scoring {self.eval_tokens} tokens of {self.eval_text} with the {model.name}")
        scores = scores_against(
            self.logits("eval-text window", len(self.windows)), watched(model, "eval-text window", found), self.windows
        )
        reference_ppl, engine_ppl = np.exp(scores["reference_nll"].mean()), np.exp(scores["engine_nll"].mean())
        report = {
            "reference": self.reference,
            "eval_text": self.eval_text,
            "eval_tokens": self.eval_tokens,
            "reference_perplexity": round(float(reference_ppl), 4),
            "engine_perplexity": round(float(engine_ppl), 4),
            "perplexity_increase": round(float(engine_ppl / reference_ppl - 1), 5),
            **drift(scores),
            "max_abs_logits_diff": float(f"{scores['abs_diff'].max():.4g}"),
        }
        if self.chat:
            log(f"scoring the {model.name} on {len(self.chat.prompts)} chat answers and generating its own")
            reference_logits = self.logits("chat prompt", len(self.chat.prompts))
            report |= chat_quality(reference_logits, watched(model, "chat prompt", found), self.chat, model.greedy)
        model.release()
        if problem := first_nonfinite(self.nonfinite, found):
            report["nonfinite_logits"] = problem
        return {**report, **model.notes}


def watched(model: Model, sequences: str, found: dict[str, tuple[int, str]]) -> LogitsFn:
    """`model`'s logits, noting in `found[sequences]` (n, the message) where they first hold NaN or an infinity
    (call n scores sequence n of `sequences`): the scores made from them are NaN, which compares false with every
    threshold, so the gate fails on them by name."""
    calls = itertools.count()

    def logits(ids: np.ndarray) -> np.ndarray:
        out, number = model.logits(ids), next(calls)
        problem = None if sequences in found else nonfinite_logits(f"the {model.name}'s", out, f"{sequences} {number}")
        if problem:
            found[sequences] = (number, problem)
        return out

    return logits


def first_nonfinite(reference: dict[str, tuple[int, str]], model: dict[str, tuple[int, str]]) -> str | None:
    """Of the non-finite logits `watched` found, the one a pass alternating the models would meet first: evaluation
    windows before chat prompts, by sequence, the reference's before the model's in the same sequence."""
    order = ["eval-text window", "chat prompt"]
    met = [
        (order.index(sequences), number, side, problem)
        for side, found in enumerate((reference, model))
        for sequences, (number, problem) in found.items()
    ]
    return min(met)[3] if met else None


def nonfinite_logits(name: str, logits: np.ndarray, where: str) -> str | None:
    """The message `<name> logits are NaN at <where>, position 3` for [1, n, vocab] logits holding NaN or inf."""
    found = nonfinite(logits)
    return found and f"{name} logits are {found[0]} at {where}, position {found[1][1]}"


def report_line(report: dict) -> str:
    """The report in one log line."""
    line = (
        f"perplexity: {report['reference']} {report['reference_perplexity']:.2f}, "
        f"engine {report['engine_perplexity']:.2f} "
        f"({report['perplexity_increase']:+.1%}); KL divergence {report['kl_divergence']:.4f} nats "
        f"(p99 {report['kl_divergence_p99']:.3f}), top-1 agreement {report['top1_agreement']:.1%}; "
        f"max |logits diff| {report['max_abs_logits_diff']:.3g}"
    )
    if "chat_answer_match" in report:
        line += (
            f"; chat: KL divergence {report['chat_kl_divergence']:.4f}, top-1 agreement "
            f"{report['chat_top1_agreement']:.1%}, greedy answer = the reference's on {report['chat_answer_match']:.0%}"
        )
    return line


def gate_problem(cfg: BuildConfig, report: dict) -> str | None:
    """Every `verify` threshold the report crosses, with the field to change; None when it passes. A NaN or infinite
    score fails whatever its threshold (NaN compares false with every number), as do logits that were not finite."""
    problems, not_numbers = [], []
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
        for metric in measured:
            value = report[metric]
            if not math.isfinite(value):  # NaN compares false with every limit: it would pass
                not_numbers.append(f"{metric} is {value}")
            elif (value > limit) if bound == "max" else (value < limit):
                problems.append(
                    f"{metric} {value:.4g} {'exceeds' if bound == 'max' else 'is below'} verify.{name} {limit:.4g}"
                )
    not_numbers += [report["nonfinite_logits"]] if "nonfinite_logits" in report else []
    if not_numbers:
        return (
            "; ".join(not_numbers) + ": a score that is NaN or infinite fails every verify threshold. The model "
            "computes NaN or infinity: look for non-finite weights in the checkpoint (a pre-quantized one's are "
            "refused at import), and build with quantization.weights: none to tell whether the quantization does it"
        )
    if not problems:
        return None
    return (
        "; ".join(problems) + f" ({report['reference']} perplexity {report['reference_perplexity']:.2f}, "
        f"engine {report['engine_perplexity']:.2f}); "
        "use a milder quantization (e.g. int8, a smaller group_size, quantization.exclude_modules) or relax the "
        "named verify field"
    )


# ---------------------------------------------------------------- measures


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def text_windows(ids: np.ndarray, window: int, stride: int | None = None, prefix: list[int] | tuple = ()):
    """(token ids, scored positions) per window: positions whose logits predict a token of the window. `prefix`
    (the tokenizer's <bos>, see `special_prefix`) starts every window unscored, as it starts every prompt."""
    stride = stride or window
    head = np.asarray(prefix, dtype=np.int64)
    for start in range(0, max(len(ids) - 1, 1), stride):
        chunk = np.concatenate([head, ids[start : start + window]]).astype(np.int64)
        if len(chunk) < 2:
            break
        yield chunk, np.arange(max(len(head), 1) - 1, len(chunk) - 1)


def kl_divergence(reference_logits: np.ndarray, engine_logits: np.ndarray) -> np.ndarray:
    """KL(reference || engine) in nats for each row of [n, vocab] logits."""
    return row_measures(reference_logits, engine_logits)[0]


def row_measures(reference_logits: np.ndarray, engine_logits: np.ndarray, targets: np.ndarray | None = None):
    """(KL(reference || engine), the reference's and the engine's negative log-likelihood of `targets`) for each row
    of [n, vocab] logits, from one log-softmax of each; in float64 blocks of rows, so that small divergences are not
    rounding noise and memory stays bounded at any vocabulary."""
    n = len(reference_logits)
    kl, reference_nll, engine_nll = np.empty(n), np.empty(n), np.empty(n)
    for start in range(0, n, 64):
        block = slice(start, start + 64)
        ref = log_softmax(reference_logits[block].astype(np.float64))
        eng = log_softmax(engine_logits[block].astype(np.float64))
        kl[block] = (np.exp(ref) * (ref - eng)).sum(-1)
        if targets is not None:
            rows, wanted = np.arange(len(ref)), targets[block]
            reference_nll[block], engine_nll[block] = -ref[rows, wanted], -eng[rows, wanted]
    return kl, reference_nll, engine_nll


def compare(reference_fn: LogitsFn, engine_fn: LogitsFn, sequences) -> dict[str, np.ndarray]:
    """Per scored position of each (token ids, scored positions) of `sequences`, from one forward pass of each
    model, in turn per sequence: both models' negative log-likelihood of the next token, KL(reference || engine),
    same top-1, and the largest absolute logits difference. Both models are loaded at once; `measure` runs the
    reference first instead (`reference_scores`)."""
    sequences, again = itertools.tee(sequences)
    return scores_against((reference_fn(ids[None, :])[0, scored] for ids, scored in again), engine_fn, sequences)


def scores_against(reference_logits: Iterable[np.ndarray], engine_fn: LogitsFn, sequences) -> dict[str, np.ndarray]:
    """`compare`'s scores from the reference's logits at the scored positions of each sequence, computed before."""
    parts: dict[str, list] = {"reference_nll": [], "engine_nll": [], "kl": [], "same_top1": [], "abs_diff": []}
    for (ids, scored), ref in zip(sequences, reference_logits, strict=True):
        eng = engine_fn(ids[None, :])[0, scored]
        kl, reference_nll, engine_nll = row_measures(ref, eng, ids[scored + 1])
        parts["reference_nll"].append(reference_nll)
        parts["engine_nll"].append(engine_nll)
        parts["kl"].append(kl)
        parts["same_top1"].append(ref.argmax(-1) == eng.argmax(-1))
        parts["abs_diff"].append(np.abs(ref - eng).max(-1))
    return {k: np.concatenate(v) for k, v in parts.items()}


def drift(scores: dict[str, np.ndarray], prefix: str = "") -> dict:
    """Mean and 99th percentile of the KL divergence (4 significant digits: a near-lossless engine's is tiny) and
    the top-1 agreement, as report fields."""
    return {
        f"{prefix}kl_divergence": float(f"{scores['kl'].mean():.4g}"),
        f"{prefix}kl_divergence_p99": float(f"{np.percentile(scores['kl'], 99):.4g}"),
        f"{prefix}top1_agreement": round(float(scores["same_top1"].mean()), 4),
    }


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text (Gemma's, Llama 3's and Mistral's <bos>; none for
    SmolLM2). Models trained with them degenerate without them (Gemma 3 270M: ' is is is ...'), so prompts and
    scored windows start with them."""
    probe = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    starts = [i for i in range(len(probe) - len(bare) + 1) if probe[i : i + len(bare)] == bare]
    return probe[: starts[0]] if starts else []


# ---------------------------------------------------------------- the chat set


@dataclass
class ChatReference:
    """The reference's greedy answers to the chat set: token ids of each templated prompt and of its answer
    (ending with the end token when the model ended its turn within `max_new_tokens`)."""

    prompts: list[list[int]]
    answers: list[list[int]]
    end_id: int
    max_new_tokens: int

    def sequences(self):
        """Each prompt with its answer, scoring the positions that predict the answer's tokens."""
        for prompt, answer in zip(self.prompts, self.answers):
            ids = np.asarray(prompt + answer, dtype=np.int64)
            yield ids, np.arange(len(prompt) - 1, len(ids) - 1)


def chat_prompts(tokenizer, path: Path = CHAT_EVAL) -> list[list[int]]:
    """The conversations of `path` through the tokenizer's chat template, each ending where the assistant answers."""
    conversations = json.loads(path.read_text())["conversations"]
    return [
        list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        for messages in conversations
    ]


def chat_reference(
    reference: Model, tokenizer, end_id: int, max_new_tokens: int, cache: Path | None = None, log=print
) -> ChatReference:
    """The reference's greedy answers to the chat set; kept under `cache` when the reference has an
    `answers_key` (a slow reference: transformers' generate takes minutes on CPU)."""
    prompts = chat_prompts(tokenizer)
    stored = None
    if reference.answers_key and cache:
        stored = (
            cache / "chat-answers" / f"{sha256_json([reference.answers_key, prompts, end_id, max_new_tokens])}.json"
        )
        if stored.is_file():
            log(f"the {reference.name}'s greedy answers to {CHAT_EVAL.name}: {stored}")
            return ChatReference(prompts, json.loads(stored.read_text()), end_id, max_new_tokens)
    log(f"generating the {reference.name}'s greedy answers to {CHAT_EVAL.name}")
    if reference.greedy_all:
        answers = reference.greedy_all(prompts, max_new_tokens, end_id)
    else:
        answers = [reference.greedy(prompt, max_new_tokens, end_id) for prompt in prompts]
    if stored:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(stored, answers)
    return ChatReference(prompts, answers, end_id, max_new_tokens)


def chat_quality(
    reference_logits: Iterable[np.ndarray], engine_fn: LogitsFn, reference: ChatReference, engine_greedy
) -> dict:
    """Teacher-forced drift over the reference's answers (its logits at the scored positions of each of
    `reference.sequences()`) and the fraction of prompts where the engine's own greedy answer
    (`engine_greedy(prompt, max_new_tokens, end_id)`) is token for token the reference's."""
    scores = scores_against(reference_logits, engine_fn, reference.sequences())
    matches = [
        engine_greedy(prompt, reference.max_new_tokens, reference.end_id) == answer
        for prompt, answer in zip(reference.prompts, reference.answers)
    ]
    return {
        "chat_prompts": len(reference.prompts),
        "chat_tokens": len(scores["kl"]),
        **drift(scores, "chat_"),
        "chat_answer_match": round(float(np.mean(matches)), 4),
    }
