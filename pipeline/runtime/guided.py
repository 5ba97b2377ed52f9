"""Guided (constrained) decoding for the CPU runtime: a request's grammar masks its logits before every choice.

A request names its guide as TensorRT-LLM's `tensorrt_llm` model takes it: `guided_decoding_guide_type` (one of
`GUIDE_TYPES`, tabulated from the release's model) and `guided_decoding_guide` (the schema, regex or grammar text).
`Grammars` compiles each guide once per engine (cached, at submit time: never on the decode loop) into a matcher
whose copy follows the request: `constrain` masks a row's logits with the tokens the grammar allows next, and
`sampling.append` advances the matcher by the chosen token, so sampling, speculative drafts and their verification
all see the same state.

Why llguidance: measured against xgrammar 0.2.8 on this engine's 49,152-token vocabulary (docs/serving.md, "Guided
decoding"), both compute a step's mask in a small fraction of a decode step, but xgrammar's matcher needs torch
(seconds more start-up in the engine's Triton process, which runs without it) and pulls in the `triton` compiler
package; llguidance needs neither, compiles every guide type the `tensorrt_llm` model names, and is the other
backend TensorRT-LLM's LLM API accepts (`guided_decoding_backend: llguidance`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pipeline.upstream import facts

# The `guided_decoding_guide_type` values of TensorRT-LLM's `tensorrt_llm` model (tensorrtllm_backend v0.19.0, the
# interface the CPU model mirrors; scripts/dev/tabulate_trtllm_backend.py).
GUIDE_TYPES: tuple[str, ...] = tuple(facts("tensorrtllm_backend")["releases"]["0.19"]["guide_types"])
# JSON is generated on one line with a space after ',' and ':' (the separators xgrammar uses without any_whitespace):
# flexible whitespace lets a small model spend its tokens on newlines and indentation.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class Guide:
    """What a request constrains its output to: `kind` is one of GUIDE_TYPES, `text` the schema, regex or grammar
    ("json" takes any JSON object and no text)."""

    kind: str
    text: str = ""


def grammar(guide: Guide) -> str:
    """The guide as an llguidance grammar; ValueError naming the problem for a guide that does not compile."""
    if guide.kind == "json":  # TensorRT-LLM's "any JSON": an object (OpenAI's json_object)
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if guide.kind == "json_schema":
        try:
            schema = json.loads(guide.text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"guided_decoding_guide: the JSON schema is not valid JSON: {exc}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
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


class Grammars:
    """Guides compiled for one engine's tokenizer, the last CACHED_GRAMMARS kept: a request gets a copy of its
    guide's matcher, so a schema many requests share is compiled once."""

    def __init__(self, tokenizer_file: Path, end_id: int, vocab_size: int):
        tokenizer = tokenizer_file.read_text(encoding="utf-8")
        self.tokenizer = llguidance.LLTokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_id)
        self._compiled: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # submits arrive on Triton's threads

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher for `guide`; ValueError, with a message for the client, when it does not compile."""
        with self._lock:
            compiled = self._compiled.get(guide)
            if compiled is not None:
                self._compiled.move_to_end(guide)
                return compiled.deep_copy()
        text = grammar(guide)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"guided_decoding_guide ({guide.kind}): {error}")
        compiled = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        first = np.zeros(llguidance.numpy.get_bitmask_shape(1, self.tokenizer.vocab_size), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(compiled, first, 0)  # builds the lexer now, not on the first step
        if compiled.is_error():
            raise ValueError(f"guided_decoding_guide ({guide.kind}): {compiled.get_error()}")
        with self._lock:
            self._compiled[guide] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def constrain(matcher: llguidance.LLMatcher, logits: np.ndarray) -> None:
    """Set to -inf, in place, the logits (one row) of every token the matcher's grammar does not allow next."""
    bitmask = np.zeros(llguidance.numpy.get_bitmask_shape(1, len(logits)), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask[0])
