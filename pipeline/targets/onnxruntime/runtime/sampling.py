"""Requests and sampling for the CPU runtime: what a request asks for (`SamplingParams`), its state (`Request`), and
choosing, appending and finishing its tokens as TensorRT-LLM does.

Why a module of its own: the runner (`model_runner`), speculative decoding (`speculative`) and the scheduler all take
tokens the same way, and none of this depends on the engine or its KV cache.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from pipeline.targets.onnxruntime.runtime.guided import one_line
from pipeline.upstream import facts

# TensorRT-LLM's bounds on sampling settings (scripts/dev/tabulate_sampling_checks.py): {checker: [[op, bound]]}
SAMPLING_CHECKS: dict[str, list] = {
    name: [rule for rule in rules if not isinstance(rule[1], str)]  # named bounds (kMaxBeamWidth) are checked apart
    for name, rules in facts("sampling_checks")["checks"].items()
}
# SamplingParams field -> its SamplingConfig checker; the penalties have none upstream and are only kept finite
SAMPLING_SETTINGS = {
    "temperature": "Temperature",
    "top_k": "TopK",
    "top_p": "TopP",
    "repetition_penalty": "RepetitionPenalty",
    "min_length": "MinTokens",
    "presence_penalty": "",
    "frequency_penalty": "",
}


def unset_as(value, default):
    """`default` for None only: 0 is a value to check (`value or default` would turn repetition_penalty 0 into 1)."""
    return default if value is None else value


OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq}


@dataclass
class SamplingParams:
    """Per-request decoding settings, with TensorRT-LLM's defaults (top_k=1: greedy)."""

    max_new_tokens: int
    end_id: int
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 0.0
    repetition_penalty: float = 1.0
    random_seed: int = 0  # TensorRT-LLM's default seed is 0 as well: sampling is reproducible unless asked
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    min_length: int = 0  # end_id is blocked until this many tokens were generated
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens

    @property
    def greedy(self) -> bool:
        # top_k=0 with top_p=0 is greedy in TensorRT-LLM too (no filter chosen)
        return self.temperature == 0.0 or self.top_k == 1 or (self.top_k == 0 and not self.top_p)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that depends on the sequence: the batch's argmax can be shared."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and not self.bad_words
            and not self.min_length
            and not self.presence_penalty
            and not self.frequency_penalty
        )


@dataclass
class Request:
    """One sequence: its prompt, what it generated (end_id excluded, like TensorRT-LLM) and its state."""

    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float = 0.0
    finish_reason: str | None = None  # "end_id", "stop_words", "length" or "error" once finished
    draft_misses: int = 0  # speculative decoding: verifications in a row that accepted no draft (drafting backs off)
    rng: np.random.Generator | None = None
    matcher: object | None = None  # guided decoding: the grammar's state (an llguidance LLMatcher; `guided`)
    error: str | None = None  # why the request failed on its own (finish_reason "error"); the others go on
    adapter: str | None = None  # the LoRA adapter it decodes with (None: the base model)
    # that adapter's registration (`LoraSlots.identity`), which seeds its prefix blocks' keys
    adapter_key: str | None = None
    lora_slot: int | None = (
        None  # the slot holding that adapter while the request runs (`pipeline.targets.onnxruntime.runtime.lora_slots`)
    )

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.random_seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]


def to_words_list(words, batch_size: int | None = None) -> list[list[list[int]]]:
    """Stop/bad words per batch entry.

    Accepts ModelRunnerCpp's format (per entry, a list of words, each a list of token ids) or the
    `[batch, 2, len]` offsets format of `tensorrt_llm.runtime.to_word_list_format` (tokens row, then
    cumulative end offsets padded with -1) as a numpy array or tensor.
    """
    if words is None:
        return [[] for _ in range(batch_size or 0)]
    if not isinstance(words, (list, tuple)):
        array = np.asarray(words.cpu() if hasattr(words, "cpu") else words)
        if array.ndim != 3 or array.shape[1] != 2:
            raise ValueError(f"words list array must have shape [batch, 2, len], got {list(array.shape)}")
        rows = []
        for tokens, offsets in array.tolist():
            ends = [o for o in offsets if o > 0]
            rows.append([tokens[s:e] for s, e in zip([0] + ends[:-1], ends)])
        words = rows
    rows = [[[int(t) for t in word] for word in (entry or []) if len(word)] for entry in words]
    if batch_size is not None and len(rows) != batch_size:
        raise ValueError(
            f"words list has {len(rows)} entries for a batch of {batch_size}; give one list of words per prompt"
        )
    return rows


