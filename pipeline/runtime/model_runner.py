"""ModelRunner for the CPU engine, with the calling conventions of TensorRT-LLM's `ModelRunnerCpp`.

Why: code written against `tensorrt_llm.runtime.ModelRunnerCpp` (`from_dir(...)`, then
`generate(batch_input_ids, max_new_tokens=..., end_id=..., streaming=..., return_dict=...)`
returning `output_ids` [batch, beams, max_seq_len] that start with the prompt) runs unchanged on an
engine directory built by the `onnxruntime` target, so examples, benchmarks and the Triton model
need one code path for both targets.

How:
* The KV cache is bound with ONNX Runtime I/O binding and never round-trips through numpy between
  steps. Two graph layouts are served: the fused graph (GroupQueryAttention writes in place into
  a buffer the batch owns; rows of any length, no padding, nothing copied per step: `SharedCache`)
  and the optimum-onnx graph (present = concat(past, new); rows left-padded: `ConcatCache`).
* Decoding is split into steps on a `Batch` whose row i is request i's KV slot: `prefill` (new
  requests -> a batch holding next-token logits), `merge` (requests join a running batch),
  `sample` (one token per row, stop checks), `retire` (finished rows leave, freeing their slot) and
  `decode_step`. `generate` is a loop over these; the Triton python backend reuses them for
  in-flight batching.
"""

from __future__ import annotations

import json
import math
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from pipeline.upstream import facts

ENGINE_TARGET = "onnxruntime"  # the engines this runner reads: the onnxruntime target's (config.json `target`)

ENGINE_CONFIG = "config.json"
ONNX_FILE = "model.onnx"
# Upper bound on the prefill logits buffer ([rows, chunk, vocab] float32): bounds the chunk width.
PREFILL_LOGITS_BYTES = 128 << 20
MAX_DEFAULT_THREADS = 16
# ModelRunnerCpp.from_dir options without a CPU meaning, accepted at these (their default) values.
GPU_OPTION_DEFAULTS = {
    "rank": 0,
    "lora_ckpt_source": "hf",
    "gpu_weights_percent": 1,
    "multi_block_mode": True,
    "use_runtime_defaults": True,
}


# ---------------------------------------------------------------- requests and sampling

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
    finish_reason: str | None = None  # "end_id", "stop_words" or "length" once finished
    draft_misses: int = 0  # speculative decoding: verifications in a row that accepted no draft (drafting backs off)
    rng: np.random.Generator | None = None

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


@dataclass
class Batch:
    """Rows decoding together. Row i of every KV tensor is requests[i]'s slot; `logits` holds each
    row's next-token logits, waiting for `sample`. How the cache is laid out is the graph's business
    (see ConcatCache and SharedCache); `length` is the longest row's cache length."""

    requests: list[Request]
    past: dict  # input name -> OrtValue or ndarray [rows, kv_heads, positions, head_size]
    logits: np.ndarray  # float32 [rows, vocab]
    mask: np.ndarray | None = None  # ConcatCache: int64 [rows, length], 1 where a position holds a real token
    lengths: np.ndarray | None = None  # SharedCache: int [rows], tokens in each row's cache
    bindings: dict = field(default_factory=dict)  # SharedCache: rows bound -> I/O binding of `past`, reused
    row_bindings: dict = field(default_factory=dict)  # SharedCache: row -> binding of its 1-row view (speculation)

    @property
    def length(self) -> int:
        return self.mask.shape[1] if self.mask is not None else int(self.lengths.max(initial=0))

    def __len__(self) -> int:
        return len(self.requests)


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


