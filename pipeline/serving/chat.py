"""/v1/chat/completions (vLLM's serving_chat): the messages go through the model's chat template, and the answer
comes back as `chat.completion` (chunks).

With `tools`, a template that renders tools gets them, any other a system message describing them (`tool_prompt`);
an answer that calls them comes back as `tool_calls` (streamed, in one chunk at its end, since only the whole answer
tells). The tools, like `response_format`, become the engine's guided-decoding guide (`pipeline.serving.protocol`).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pipeline.serving.protocol import ChatRequest, OpenAIError, parse_calls, tool_prompt
from pipeline.serving.responses import Shape, respond
from pipeline.serving.state import Shared

router = APIRouter()


class ChatShape(Shape):
    """A chat completion's choice: a message (a delta when streamed), or the tool calls it makes."""

    where, id_prefix, object, chunk_object = "messages", "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, body: ChatRequest):
        super().__init__(body)
        self.tools = body.callable_tools  # an answer that calls them is tool calls, not content
        self.whole = bool(self.tools)  # whether the answer is tool calls shows at its end

    def logprobs(self, pieces: list[tuple[str, float]], offset: int) -> dict | None:
        if not self.body.logprobs:
            return None
        content = [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []} for t, p in pieces]
        return {"content": content}

    def render(self, text: str, finish: str | None, logprobs: dict | None) -> dict:
        message = {"role": "assistant", "content": text}
        calls = parse_calls(text, self.tools) if self.tools and finish is not None else None
        if calls:  # OpenAI: no content, the calls (streamed: each with its index), finish_reason tool_calls
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            if self.body.stream:
                message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = "tool_calls"
        return {
            "index": 0,
            "delta" if self.body.stream else "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }


async def chat_prompt(tokenizer, body: ChatRequest) -> str:
    """The prompt the chat template makes of the messages (and tools), rendered on a worker thread."""
    from jinja2 import TemplateError

    tools = body.callable_tools
    renders_tools = "tools" in (tokenizer.chat_template or "")  # else the tools go in a system message
    messages = [m.for_template(renders_tools) for m in body.messages]
    if tools and not renders_tools:
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tool_prompt(tools)}
        else:
            messages.insert(0, {"role": "system", "content": tool_prompt(tools)})
    options = {"tools": [tool.model_dump(exclude_none=True) for tool in tools]} if tools and renders_tools else {}
    try:
        return await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=False, **options
        )
    except TemplateError as exc:
        raise OpenAIError(400, f"the model's chat template refused the messages: {exc}", param="messages") from None


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, gateway: Shared):
    await asyncio.to_thread(gateway.check, body)
    prompt = await chat_prompt(gateway.tokenizer, body)
    return await respond(gateway, prompt, ChatShape(body), request)