def choose(request: Request, logits: np.ndarray) -> tuple[int, float]:
    """The next token for one row and its log-probability under the final (filtered) distribution."""
    p = request.params
    logits = logits.astype(np.float64)  # a copy: penalties below must not touch the batch's logits
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(request.tokens, dtype=np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output:
        generated, counts = np.unique(np.asarray(request.output, dtype=np.int64), return_counts=True)
        logits[generated] -= p.presence_penalty + p.frequency_penalty * counts
    if len(request.output) < p.min_length and 0 <= p.end_id < len(logits):
        logits[p.end_id] = -np.inf
    tokens = request.tokens
    for word in p.bad_words:
        if len(word) == 1 or tokens[len(tokens) - len(word) + 1 :] == word[:-1]:
            logits[word[-1]] = -np.inf
    if p.greedy:
        token = int(np.argmax(logits))
        return token, float(logits[token] - _logsumexp(logits))
    logits /= p.temperature
    if 0 < p.top_k < len(logits):
        kth = np.partition(logits, -p.top_k)[-p.top_k]
        logits[logits < kth] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if 0.0 < p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1  # smallest prefix reaching top_p
        probs[order[keep:]] = 0.0
        probs /= probs.sum()
    token = int(np.searchsorted(np.cumsum(probs), request.rng.random() * probs.sum(), side="right"))
    token = min(token, len(probs) - 1)
    return token, float(np.log(probs[token]))


def _logsumexp(x: np.ndarray) -> float:
    top = x.max()
    return float(top + np.log(np.exp(x - top).sum()))


def finish_reason(request: Request, token: int) -> str | None:
    """Why taking `token` would finish the request, or None: end_id, a stop word it completes, max_new_tokens."""
    p = request.params
    if token == p.end_id:
        return "end_id"
    if p.stop_words:
        keep = max(len(w) for w in p.stop_words) - 1  # tokens before `token` a stop word can reach back to
        source = request.output if len(request.output) >= keep else request.prompt + request.output
        tail = [*source[max(0, len(source) - keep) :], token]
        if any(tail[len(tail) - len(w) :] == w for w in p.stop_words):
            return "stop_words"
    if len(request.output) + 1 >= p.max_new_tokens:
        return "length"
    return None


def append(request: Request, token: int, log_prob: float) -> None:
    """Record a sampled token and decide whether the request is done.

    As in TensorRT-LLM: end_id finishes the sequence without becoming part of it (its log-prob still
    counts in cum_log_prob); a stop word stays in the output.
    """
    request.cum_log_prob += log_prob
    request.finish_reason = finish_reason(request, token)
    if request.finish_reason != "end_id":
        request.output.append(token)
        request.log_probs.append(log_prob)
    if request.matcher is not None and not request.finished and not request.matcher.consume_token(token):
        request.finish_reason, request.error = "error", f"guided decoding: {one_line(request.matcher.get_error())}"


def greedy_log_probs(logits: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Log-softmax of each row's argmax `chosen` ([rows, vocab] logits); one formula for sampling and
    speculative acceptance, so both report the same log-probs."""
    top = logits[np.arange(len(logits)), chosen]
    return top - (top + np.log(np.exp(logits - top[:, None]).sum(axis=1)))


def broken_rows(logits: np.ndarray) -> np.ndarray:
    """Per row of [rows, vocab] logits, whether the engine computed NaN or +inf (or nothing finite) there. -inf alone
    is a masked token (guided decoding, bad words), not a fault. One pass over the vocabulary: a row's maximum is NaN
    where any logit is, +inf where one is, -inf where none is finite."""
    return ~np.isfinite(logits.max(axis=-1))