def greedy_log_probs(logits: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Log-softmax of each row's argmax `chosen` ([rows, vocab] logits); one formula for sampling and
    speculative acceptance, so both report the same log-probs."""
    top = logits[np.arange(len(logits)), chosen]
    return top - (top + np.log(np.exp(logits - top[:, None]).sum(axis=1)))


# ---------------------------------------------------------------- the runner


class ModelRunner:
    """Generate with an `onnxruntime` engine directory (config.json + model.onnx + tokenizer files)."""

    def __init__(
        self,
        engine_dir: Path,
        config: dict,
        session,
        *,
        max_batch_size: int,
        max_input_len: int,
        max_seq_len: int,
        max_beam_width: int,
        batch_invariant: bool = False,
        speculative=None,
    ):
        self.engine_dir = engine_dir
        self.config = config
        self.session = session
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width
        pretrained, built = config["pretrained_config"], config["build_config"]
        self._pretrained = pretrained
        self.end_id, self.pad_id = _special_ids(engine_dir, config)
        self.max_num_tokens = built.get("max_num_tokens") or max_batch_size * max_input_len
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        past = sorted(n for n in inputs if n.startswith("past_key_values."))
        missing = [
            n for n in ["logits", *(p.replace("past_key_values.", "present.") for p in past)] if n not in outputs
        ]
        if missing or not past:
            raise ValueError(
                f"{engine_dir / ONNX_FILE} is not a decoder with KV cache (past_key_values.* -> present.*): "
                f"missing {missing or 'past_key_values.* inputs'}"
            )
        layout = SharedCache if "seqlens_k" in inputs else ConcatCache
        if batch_invariant and layout is ConcatCache:
            raise ValueError(
                f"{engine_dir / ONNX_FILE}: batch-invariant decoding needs the fused graph (target.onnx_graph: fused); "
                "this engine has the optimum graph, whose left-padded rows change with the batch"
            )
        self.cache = layout(
            session,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            vocab_size=self.vocab_size,
            max_num_tokens=self.max_num_tokens,
            max_seq_len=max_seq_len,
            **({"batch_invariant": True} if batch_invariant else {}),
        )
        if speculative is not None and layout is not SharedCache:
            raise ValueError(
                f"{engine_dir / ONNX_FILE}: speculative decoding needs the fused graph (its KV cache is rolled back "
                "in place); rebuild with target.onnx_graph: fused, or remove runtime.speculative"
            )
        self.speculative = speculative  # speculative.NGram or None

    # ------------------------------------------------------------ construction

    @classmethod
    def from_dir(
        cls,
        engine_dir: str | Path,
        *,
        max_batch_size: int | None = None,
        max_input_len: int | None = None,
        max_output_len: int | None = None,
        max_beam_width: int | None = None,
        num_threads: int | None = None,
        thread_spinning: bool = False,
        batch_invariant: bool = False,
        speculative=None,
        **gpu_options,
    ) -> "ModelRunner":
        """Load an engine. Limits default to the engine's build_config and may only be lowered.

        Args:
            max_output_len: if given, max_seq_len becomes max_input_len + max_output_len (as in ModelRunnerCpp).
            num_threads: ONNX Runtime intra-op threads (default: the CPUs this process may use, at most 16).
            thread_spinning: idle threads spin (faster steps when the cores are ours alone) instead of sleeping.
            batch_invariant: a request's greedy tokens do not depend on what else is in the batch or how its prompt
                is chunked (every forward pass runs an even number of rows; see SharedCache._forward).
            speculative: a `pipeline.runtime.speculative.NGram`: greedy requests decode with n-gram drafts.
            gpu_options: other ModelRunnerCpp.from_dir arguments (lora_dir, rank, kv_cache_free_gpu_memory_fraction,
                ...) are accepted when they hold their defaults, and rejected otherwise.
        """
        engine_dir = Path(engine_dir)
        config_file = engine_dir / ENGINE_CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: build the engine first (trtllm-pipeline build CONFIG)")
        config = json.loads(config_file.read_text())
        built = config.get("build_config", {})
        if config.get("target") != ENGINE_TARGET:  # trtllm-build's config.json names no target
            raise ValueError(
                f"{config_file}: target is {config.get('target', 'trtllm')!r}; this runner serves onnxruntime engines "
                "(use tensorrt_llm.runtime.ModelRunnerCpp for TensorRT-LLM engines)"
            )
        unsupported = sorted(
            k for k, v in gpu_options.items() if v not in (None, False) and GPU_OPTION_DEFAULTS.get(k, object()) != v
        )
        if unsupported:
            raise TypeError(f"ModelRunner.from_dir: not supported by the onnxruntime engine: {', '.join(unsupported)}")

        def limit(name: str, requested: int | None) -> int:
            if requested is not None and requested > built[name]:
                raise ValueError(f"{name}={requested} exceeds the engine's {name} {built[name]} ({config_file})")
            return requested or built[name]

        limits = {
            name: limit(name, value)
            for name, value in (
                ("max_batch_size", max_batch_size),
                ("max_input_len", max_input_len),
                ("max_beam_width", max_beam_width),
            )
        }
        limits["max_seq_len"] = built["max_seq_len"]
        if max_output_len is not None:
            limits["max_seq_len"] = limits["max_input_len"] + max_output_len
            if limits["max_seq_len"] > built["max_seq_len"]:
                raise ValueError(
                    f"max_input_len {limits['max_input_len']} + max_output_len {max_output_len} exceeds the engine's "
                    f"max_seq_len {built['max_seq_len']} ({config_file})"
                )
        session = _ort_session(engine_dir / ONNX_FILE, num_threads or default_threads(), thread_spinning)
        return cls(engine_dir, config, session, **limits, batch_invariant=batch_invariant, speculative=speculative)

    # ------------------------------------------------------------ ModelRunnerCpp properties

    @property
    def dtype(self):
        import torch

        return getattr(torch, self._pretrained.get("dtype", "float32"))

    @property
    def vocab_size(self) -> int:
        return self._pretrained["vocab_size"]

    @property
    def vocab_size_padded(self) -> int:
        return self.vocab_size

    @property
    def hidden_size(self) -> int:
        return self._pretrained["hidden_size"]

    @property
    def num_heads(self) -> int:
        return self._pretrained["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self._pretrained.get("num_key_value_heads", self.num_heads)

    @property
    def head_size(self) -> int:
        return self._pretrained.get("head_size") or self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        return self._pretrained["num_hidden_layers"]

    @property
    def max_sequence_length(self) -> int:
        return self.max_seq_len

    @property
    def remove_input_padding(self) -> bool:
        return False

    @property
    def max_prompt_embedding_table_size(self) -> int:
        return 0

    @property
    def gather_context_logits(self) -> bool:
        return False

    @property
    def gather_generation_logits(self) -> bool:
        return False

    # ------------------------------------------------------------ steps (shared with in-flight batching)

    def prefill(self, requests: list[Request]) -> Batch:
        """Run the prompts; the batch holds their next-token logits."""
        return self.cache.prefill(requests)

    def prefill_chunk(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Chunked context: up to `budget` more prompt tokens of one request (start with partial=None);
        once `partial.length == len(request.prompt)` it holds the next-token logits and can be merged."""
        return self.cache.extend(partial, request, budget)

    @property
    def reuses_kv(self) -> bool:
        """Whether a row can start from stored prefix K/V (`seed`, `export`): the fused graph's layout only."""
        return isinstance(self.cache, SharedCache)

    def _empty_row(self, request: Request) -> Batch:
        """A 1-row batch for `request` with an empty cache of the capacity it needs."""
        return Batch([request], self._buffers(1, self._capacity([request])), None, lengths=np.array([0]))

    def seed(self, request: Request, prefix: np.ndarray) -> Batch:
        """A 1-row batch holding `prefix`'s K/V for `request`; continue it with `prefill_chunk`."""
        return self.cache.seed(request, prefix)

    def export(self, batch: Batch, row: int, start: int, stop: int) -> np.ndarray:
        """Row `row`'s K/V at positions [start, stop), for the prefix store."""
        return self.cache.export(batch, row, start, stop)

    def decode_step(self, batch: Batch) -> None:
        """Feed each row's last token; updates the batch's cache and logits."""
        self.cache.decode_step(batch)

    def advance(self, batch: Batch) -> tuple[int, int]:
        """The decode step, speculative when configured; returns (draft tokens verified, drafts accepted)."""
        if self.speculative is None:
            self.decode_step(batch)
            return 0, 0
        from pipeline.runtime.speculative import speculate_step

        return speculate_step(self, batch, self.speculative)

    @staticmethod
    def sample(batch: Batch) -> list[Request]:
        """Choose one token per row from the batch's logits; returns the requests that just finished."""
        logits = batch.logits
        argmax = logits.argmax(axis=1)
        log_probs = greedy_log_probs(logits, argmax)
        done = []
        for row, request in enumerate(batch.requests):
            if request.params.plain_greedy:
                append(request, int(argmax[row]), float(log_probs[row]))
            else:
                append(request, *choose(request, logits[row]))
            if request.finished:
                done.append(request)
        return done

    def retire(self, batch: Batch) -> Batch:
        """The batch without its finished rows (their KV slots are freed)."""
        keep = [i for i, r in enumerate(batch.requests) if not r.finished]
        return batch if len(keep) == len(batch) else self.cache.select(batch, keep)

    def merge(self, a: Batch, b: Batch) -> Batch:
        """One batch from two (requests joining a running batch)."""
        if not len(a):
            return b
        if not len(b):
            return a
        return self.cache.merge(a, b)

    def run(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Drive requests to completion; yields after every step (each live row got one token, or more when
        speculating)."""
        batch = self.prefill(requests)
        while True:
            self.sample(batch)
            yield requests
            batch = self.retire(batch)
            if not len(batch):
                return
            self.advance(batch)

    # ------------------------------------------------------------ ModelRunnerCpp.generate

    def check_inputs(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], beam_widths: Sequence[int]
    ) -> None:
        """Reject what the engine cannot run, naming the input and the limit it breaks; prompt i asks for
        max_new_tokens[i] tokens with beam_widths[i]. One check for `generate` and for the requests of the
        Triton scheduler (`pipeline.runtime.scheduler`), so clients of both get the same messages."""
        if not prompts:
            raise ValueError("the batch is empty: pass one token-id sequence per prompt")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts exceeds max_batch_size {self.max_batch_size}")
        for index, (ids, new_tokens, beams) in enumerate(zip(prompts, max_new_tokens, beam_widths)):
            label, length = f"input {index}", len(ids)
            if beams != 1:
                raise ValueError(
                    f"{label}: beam width {beams} is not supported, the onnxruntime engine does not "
                    f"implement beam search (its max_beam_width is {self.max_beam_width}); use 1"
                )
            if new_tokens < 1:
                raise ValueError(f"{label}: max_tokens must be at least 1, got {new_tokens}")
            if not ids:
                raise ValueError(f"{label} is empty; every prompt needs at least one token")
            if length > self.max_input_len:
                raise ValueError(
                    f"{label}: a prompt of {length} tokens exceeds the engine's max_input_len "
                    f"{self.max_input_len} ({length} is more than max_input_len {self.max_input_len}); "
                    "shorten it"
                )
            if length + new_tokens > self.max_seq_len:
                raise ValueError(
                    f"{label}: {length} prompt tokens + max_tokens {new_tokens} exceed the engine's "
                    f"max_seq_len {self.max_seq_len} ({length + new_tokens} exceeds max_seq_len "
                    f"{self.max_seq_len}); lower max_tokens"
                )
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{label} has token ids outside the vocabulary [0, {self.vocab_size}), e.g. {outside[0]}"
                )

    def check_sampling(self, params: Sequence[SamplingParams]) -> None:
        """Reject settings TensorRT-LLM's executor rejects (`SAMPLING_CHECKS`, tabulated from its source), NaN or
        infinite ones (they turn every log-probability into NaN) and end ids outside the vocabulary, naming the
        input, the bound and the value."""
        for index, p in enumerate(params):
            for name, checker in SAMPLING_SETTINGS.items():
                value = getattr(p, name)
                if name == "top_p" and value <= 0:
                    continue  # tensorrtllm_backend's utils.cc: top_p <= 0 means "no top-p" and is never checked
                broken = [
                    f"{op} {bound}" for op, bound in SAMPLING_CHECKS.get(checker, []) if not OPS[op](value, bound)
                ]
                if broken or not math.isfinite(value):
                    raise ValueError(f"input {index}: {name} must be {' and '.join(broken) or 'finite'}, got {value}")
            if not -1 <= p.end_id < self.vocab_size:  # -1: never end, as TensorRT-LLM's ignore_eos sends it
                raise ValueError(
                    f"input {index}: end_id must be -1 (never end) or a token of the vocabulary "
                    f"[0, {self.vocab_size}), got {p.end_id}"
                )

    def generate(
        self,
        batch_input_ids: Sequence,
        *,
        max_new_tokens: int = 1,
        end_id: int | None = None,
        pad_id: int | None = None,
        temperature: float = 1.0,
        top_k: int = 1,
        top_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        random_seed: int | Sequence[int] | None = None,
        num_beams: int = 1,
        stop_words_list=None,
        bad_words_list=None,
        streaming: bool = False,
        return_dict: bool = False,
        output_sequence_lengths: bool = False,
        output_log_probs: bool = False,
        output_cum_log_probs: bool = False,
        sampling_config=None,
        **unsupported,
    ):
        """Generate for a batch of token-id tensors (or lists), like `ModelRunnerCpp.generate`.

        Returns `output_ids` int32 [batch, 1, max_seq_len]: each row is the prompt then the generated
        tokens (end_id excluded), padded with end_id. With `return_dict`, a dict with `output_ids`,
        `sequence_lengths` [batch, 1] (prompt + generated), and when asked `log_probs`
        [batch, 1, max generated] and `cum_log_probs` [batch, 1]. With `streaming`, a generator
        yielding that result after every decode step.
        """
        import torch

        if sampling_config is not None:  # a tensorrt_llm SamplingConfig: read the fields we implement
            get = lambda name, default: getattr(sampling_config, name, default)  # noqa: E731
            end_id, pad_id = get("end_id", end_id), get("pad_id", pad_id)
            max_new_tokens = get("max_new_tokens", max_new_tokens)
            num_beams, temperature, top_k = (
                get("num_beams", get("beam_width", num_beams)),
                get("temperature", temperature),
                get("top_k", top_k),
            )
            top_p, repetition_penalty = get("top_p", top_p), get("repetition_penalty", repetition_penalty)
            random_seed = get("random_seed", get("seed", random_seed))
        given = sorted(k for k, v in unsupported.items() if v not in (None, False))
        if given:
            raise TypeError(f"generate(): not supported by the onnxruntime engine: {', '.join(given)}")
        prompts = [[int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)] for ids in batch_input_ids]
        self.check_inputs(prompts, [max_new_tokens] * len(prompts), [num_beams or 1] * len(prompts))
        end_id = self.end_id if end_id is None else int(end_id)
        if end_id is None:
            raise ValueError(
                f"no end_id: pass end_id=..., or record end_id in {self.engine_dir / ENGINE_CONFIG} build_config"
            )
        pad_id = end_id if pad_id is None else int(pad_id)
        seeds = list(random_seed) if isinstance(random_seed, (list, tuple)) else [random_seed] * len(prompts)
        stops, bads = to_words_list(stop_words_list, len(prompts)), to_words_list(bad_words_list, len(prompts))
        requests = [
            Request(
                prompt,
                SamplingParams(
                    max_new_tokens,
                    end_id,
                    float(unset_as(temperature, 0.0)),
                    int(unset_as(top_k, 0)),
                    float(unset_as(top_p, 0.0)),
                    float(unset_as(repetition_penalty, 1.0)),
                    int(seeds[i] or 0),
                    stops[i],
                    bads[i],
                ),
            )
            for i, prompt in enumerate(prompts)
        ]
        self.check_sampling([r.params for r in requests])

        def result():
            output_ids = torch.full((len(requests), 1, self.max_seq_len), end_id, dtype=torch.int32)
            for row, r in enumerate(requests):
                output_ids[row, 0, : len(r.prompt) + len(r.output)] = torch.tensor(r.tokens, dtype=torch.int32)
            if not return_dict:
                return output_ids
            out = {
                "output_ids": output_ids,
                "sequence_lengths": torch.tensor(
                    [[len(r.prompt) + len(r.output)] for r in requests], dtype=torch.int32
                ),
            }
            if output_log_probs:
                log_probs = torch.zeros(
                    (len(requests), 1, max(1, max(len(r.log_probs) for r in requests))), dtype=torch.float32
                )
                for row, r in enumerate(requests):
                    log_probs[row, 0, : len(r.log_probs)] = torch.tensor(r.log_probs, dtype=torch.float32)
                out["log_probs"] = log_probs
            if output_cum_log_probs:
                out["cum_log_probs"] = torch.tensor([[r.cum_log_prob] for r in requests], dtype=torch.float32)
            return out

        steps = self.run(requests)
        if streaming:
            return (result() for _ in steps)
        for _ in steps:
            pass
        return result()


# ---------------------------------------------------------------- the two KV-cache layouts


class ConcatCache:
    """The optimum-onnx graph: present = concat(past, new), so every step returns a longer cache.

    Rows are left-padded together (attention_mask 0, position_ids = cumsum(mask) - 1); the cache
    stays in ORT-allocated OrtValues between steps (I/O binding). Long prompts are prefilled in
    column chunks so the [rows, chunk, vocab] logits stay small.
    """

    def __init__(
        self, session, *, num_kv_heads: int, head_size: int, vocab_size: int, max_num_tokens: int, max_seq_len: int
    ):
        self.session = session
        self.num_kv_heads, self.head_size, self.vocab_size, self.max_num_tokens = (
            num_kv_heads,
            head_size,
            vocab_size,
            max_num_tokens,
        )
        self.past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.output_names = [o.name for o in session.get_outputs()]
        # optimum's Gemma 2/3 graphs have no position_ids: they derive positions from attention_mask
        self.takes_positions = any(i.name == "position_ids" for i in session.get_inputs())

    def _forward(self, input_ids: np.ndarray, mask: np.ndarray, past: dict) -> tuple[np.ndarray, dict]:
        """Run the graph on new tokens given the cache; returns last-position logits and the new cache (OrtValues)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, dtype=np.int64))
        if self.takes_positions:
            positions = mask.cumsum(axis=1)[:, -input_ids.shape[1] :] - 1
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(np.maximum(positions, 0), dtype=np.int64))
        for name in self.past_names:
            value = past[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(self.output_names, binding.get_outputs()))
        logits = np.array(outputs["logits"].numpy()[:, -1, :])
        return logits, {name: outputs[name.replace("past_key_values.", "present.")] for name in self.past_names}

    def prefill(self, requests: list[Request]) -> Batch:
        length = max(len(r.prompt) for r in requests)
        ids = np.zeros((len(requests), length), dtype=np.int64)  # padding ids are masked out: any valid id does
        mask = np.zeros((len(requests), length), dtype=np.int64)
        for row, request in enumerate(requests):
            ids[row, length - len(request.prompt) :] = request.prompt
            mask[row, length - len(request.prompt) :] = 1
        budget = min(self.max_num_tokens, max(1, PREFILL_LOGITS_BYTES // (4 * self.vocab_size)))
        chunk = max(1, budget // len(requests))
        past = {
            name: np.zeros((len(requests), self.num_kv_heads, 0, self.head_size), dtype=np.float32)
            for name in self.past_names
        }
        start = 0
        while start < length:
            end = min(length, start + chunk)
            logits, past = self._forward(ids[:, start:end], mask[:, :end], past)
            start = end
        return Batch(list(requests), past, logits, mask=mask)

    def extend(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Up to `budget` more prompt tokens of one request into its own 1-row batch (chunked context)."""
        if partial is None:
            empty = {
                name: np.zeros((1, self.num_kv_heads, 0, self.head_size), dtype=np.float32) for name in self.past_names
            }
            partial = Batch([request], empty, None, mask=np.zeros((1, 0), dtype=np.int64))
        start = partial.length
        chunk = request.prompt[start : start + budget]
        partial.mask = np.ones((1, start + len(chunk)), dtype=np.int64)
        partial.logits, partial.past = self._forward(np.array([chunk]), partial.mask, partial.past)
        return partial

    def decode_step(self, batch: Batch) -> None:
        last = np.array([[r.last_token] for r in batch.requests], dtype=np.int64)
        batch.mask = np.concatenate([batch.mask, np.ones((len(batch), 1), dtype=np.int64)], axis=1)
        batch.logits, batch.past = self._forward(last, batch.mask, batch.past)

    @staticmethod
    def select(batch: Batch, rows: list[int]) -> Batch:
        """Keep `rows`, trimming the left padding no kept row needs."""
        mask = batch.mask[rows]
        start = int(np.argmax(mask.any(axis=0))) if rows else batch.length
        past = {name: np.ascontiguousarray(_numpy(value)[rows, :, start:]) for name, value in batch.past.items()}
        return Batch([batch.requests[i] for i in rows], past, batch.logits[rows], mask=mask[:, start:])

    @staticmethod
    def merge(a: Batch, b: Batch) -> Batch:
        """The shorter cache is left-padded to the longer one."""
        length = max(a.length, b.length)

        def pad(batch: Batch, value) -> np.ndarray:
            return np.pad(_numpy(value), ((0, 0), (0, 0), (length - batch.length, 0), (0, 0)))

        past = {name: np.concatenate([pad(a, a.past[name]), pad(b, b.past[name])]) for name in a.past}
        mask = np.concatenate(
            [np.pad(a.mask, ((0, 0), (length - a.length, 0))), np.pad(b.mask, ((0, 0), (length - b.length, 0)))]
        )
        return Batch(a.requests + b.requests, past, np.concatenate([a.logits, b.logits]), mask=mask)


class SharedCache:
    """The fused graph (`pipeline/targets/onnxruntime/graph.py`): GroupQueryAttention writes each step's keys
    and values in place into a buffer the batch owns, [rows, kv_heads, capacity, head_size].

    Rows need no padding: each has its own length (seqlens_k), so decoding copies nothing; only a
    request joining or leaving copies the buffers once. The capacity is the longest row's prompt +
    max_new_tokens, so memory follows what the batch can need, not max_seq_len. Prompts are
    prefilled together right-padded when they fit in max_num_tokens, else row by row, in chunks of
    max_num_tokens when one prompt is longer (chunked context).
    """

    CAPACITY_STEP = 64  # capacities are rounded up to this: fewer distinct shapes, fewer re-pads on merge

    def __init__(
        self,
        session,
        *,
        num_kv_heads: int,
        head_size: int,
        vocab_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        batch_invariant: bool = False,
    ):
        self.session = session
        self.num_kv_heads, self.head_size, self.max_num_tokens, self.max_seq_len = (
            num_kv_heads,
            head_size,
            max_num_tokens,
            max_seq_len,
        )
        self.past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.spare_rows = int(batch_invariant)  # the dummy row of batch-invariant passes (see _forward)

    def bind(self, past: dict):
        """An I/O binding with the cache buffers as both past and present (GQA writes in place)."""
        import onnxruntime as ort

        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # first: get_outputs()[0]; ORT allocates it on each run
        for name, buffer in past.items():
            value = ort.OrtValue.ortvalue_from_numpy(buffer)  # wraps the buffer, no copy
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
        return binding

    def _forward(
        self,
        batch: Batch,
        input_ids: np.ndarray,
        lengths: np.ndarray,
        logits_index: np.ndarray,
        prompt: bool = True,
        row: int | None = None,
    ) -> np.ndarray:
        """Run new tokens on the batch's first len(input_ids) buffer rows (or on row `row` alone); `lengths` are
        those rows' cache lengths after them. Returns logits [len(logits_index), vocab].

        Batch-invariant: ONNX Runtime's MatMulNBits int8-compute kernel gives the token in a pass's single-row
        remainder (odd row counts) other bits than the rows it takes in pairs, so every pass gets an even number of
        rows. A decode step gets a dummy row (the spare buffer row, 1 token); a prompt pass of one row a dummy
        token after its tokens, so a 1-token chunk takes GroupQueryAttention's prompt path as the whole prompt
        does (the dummy's K/V lands past the row's length and is overwritten later); the logits rows, which the
        graph gathers before lm_head, are doubled when odd.
        """
        rows, width = input_ids.shape
        wanted = len(logits_index)
        if self.spare_rows and rows * width % 2:
            if rows == 1 and prompt:
                input_ids, lengths = np.pad(input_ids, ((0, 0), (0, 1))), lengths + 1
            else:
                input_ids, lengths = np.pad(input_ids, ((0, 1), (0, 0))), np.append(lengths, 1)
        if self.spare_rows and wanted % 2:
            logits_index = np.append(logits_index, logits_index[-1])
        binding = self._binding(batch, len(input_ids), row)
        binding.bind_output("logits", "cpu")  # a fresh output: ORT reuses an allocated one only at its own shape
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", (lengths - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(lengths.max(), dtype=np.int32))
        binding.bind_cpu_input("logits_index", np.ascontiguousarray(logits_index, dtype=np.int64))
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[:wanted]

    def _binding(self, batch: Batch, rows: int, row: int | None):
        """The I/O binding of the batch's first `rows` buffer rows, or of row `row` alone; kept, so the next steps
        bind only their four small inputs."""
        bindings, key = (batch.bindings, rows) if row is None else (batch.row_bindings, row)
        if key not in bindings:
            window = slice(0, rows) if row is None else slice(row, row + 1)  # contiguous: wrapped, not copied
            bindings[key] = self.bind({name: buffer[window] for name, buffer in batch.past.items()})
        return bindings[key]

    def _buffers(self, rows: int, capacity: int) -> dict:
        return {
            name: np.zeros((rows + self.spare_rows, self.num_kv_heads, capacity, self.head_size), dtype=np.float32)
            for name in self.past_names
        }

    def _capacity(self, requests: list[Request]) -> int:
        # + spare_rows: a batch-invariant prefill chunk may write one dummy token past the prompt
        need = max(len(r.prompt) + r.params.max_new_tokens for r in requests) + self.spare_rows
        return max(need, min(self.max_seq_len, -(-need // self.CAPACITY_STEP) * self.CAPACITY_STEP))

    def prefill(self, requests: list[Request]) -> Batch:
        lengths = np.array([len(r.prompt) for r in requests])
        width = int(lengths.max())
        if width * len(requests) <= self.max_num_tokens:
            batch = Batch(list(requests), self._buffers(len(requests), self._capacity(requests)), None, lengths=lengths)
            ids = np.zeros((len(requests), width), dtype=np.int64)
            for row, request in enumerate(requests):
                ids[row, : lengths[row]] = request.prompt
            batch.logits = self._forward(batch, ids, lengths, np.arange(len(requests)) * width + lengths - 1)
            return batch
        rows = []
        for request in requests:  # one at a time, each in pieces of max_num_tokens when longer
            row = None
            while row is None or row.length < len(request.prompt):
                row = self.extend(row, request, self.max_num_tokens)
            rows.append(row)
        return self.merge(*rows)

    def extend(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Up to `budget` more prompt tokens of one request into its own 1-row batch (chunked context;
        GroupQueryAttention takes several tokens after a cache only at batch size 1)."""
        partial = self._empty_row(request) if partial is None else partial
        start = int(partial.lengths[0])
        chunk = request.prompt[start : start + budget]
        partial.lengths = np.array([start + len(chunk)])
        partial.logits = self._forward(partial, np.array([chunk]), partial.lengths, np.array([len(chunk) - 1]))
        return partial

    def _empty_row(self, request: Request) -> Batch:
        """A 1-row batch for `request` with an empty cache of the capacity it needs."""
        return Batch([request], self._buffers(1, self._capacity([request])), None, lengths=np.array([0]))

    def seed(self, request: Request, prefix: np.ndarray) -> Batch:
        """A 1-row batch whose cache starts with `prefix` ([past inputs, kv_heads, tokens, head_size], stored by
        `pipeline.runtime.kv_cache`): `extend` prefills the rest of the prompt after it."""
        partial = self._empty_row(request)
        for name, kv in zip(self.past_names, prefix):
            partial.past[name][0, :, : kv.shape[1]] = kv
        partial.lengths = np.array([prefix.shape[2]])
        return partial

    def export(self, batch: Batch, row: int, start: int, stop: int) -> np.ndarray:
        """A copy of row `row`'s K/V at positions [start, stop), [past inputs, kv_heads, positions, head_size]."""
        return np.stack([batch.past[name][row, :, start:stop] for name in self.past_names])

    def decode_step(self, batch: Batch) -> None:
        batch.lengths = batch.lengths + 1
        last = np.array([[r.last_token] for r in batch.requests], dtype=np.int64)
        batch.logits = self._forward(batch, last, batch.lengths, np.arange(len(batch)), prompt=False)

    def room(self, batch: Batch, row: int) -> int:
        """Positions left in the row's cache buffer (less the batch-invariant dummy token's)."""
        return next(iter(batch.past.values())).shape[2] - int(batch.lengths[row]) - self.spare_rows

    def verify(self, batch: Batch, row: int, tokens: list[int]) -> np.ndarray:
        """Run several tokens of one row after its cache (speculative drafts), on a 1-row view of the batch's
        buffers (row i of a C-contiguous [rows, ...] buffer is contiguous: wrapped, not copied); returns the
        logits after each token, [len(tokens), vocab]. The row's length grows by len(tokens)."""
        lengths = batch.lengths[row : row + 1] + len(tokens)
        logits = self._forward(batch, np.array([tokens]), lengths, np.arange(len(tokens)), row=row)
        batch.lengths[row] = lengths[0]
        return logits

    def select(self, batch: Batch, rows: list[int]) -> Batch:
        spare = [len(batch)] * self.spare_rows  # the spare row's content is never read: any row will do
        past = {name: buffer[rows + spare] for name, buffer in batch.past.items()}
        return Batch([batch.requests[i] for i in rows], past, batch.logits[rows], lengths=batch.lengths[rows])

    def merge(self, *batches: Batch) -> Batch:
        """Rows of all, in buffers of the largest capacity: one copy of each row, however many batches."""
        capacity = max(buffer.shape[2] for batch in batches for buffer in batch.past.values())
        merged = Batch(
            [r for batch in batches for r in batch.requests],
            self._buffers(sum(len(batch) for batch in batches), capacity),
            np.concatenate([batch.logits for batch in batches]),
            lengths=np.concatenate([batch.lengths for batch in batches]),
        )
        for name, buffer in merged.past.items():
            start = 0
            for batch in batches:
                source = batch.past[name]
                buffer[start : start + len(batch), :, : source.shape[2]] = source[: len(batch)]
                start += len(batch)
        return merged


# ---------------------------------------------------------------- helpers


def default_threads() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_THREADS))


def _ort_session(onnx_path: Path, threads: int, spinning: bool = False):
    """A CPU session whose idle threads sleep unless `spinning`: spinning threads make 2-core work ~20x
    slower when other work shares the cores, and decode ~20% faster when it does not."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
    options.add_session_config_entry("session.inter_op.allow_spinning", str(int(spinning)))
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for missing or corrupt files
        raise RuntimeError(
            f"cannot load {onnx_path}: {exc}; rebuild the engine (trtllm-pipeline build CONFIG --force)"
        ) from None


def _special_ids(engine_dir: Path, config: dict) -> tuple[int | None, int | None]:
    """end_id and pad_id: build_config, then top-level config, then the engine's generation_config.json."""
    built = config.get("build_config", {})
    generation = {}
    if (engine_dir / "generation_config.json").is_file():
        generation = json.loads((engine_dir / "generation_config.json").read_text())

    def first(*values):
        for value in values:
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return None

    end_id = first(built.get("end_id"), config.get("end_id"), generation.get("eos_token_id"))
    pad_id = first(built.get("pad_id"), config.get("pad_id"), generation.get("pad_token_id"), end_id)
    return end_id, pad_id


def _numpy(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()
