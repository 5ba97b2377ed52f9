"""An OpenAI-compatible HTTP front door for a served repository (`trtllm-pipeline serve --openai`).

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming as server-sent events) are
translated into requests to the repository's `tensorrt_llm_bls` model over gRPC streaming; the BLS is
used rather than the ensemble because only it stops generating when the client goes away (the
gateway cancels its gRPC stream on disconnect). Chat messages go through the model's chat template;
`usage` counts come from the engine (one log-probability per generated token). Errors use OpenAI's
error body and HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from pipeline.triton.client import client_inputs


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)  # one choice per request, like the engine's beam width 1
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension: end of sequence is blocked until this many tokens


class CompletionRequest(Sampling):
    prompt: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def create_app(
    grpc_url: str,
    tokenizer_dir: str,
    served_name: str,
    triton_model: str = "tensorrt_llm_bls",
    default_max_tokens: int = 256,
) -> FastAPI:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    app = FastAPI(title="trtllm-pipeline OpenAI gateway")

    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return JSONResponse(
            {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": None}},
            status_code=exc.status,
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return JSONResponse(
            {
                "error": {
                    "message": f"{param}: {first['msg']}" if param else first["msg"],
                    "type": "invalid_request_error",
                    "param": param,
                    "code": None,
                }
            },
            status_code=400,
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": served_name, "object": "model", "created": 0, "owned_by": "trtllm-pipeline"}],
        }

    def check_model(body: Sampling) -> None:
        if body.model != served_name:
            raise OpenAIError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{served_name}'",
                "not_found_error",
                "model",
            )

    async def generate(prompt: str, body: Sampling) -> AsyncIterator[tuple[str, int]]:
        """(text delta, tokens in it) as the BLS streams them; cancelling the iterator cancels generation."""
        import tritonclient.grpc.aio as grpcclient

        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        greedy = body.temperature == 0
        params = {
            "text_input": prompt,
            "max_tokens": body.max_tokens or default_max_tokens,
            "stream": True,
            "stop_words": stops or None,
            "random_seed": body.seed,
            "min_length": body.min_tokens,
            "temperature": None if greedy else (1.0 if body.temperature is None else body.temperature),
            "top_k": 1 if greedy else 0,
            "top_p": None if greedy else (body.top_p or 1.0),
        }
        client = grpcclient.InferenceServerClient(grpc_url)

        async def requests():
            yield {
                "model_name": triton_model,
                "inputs": client_inputs(params),
                "request_id": uuid.uuid4().hex,
                "enable_empty_final_response": True,
            }

        try:
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    raise OpenAIError(400, str(error.message() if hasattr(error, "message") else error))
                response = result.get_response()
                if any(o.name == "text_output" for o in response.outputs):
                    text = "".join(t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1))
                    tokens = int(np.asarray(result.as_numpy("output_log_probs")).size)
                    yield text, tokens
                if response.parameters["triton_final_response"].bool_param:
                    break
        finally:
            await client.close()

    def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
        cut = min((text.find(s) for s in stops if s and s in text), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    async def respond(prompt: str, body: Sampling, kind: str, request: Request):
        check_model(body)
        if len(tokenizer.encode(prompt)) == 0:
            raise OpenAIError(400, "the prompt is empty", param="prompt" if kind == "text_completion" else "messages")
        created, rid = int(time.time()), f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        prompt_tokens = len(tokenizer.encode(prompt))
        max_tokens = body.max_tokens or default_max_tokens
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        obj = "text_completion" if kind == "text_completion" else "chat.completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if kind == "text_completion":
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

        def usage(completion: int) -> dict:
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }

        if not body.stream:

            async def collect() -> tuple[str, int]:
                text, tokens = "", 0
                async for delta, count in generate(prompt, body):
                    text, tokens = text + delta, tokens + count
                return text, tokens

            task = asyncio.ensure_future(collect())
            while not task.done():  # a client that hangs up stops the generation (cancelling closes the gRPC stream)
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise OpenAIError(499, "client closed the request")
            text, tokens = task.result()
            text, stopped = truncate_at_stop(text, stops)
            finish = "stop" if stopped or tokens < max_tokens else "length"
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": body.model,
                "choices": [choice(text, finish, False)],
                "usage": usage(tokens),
            }

        stream = generate(prompt, body)
        try:  # fail before the 200 status line when the first response is an error
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = ("", 0)

        async def events():
            chunk_obj = obj + ".chunk" if kind != "text_completion" else obj
            text, tokens, finished = "", 0, False
            pending = [first]
            try:
                while True:
                    if pending:
                        delta, count = pending.pop()
                    else:
                        try:
                            delta, count = await stream.__anext__()
                        except StopAsyncIteration:
                            break
                    tokens += count
                    full, stopped = truncate_at_stop(text + delta, stops)
                    out, text = full[len(text) :], full
                    if out:
                        chunk = {"id": rid, "object": chunk_obj, "created": created, "model": body.model}
                        yield f"data: {json.dumps({**chunk, 'choices': [choice(out, None, True)]})}\n\n"
                    if stopped:
                        finished = True
                        break
                finish = "stop" if finished or tokens < max_tokens else "length"
                chunk = {"id": rid, "object": chunk_obj, "created": created, "model": body.model}
                last = {**chunk, "choices": [choice("", finish, True)], "usage": usage(tokens)}
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await (
                    stream.aclose()
                )  # client gone or stop string seen: cancel the gRPC stream, the BLS stops the engine

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(body.prompt, body, "text_completion", request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        prompt = tokenizer.apply_chat_template(
            [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=False
        )
        return await respond(prompt, body, "chat.completion", request)

    return app


def run_gateway(app: FastAPI, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
