"""/v1/completions (vLLM's serving_completion): the prompt as given, the answer as `text_completion` (chunks)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pipeline.serving.protocol import CompletionRequest
from pipeline.serving.responses import Shape, respond
from pipeline.serving.state import Shared

router = APIRouter()


class CompletionShape(Shape):
    """A text completion's choice: the text, with each piece's offset in the answer when log-probabilities are asked
    for."""

    where, id_prefix, object, chunk_object = "prompt", "cmpl", "text_completion", "text_completion"

    def logprobs(self, pieces: list[tuple[str, float]], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        starts = []
        for text, _ in pieces:
            starts.append(offset)
            offset += len(text)
        return {
            "tokens": [t for t, _ in pieces],
            "token_logprobs": [p for _, p in pieces],
            "top_logprobs": None,
            "text_offset": starts,
        }

    def render(self, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, gateway: Shared):
    await asyncio.to_thread(gateway.check, body)
    return await respond(gateway, body.prompt, CompletionShape(body), request)
