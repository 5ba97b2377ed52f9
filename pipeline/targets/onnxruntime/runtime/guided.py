"""Guided (constrained) decoding for the CPU runtime: a request's grammar masks its logits before every choice.

A request names its guide as TensorRT-LLM's `tensorrt_llm` model takes it: `guided_decoding_guide_type` (one of
`GUIDE_TYPES`, tabulated from the release's model) and `guided_decoding_guide` (the schema, regex or grammar text).
`Grammars` compiles each guide once per engine (cached) on a thread of its own into a matcher whose copy follows the
request: `constrain` masks a row's logits with the tokens the grammar allows next, and `sampling.append` advances the
matcher by the chosen token, so sampling, speculative drafts and their verification all see the same state.

Why a thread of its own: a 1 MB schema took 1.5-9 s to compile here, and compiled where the request arrives (the
Triton model's `execute`, which takes the instance's next request only once it returns: triton-inference-server/
python_backend README.md, "Async Execute", 00f0cb8873651fd0d93bb7273727178e6814d9ab) every request behind it waited
that long. llguidance drops the GIL while it builds a matcher (guidance-ai/llguidance python/llguidance/_lib.pyi,
`LLMatcher`, b89c8ebaefde9c20d15b06266fb02686a60fc216; measured too), so the decode loop goes on meanwhile; the
request waits for its own guide alone, COMPILE_SECONDS at most.

Why llguidance: measured against xgrammar 0.2.8 on this engine's 49,152-token vocabulary (docs/serving.md, "Guided
decoding"), both compute a step's mask in a small fraction of a decode step, but xgrammar's matcher needs torch
(seconds more start-up in the engine's Triton process, which runs without it) and pulls in the `triton` compiler
package; llguidance needs neither, compiles every guide type the `tensorrt_llm` model names, and is the other
backend TensorRT-LLM's LLM API accepts (`guided_decoding_backend: llguidance`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pipeline.upstream import facts

# The `guided_decoding_guide_type` values of TensorRT-LLM's `tensorrt_llm` model in the release the CPU model mirrors
# (a table of its own, so a new TensorRT-LLM release re-runs no CPU build: scripts/dev/tabulate_cpu_llm_interface.py).
GUIDE_TYPES: tuple[str, ...] = tuple(facts("cpu_llm_interface")["guide_types"])
# JSON's layout is the model's, within llama.cpp's bounds: between tokens a space, or one or two newlines and up to 20
# spaces or tabs (SPACE_RULE in ggml-org/llama.cpp common/json-schema-to-grammar.cpp at
# 011c6c3c305634c65886cf7f32805907f667590c, and in the copy llama-cpp-python 0.3.36's sdist vendors, the peer we run).
# Measured on JSONSchemaBench against one line with ", " and ": " (docs/serving.md, "JSON layout"): as many valid
# answers or more.
JSON_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})?",
    "item_separator": ",",
    "key_separator": ":",
}
# JSON without the model's whitespace, where the tokens a guide forces are counted (`Grammars._compile`)
ONE_LINE = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64
# llguidance's limits bound a compile's work: grammars of 50,000 symbols at most (its default: 500,000), which compiled
# here in 0.5-1.4 s (schemas of 30,000-60,000 symbols, 0.4-0.8 MB), 3 s for an object of 4,000 optional properties;
# 9,000 such properties were refused after 6 s, where they compiled in 25 s (under a load of 6 on 2 cores). Errors
# come without llguidance's parser state and grammar (up to the whole schema).
LIMITS = llguidance.LLParserLimits(max_grammar_size=50_000, verbose_errors=False)
# How long a request waits for its guide's compile: llguidance's limits count sizes and fuel, not time. A compile
# cannot be interrupted: it goes on past the bound, and its guide is cached for the next request.
COMPILE_SECONDS = 10.0


@dataclass(frozen=True)
class Guide:
    """What a request constrains its output to: `kind` is one of GUIDE_TYPES, `text` the schema, regex or grammar
    ("json" takes any JSON object and no text)."""

    kind: str
    text: str = ""


def grammar(guide: Guide, layout: dict | None = None) -> str:
    """The guide as an llguidance grammar; ValueError naming the problem for a guide that does not compile."""
    if guide.kind == "json":  # TensorRT-LLM's "any JSON": an object (OpenAI's json_object)
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS, overrides=layout
        )
    if guide.kind == "json_schema":  # the text as is: parsed by llguidance, not into Python objects first
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(guide.text, defaults=JSON_OPTIONS, overrides=layout)
        except ValueError as exc:
            raise ValueError(f"guided_decoding_guide (json_schema): not valid JSON, or not an object: {exc}") from None
    if guide.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guide.text)
    if guide.kind == "ebnf_grammar":  # GBNF / xgrammar's EBNF (`root ::= ...`), as TensorRT-LLM's xgrammar reads it
        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(guide.text))
        except GbnfToLarkError as exc:
            raise ValueError(f"guided_decoding_guide: the EBNF grammar does not parse: {exc}") from None
    raise ValueError(
        f"guided_decoding_guide_type {guide.kind!r} is not one of {', '.join(GUIDE_TYPES)}: use one of those"
    )


def one_line(error: str) -> str:
    """An llguidance error as one line: its lines joined, without the marker that stands for the left-out state."""
    return " ".join(line.strip() for line in error.splitlines() if line.strip() not in ("", "<non-verbose/>"))


class Grammars:
    """Guides compiled for one engine's tokenizer, the last CACHED_GRAMMARS kept: a request gets a copy of its
    guide's matcher, so a schema many requests share is compiled once. One thread compiles, one guide at a time: a
    compile takes one core from the decode loop, never more."""

    def __init__(self, tokenizer_file: Path, end_id: int, vocab_size: int, max_seq_len: int):
        self._tokenizer = (tokenizer_file, end_id, vocab_size)
        self.max_seq_len = max_seq_len
        self._compiled: OrderedDict[Guide, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()  # submits arrive on Triton's threads
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guide-compiler")

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built by the first compile, on the compiling thread (0.4 s for 49,152 tokens, the GIL held throughout)."""
        tokenizer_file, end_id, vocab_size = self._tokenizer
        return llguidance.LLTokenizer(tokenizer_file.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=end_id)

    def compile(self, guide: Guide) -> Future[llguidance.LLMatcher]:
        """The guide's compiled matcher, to be copied for each request, once the compiling thread has it (at once
        when cached); its exception, a ValueError with a message for the client, when the guide does not compile."""
        with self._lock:
            compiled = self._compiled.get(guide)
            if compiled is not None:
                self._compiled.move_to_end(guide)
                return compiled
            compiled = self._compiled[guide] = self._worker.submit(self._compile, guide)
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher for `guide`, waiting for its compile; ValueError when it does not compile."""
        return self.compile(guide).result().deep_copy()

    def _compile(self, guide: Guide) -> llguidance.LLMatcher:
        compiled = llguidance.LLMatcher(self.tokenizer, grammar(guide), log_level=0, limits=LIMITS)
        first = np.zeros(llguidance.numpy.get_bitmask_shape(1, self.tokenizer.vocab_size), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(compiled, first, 0)  # builds the lexer now, not on the first step
        if compiled.is_error():
            raise ValueError(f"guided_decoding_guide ({guide.kind}): {one_line(compiled.get_error())}")
        # The tokens the guide forces before the model chooses any, taken on a copy: a guide that has no finite
        # instance forces them without end (llguidance stops at its limits), and fails at the first token otherwise.
        # JSON's copy is compiled on one line: where whitespace is the model's to choose, nothing is forced.
        forced = (
            llguidance.LLMatcher(self.tokenizer, grammar(guide, ONE_LINE), log_level=0, limits=LIMITS)
            if guide.kind in ("json", "json_schema")
            else compiled.deep_copy()
        )
        tokens = forced.compute_ff_tokens()
        if len(tokens) >= self.max_seq_len:
            raise ValueError(
                f"guided_decoding_guide ({guide.kind}): the output the guide forces is longer than max_seq_len "
                f"{self.max_seq_len} (a guide with no finite instance, such as a required property that refers back "
                "to its own object, forces one without end); let its recursion end, e.g. make that property optional"
            )
        forced.consume_tokens(tokens)
        if forced.is_error():
            raise ValueError(f"guided_decoding_guide ({guide.kind}): {one_line(forced.get_error())}")
        return compiled


def constrain(matcher: llguidance.LLMatcher, logits: np.ndarray) -> None:
    """Set to -inf, in place, the logits (one row) of every token the matcher's grammar does not allow next."""
    bitmask = np.zeros(llguidance.numpy.get_bitmask_shape(1, len(logits)), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask[0])
