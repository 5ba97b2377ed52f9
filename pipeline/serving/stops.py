"""Stop strings, found in the text by the gateway: a stop string may end inside a token, where the engine's
token-level stop words cannot see it.

The streamed and the non-streamed answer are made by one iterator (`Generation.pieces`), which holds back text that
may begin a stop string and cuts at the first one; the engine, given the same stop words, ends generation there, or
the gateway stops it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from pipeline.serving.upstream import Piece

# After a stop string the engine, given the same stop words, usually ends the generation itself within a step, so
# the rest of the stream is read rather than stopped (see `Generation.pieces`). A stop string the engine does not
# see (one that does not end on a token boundary) is stopped after this grace.
STOP_DRAIN_S = 0.5


def first_stop(text: str, stops: list[str]) -> int:
    """Where the first stop string in text begins, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of text that begins a stop string: text the next piece may make a stop."""
    return max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)


@dataclass
class Generation:
    """One choice as the upstream streams it, cut at the first stop string: `pieces` is what the streamed and the
    collected answer are both made of, so the two cannot differ. A piece is one streamed response (one token,
    several that make one character together, or the tokens the LLM model merged into one response when they piled
    up and no log-probability per token was asked for) with its log-probability. `tokens` counts whole pieces: where
    a stop string ends inside a merged piece, the piece's tokens after it count too."""

    stops: list[str]
    text: str = ""  # the visible text so far
    tokens: int = 0  # tokens received, those in the response that completed a stop string included
    stopped: bool = False  # by a stop string

    async def pieces(self, upstream: AsyncIterator[Piece]) -> AsyncIterator[tuple[str, float]]:
        """The visible (text, log-probability) pieces. Text that may begin a stop string is held back until the
        next pieces tell; at the first stop string the text is cut, and the upstream is read to its end or, after
        STOP_DRAIN_S, closed, which stops generation (`Upstream.generate`)."""
        held: list[tuple[str, float]] = []  # pieces not yet visible (none of them before a visible one)
        unseen = 0.0  # log-probability of tokens that added no text yet
        try:
            async for delta, log_probs in upstream:
                self.tokens += len(log_probs)
                unseen += sum(log_probs)
                if not delta:
                    continue
                held.append((delta, unseen))
                unseen = 0.0
                # a stop string cannot begin in visible text: that text would still be held
                pending = "".join(text for text, _ in held)
                cut = first_stop(pending, self.stops)
                self.stopped = cut >= 0
                end = cut if self.stopped else len(pending) - stop_prefix_len(pending, self.stops)
                while held and end > 0:
                    text, log_prob = held[0]
                    if len(text) > end and not self.stopped:
                        break  # a piece is shown whole, unless a stop string cuts it
                    held.pop(0)
                    text = text[:end]
                    end -= len(text)
                    self.text += text
                    yield text, log_prob
                if self.stopped:
                    await _drain(upstream, STOP_DRAIN_S)
                    return
            for text, log_prob in held:
                self.text += text
                yield text, log_prob
        finally:
            await upstream.aclose()


async def _drain(upstream: AsyncIterator, grace_s: float) -> None:
    """Read and drop what `upstream` still yields, for at most `grace_s` seconds."""
    try:
        async with asyncio.timeout(grace_s):
            async for _ in upstream:
                pass
    except TimeoutError:
        pass
