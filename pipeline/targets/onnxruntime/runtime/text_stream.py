"""A row's streamed tokens as text deltas, decoded incrementally where the tokens are made: the LLM model's optional
`text_output`, so that a client reading text (the OpenAI gateway) needs neither the BLS nor the postprocessing model
between it and the engine, and no process decodes a whole answer again at every token.

Each step decodes a window of a few tokens, twice: the tokens already shown before the new ones, then with them; the
delta is what the new ones add (vLLM's incremental detokenization: the window keeps SentencePiece's leading spaces
and byte-level BPE's multi-token characters right). The window starts on an anchor token, as the postprocessing
model's decode does, so the text is the same as the BLS streams: the tokens' own text, special tokens skipped, never
"cleaned up" (`pipeline/triton/models/postprocessing.py` says why), and no bytes of a character the tokens end inside.
"""

from __future__ import annotations

DECODE = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


class TextStream:
    """The text of one row's output tokens, given to `add` as they come; `add` returns what they add to it."""

    def __init__(self, tokenizer, anchor: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(anchor)
        self.prefix = 0  # the window: tokens[prefix:shown] are shown and decoded before the new ones
        self.shown = len(anchor)

    def add(self, tokens: list[int], final: bool = False) -> str:
        """What `tokens` add; the `final` tokens also give the text of bytes held back before them, but not those of
        a character they end inside (the BLS drops the same)."""
        self.tokens += tokens
        before = self.tokenizer.decode(self.tokens[self.prefix : self.shown], **DECODE)
        text = self.tokenizer.decode(self.tokens[self.prefix :], **DECODE)
        if final:
            text = text.rstrip("\ufffd")
        elif text.endswith("\ufffd"):  # inside a character: its next token completes it
            return ""
        if len(text) <= len(before):
            return ""
        self.prefix, self.shown = self.shown, len(self.tokens)
        return text[len(before) :]


def anchor_of(tokenizer) -> list[int]:
    """The token every row's window starts on (the postprocessing model's: the last of "a")."""
    return tokenizer.encode("a", add_special_tokens=False)[-1:]
