"""One generation answered in OpenAI's shape, whole or streamed as server-sent events: what chat and text
completions share (vLLM's serving_engine); each says how its choices look (`Shape`).

The prompt is counted against the engine's limits first (tokenizing runs on worker threads, so a huge prompt does
not hold up other requests), and max_tokens, when unset, is what fits, up to the default. `usage` counts and
`logprobs` come from the engine (one log-probability per generated token). With `stream_options.include_usage`,
usage comes in a last chunk with no choices (and, with vLLM's `continuous_usage_stats`, in every chunk). A stream
whose upstream fails after it started ends with an error event and `[DONE]`; a client that hangs up stops the
generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pipeline.serving.protocol import INT32_MAX, OpenAIError, Sampling, StreamOptions
from pipeline.serving.state import Gateway
from pipeline.serving.stops import Generation

Visible = AsyncIterator[tuple[str, float]]  # the answer's (text, log-probability) pieces: `Generation.pieces`


class Shape(ABC):
    """What differs between a chat and a text completion's answer: the names, and how one choice is written."""

    where: str  # the request's field holding the prompt, as errors name it
    id_prefix: str
    object: str
    chunk_object: str
    whole = False  # a stream's answer comes in one chunk at its end (where tool calls show)

    def __init__(self, body: Sampling):
        self.body = body

    def choice(
        self,
        text: str,
        finish: str | None,
        pieces: list[tuple[str, float]] | None,
        offset: int = 0,
        answer: str | None = None,
    ) -> dict:
        """A choice of `text` (of a stream's chunk, its pieces starting at character `offset` of the answer). The
        choice that finishes a JSON answer (`answer`, the whole of it: `text` unless streamed) says whether it is
        valid for the client's schema (`structured_output`)."""
        choice = self.render(text, finish, None if pieces is None else self.logprobs(pieces, offset))
        constraint = self.body.constraint
        if finish is not None and constraint is not None and constraint.schema is not None:
            choice["structured_output"] = constraint.schema.check(text if answer is None else answer)
        return choice

    @abstractmethod
    def logprobs(self, pieces: list[tuple[str, float]], offset: int) -> dict | None:
        """The choice's `logprobs` field (None when not asked for)."""

    @abstractmethod
    def render(self, text: str, finish: str | None, logprobs: dict | None) -> dict:
        """The choice as this endpoint writes it."""


@dataclass
class Answer:
    """One request's answer as it is generated: its ids, its token budget and the generation counted against it."""

    shape: Shape
    prompt_tokens: int
    max_tokens: int
    generation: Generation
    id: str = field(init=False)
    created: int = field(init=False)

    def __post_init__(self):
        self.created, self.id = int(time.time()), f"{self.shape.id_prefix}-{uuid.uuid4().hex}"

    def header(self, kind: str) -> dict:
        """The fields every response and chunk starts with; `kind`: its `object`."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.shape.body.model}

    def finish_reason(self) -> str:
        """End-of-sequence is never in the output (ours or TensorRT-LLM's executor), so fewer tokens than
        max_tokens is the engine's own word that it stopped (end-of-sequence or a token-level stop word)."""
        return "stop" if self.generation.stopped or self.generation.tokens < self.max_tokens else "length"

    def usage(self) -> dict:
        total = self.prompt_tokens + self.generation.tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generation.tokens, "total_tokens": total}


async def budget(gateway: Gateway, prompt: str, body: Sampling, where: str) -> tuple[int, int]:
    """(prompt tokens, max_tokens), or a 400 naming the field when they do not fit the engine."""
    prompt_tokens = len(await asyncio.to_thread(gateway.tokenizer.encode, prompt))
    max_input_len, max_seq_len = gateway.max_input_len, gateway.max_seq_len
    if prompt_tokens == 0:
        raise OpenAIError(400, "the prompt is empty", param=where)
    if max_input_len and prompt_tokens > max_input_len:
        raise OpenAIError(
            400, f"{where}: {prompt_tokens} tokens exceed the engine's max_input_len {max_input_len}", param=where
        )
    room = max_seq_len - prompt_tokens if max_seq_len else INT32_MAX
    max_tokens = body.token_limit() or max(1, min(gateway.default_max_tokens, room))  # unset: what fits
    if max_tokens > room:
        raise OpenAIError(
            400,
            f"max_tokens: {prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the engine's "
            f"max_seq_len {max_seq_len}",
            param="max_tokens",
        )
    return prompt_tokens, max_tokens


async def respond(gateway: Gateway, prompt: str, shape: Shape, request: Request):
    """The answer to `shape.body` on `prompt`: a JSON body, or a stream when the request asks for one."""
    body = shape.body
    prompt_tokens, max_tokens = await budget(gateway, prompt, body, shape.where)
    answer = Answer(shape, prompt_tokens, max_tokens, Generation(body.stops()))
    visible = answer.generation.pieces(gateway.upstream.generate(prompt, body, max_tokens))
    if not body.stream:
        return await collected(answer, visible, request)
    first = await anext(visible, None)  # fail before the 200 status line when the first response is an error
    return StreamingResponse(events(answer, visible, first), media_type="text/event-stream")


async def collected(answer: Answer, visible: Visible, request: Request) -> dict:
    """The whole answer; a client that hangs up stops the generation (cancelling closes the stream: a `stop`)."""

    async def collect() -> list[tuple[str, float]]:
        return [piece async for piece in visible]

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise OpenAIError(499, "client closed the request")
    return {
        **answer.header(answer.shape.object),
        "choices": [answer.shape.choice(answer.generation.text, answer.finish_reason(), task.result())],
        "usage": answer.usage(),
    }


def event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def events(answer: Answer, visible: Visible, first: tuple[str, float] | None) -> AsyncIterator[str]:
    """The answer's server-sent events, from its `first` piece on, then `[DONE]`."""
    shape, generation = answer.shape, answer.generation
    header = answer.header(shape.chunk_object)
    options = shape.body.stream_options or StreamOptions()
    with_usage, continuous = options.include_usage, options.include_usage and options.continuous_usage_stats
    if with_usage:  # OpenAI: every chunk has the field, null but in the last one
        header["usage"] = None

    def chunk(choices: list[dict]) -> str:
        return event({**header, "choices": choices, **({"usage": answer.usage()} if continuous else {})})

    try:
        piece = first
        while piece is not None and not shape.whole:
            offset = len(generation.text) - len(piece[0])
            yield chunk([shape.choice(piece[0], None, [piece], offset)])
            piece = await anext(visible, None)
        if shape.whole:
            pieces = [first, *[piece async for piece in visible]] if first is not None else []
            yield chunk([shape.choice(generation.text, answer.finish_reason(), pieces)])
        else:
            yield chunk([shape.choice("", answer.finish_reason(), None, answer=generation.text)])
        if with_usage:
            yield event({**header, "choices": [], "usage": answer.usage()})
    except Exception as exc:  # after the 200 the error can only go in-band (e.g. tritonserver stopped)
        error = exc if isinstance(exc, OpenAIError) else OpenAIError(500, repr(exc), "server_error")
        yield event(error.body())
    finally:  # client gone: closing the stream stops the engine (`Upstream.generate`)
        await visible.aclose()
    yield "data: [DONE]\n\n"
