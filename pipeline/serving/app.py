"""An OpenAI-compatible HTTP front door for a served repository (`trtllm-pipeline serve --openai`).

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming as server-sent events) are
translated into requests to the repository's `tensorrt_llm_bls` model over gRPC streaming; the BLS is
used rather than the ensemble because only it stops generating when the client goes away (the
gateway stops it on disconnect: `pipeline.triton.client.stream_responses`). Chat messages go through the model's
chat template; `usage` counts and `logprobs` come from the engine (one log-probability per generated token).

Stop strings are found in the text by the gateway (a stop string may end inside a token, where the
engine's token-level stop words cannot see it): the streamed and the non-streamed answer are made by
one iterator, which holds back text that may begin a stop string and cuts at the first one; the engine, given the
same stop words, ends generation there, or the gateway stops it. With `stream_options.include_usage`, usage comes
in a last chunk with no choices (and, with vLLM's `continuous_usage_stats`, in every chunk). vLLM's `ignore_eos`
generates on past end of sequence, to max_tokens. `response_format`, vLLM's `structured_outputs` and `tools` become
the engine's guided-decoding guide (`pipeline.serving.protocol`); with tools, an answer that calls them comes back as
`tool_calls` (streamed, in one chunk at its end, since only the whole answer tells).

Every error uses OpenAI's error body and HTTP status: 400 for a value the engine cannot take (bounds
are those of the engine's tensors: int32 lengths, uint64 seed) or an OpenAI field it cannot honour,
401 without the API key (when one is set), 404 for another model, 413 for a body over the cap. A
stream whose upstream fails after it started ends with an error event and `[DONE]`. Tokenizing runs
on worker threads, so a huge prompt does not hold up other requests.

With an API key every path but /health (readiness only) needs it, FastAPI's /docs, /redoc and /openapi.json
included: the schema names every accepted field, and a gateway behind a key should tell an anonymous caller
nothing. Read it with the key (`curl -H "Authorization: Bearer $KEY" .../openapi.json`), or serve without a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from pipeline.errors import PipelineError
from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.protocol import (
    INT32_MAX,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    LoadLoraAdapter,
    OpenAIError,
    Sampling,
    StreamOptions,
    UnloadLoraAdapter,
    parse_calls,
    tool_prompt,
)
from pipeline.triton.client import client_inputs, stream_responses

DEFAULT_MAX_BODY_BYTES = 4_000_000
# tritonserver 2.51's python backend answers this for a model whose process died, until `serve`'s watchdog stops it
DEAD_MODEL = "is not healthy"
# After a stop string the engine, given the same stop words, usually ends the generation itself within a step, so
# the rest of the stream is read rather than stopped (see `generate`). A stop string the engine does not see (one
# that does not end on a token boundary) is stopped after this grace.
STOP_DRAIN_S = 0.5


def first_stop(text: str, stops: list[str]) -> int:
    """Where the first stop string in text begins, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of text that begins a stop string: text the next piece may make a stop."""
    return max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)


@dataclass
class Generation:
    """One choice as the BLS streams it, cut at the first stop string: `pieces` is what the streamed and the
    collected answer are both made of, so the two cannot differ. A piece is one streamed response (one token,
    or several that make one character together) with its log-probability."""

    stops: list[str]
    text: str = ""  # the visible text so far
    tokens: int = 0  # tokens received, those in the response that completed a stop string included
    stopped: bool = False  # by a stop string

    async def pieces(self, upstream: AsyncIterator[tuple[str, list[float]]]) -> AsyncIterator[tuple[str, float]]:
        """The visible (text, log-probability) pieces. Text that may begin a stop string is held back until the
        next pieces tell; at the first stop string the text is cut, and the upstream is read to its end or, after
        STOP_DRAIN_S, closed, which stops generation (`stream_responses` sends the LLM model a `stop`)."""
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


def configured_key(api_key: str | None) -> str | None:
    """The API key as clients can send it: without surrounding whitespace (a key read from a file or a Kubernetes
    Secret often ends in a newline, which no Authorization header carries); None or "" is no key. A key of
    whitespace only is refused rather than taken for no key or for a key nobody can send."""
    if not api_key:
        return None
    if not api_key.strip():
        raise PipelineError(
            f"the API key is only whitespace ({api_key!r}): set a real key, e.g. $(openssl rand -hex 16), "
            "or none to serve without authentication"
        )
    return api_key.strip()


class Guard:
    """ASGI middleware checking the API key and the body size before the app reads a byte of the body,
    so neither an unauthenticated client nor an oversized body costs more than its headers: Content-Length
    is checked first, a chunked body is counted as it arrives (and replayed to the app when it fits).
    With a key, every path but /health needs it, the API schema and its pages (/openapi.json, /docs, /redoc)
    included. Until `ready` is set, every path answers 503."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, ready: threading.Event | None = None):
        self.app, self.api_key, self.max_body_bytes, self.ready = app, api_key, max_body_bytes, ready

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # constant time: the comparison must not tell a guesser how much of the key it got right
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode("latin-1"), self.api_key.encode("utf-8")
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        health = scope["path"] == "/health"  # a load balancer's probe: it tells nothing but readiness
        if self.api_key and not health and not self.authorized(headers):
            error = OpenAIError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
            return await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if self.ready is not None and not self.ready.is_set():  # a client polling /v1/models must not start early
            loading = OpenAIError(503, "the model is not ready yet: retry shortly", "server_error", code="not_ready")
            return await loading.response({"Retry-After": "1"})(scope, receive, send)
        too_large = OpenAIError(
            413, f"the request body exceeds this server's limit of {self.max_body_bytes} bytes", code="body_too_large"
        )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await too_large.response()(scope, receive, send)  # uvicorn discards the unread body
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > self.max_body_bytes:
                return await too_large.response()(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # later reads wait for the client's disconnect
            message, body = body, None
            return message

        await self.app(scope, replay, send)


def engine_limits(engine_dir: str) -> tuple[int | None, int | None]:
    """(max_input_len, max_seq_len) of the engine whose config sits next to the tokenizer, as both targets
    write it; (None, None) for a plain tokenizer directory, leaving the check to the engine. Checking
    here keeps an over-long prompt out of tritonserver, whose shared memory grows to the largest input
    and stays there."""
    config = Path(engine_dir) / "config.json"
    built = json.loads(config.read_text()).get("build_config", {}) if config.is_file() else {}
    return built.get("max_input_len"), built.get("max_seq_len")


def create_app(
    grpc_url: str,
    tokenizer_dir: str,
    served_name: str,
    triton_model: str = "tensorrt_llm_bls",
    default_max_tokens: int = 256,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora: AdapterAdmin | None = None,
    ready: threading.Event | None = None,
) -> FastAPI:
    """The gateway app; with `api_key` (see configured_key), every route but /health needs
    `Authorization: Bearer <api_key>`.

    `lora`: the served LoRA adapters, each a model of its own (vLLM's --lora-modules), and the operator's routes that
    add and remove them (`pipeline.serving.adapter_admin`); None: the base model only.
    `ready`: set once tritonserver's models are ready; until then every route answers 503 (None: ready at once).
    """
    import grpc
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    api_key = configured_key(api_key)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    max_input_len, max_seq_len = engine_limits(tokenizer_dir)
    app = FastAPI(title="trtllm-pipeline OpenAI gateway")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, ready=ready)

    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        reason = first.get("ctx", {}).get("error", first["msg"])  # a validator's own words, without pydantic's prefix
        if first["type"] == "json_invalid":
            return OpenAIError(400, f"the body is not valid JSON: {reason} (character {first['loc'][-1]})").response()
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        message = str(reason) if first["type"] == "value_error" else first["msg"]
        return OpenAIError(400, f"{param}: {message}" if param else message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        """FastAPI's own errors (unknown route, wrong method, a body that is not UTF-8) in OpenAI's shape."""
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        return OpenAIError(exc.status_code, f"{exc.detail}{cause}").response(exc.headers)

    @app.exception_handler(Exception)
    async def failed(_, exc: Exception):
        return OpenAIError(500, f"the gateway failed: {exc!r}", "server_error").response()

    def adapters() -> dict[str, int]:
        return lora.served() if lora is not None else {}

    @app.get("/health")
    async def health():
        """200 once the model is ready (the Guard answers 503 before), as vLLM's /health; no API key needed."""
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        base = {"id": served_name, "object": "model", "created": 0, "owned_by": "trtllm-pipeline"}
        return {
            "object": "list",
            "data": [base] + [{**base, "id": name, "parent": served_name} for name in adapters()],
        }

    if lora is not None:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoraAdapter):
            """vLLM's route: serve the PEFT adapter in `lora_path` (in a directory `serve --allow-lora-dir` allows) as
            model `lora_name` from now on, until it is unloaded or the server stops."""
            if body.lora_name == served_name:
                raise OpenAIError(400, f"the model '{body.lora_name}' is already served", param="lora_name")
            try:
                await asyncio.to_thread(lora.add, body.lora_name, body.lora_path)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="lora_path") from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoraAdapter):
            """vLLM's route: stop serving an adapter loaded while serving (requests running on it finish)."""
            try:
                await asyncio.to_thread(lora.remove, body.lora_name)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="lora_name") from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def check(body: Sampling) -> None:
        """The model name and the fields this server cannot honour, before any work is done."""
        if body.model != served_name and body.model not in adapters():
            served = ", ".join(repr(name) for name in [served_name, *adapters()])
            raise OpenAIError(
                404,
                f"The model '{body.model}' does not exist; this server serves {served}",
                "not_found_error",
                "model",
            )
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, UNSUPPORTED[name], {}, []):
                raise OpenAIError(400, f"{name}: not supported by this server", param=name)
        body.guide  # a format the engine cannot take fails here, before any work

    async def generate(prompt: str, body: Sampling, max_tokens: int) -> AsyncIterator[tuple[str, list[float]]]:
        """(text delta, log-probs of its tokens) as the BLS streams them, until the RPC ends (the aio client
        cannot ask for the empty final response); closing the iterator stops generation. An error
        response or a failed RPC (tritonserver stopped or unreachable) is an OpenAIError."""

        greedy = body.temperature == 0
        params = {
            "text_input": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stop_words": body.stops() or None,
            "random_seed": body.seed,
            "min_length": body.min_tokens,
            "end_id": -1 if body.ignore_eos else None,  # no token ends the sequence, as bench serve's gRPC requests
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "temperature": None if greedy else (1.0 if body.temperature is None else body.temperature),
            "top_k": 1 if greedy else 0,
            "top_p": None if greedy else (body.top_p or 1.0),
            "lora_task_id": adapters().get(body.model),
        }
        guide = body.guide
        if guide is not None:
            params["guided_decoding_guide_type"], params["guided_decoding_guide"] = guide
        started = False
        adapter = lora.using(body.model) if body.model in adapters() else contextlib.nullcontext()
        try:
            with adapter:  # not evicted while it runs (lora.evict_idle_adapters)
                async with contextlib.aclosing(
                    stream_responses(grpc_url, triton_model, client_inputs(params))
                ) as stream:
                    async for result, error in stream:
                        if error is not None:  # before any text the request was refused; after it, the server failed
                            message = str(error.message() if hasattr(error, "message") else error)
                            if DEAD_MODEL in message:  # not the client's fault: `serve` is stopping tritonserver
                                raise OpenAIError(503, f"a model process of the server died: {message}", "server_error")
                            raise OpenAIError(502, message, "server_error") if started else OpenAIError(400, message)
                        response = result.get_response()
                        if any(o.name == "text_output" for o in response.outputs):
                            text = "".join(t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1))
                            started = True
                            yield text, np.asarray(result.as_numpy("output_log_probs")).reshape(-1).tolist()
        except grpc.aio.AioRpcError as exc:  # tritonserver stopped, crashed or unreachable
            status = 503 if exc.code() == grpc.StatusCode.UNAVAILABLE else 502
            raise OpenAIError(status, f"the inference server failed: {exc.details()}", "server_error") from None

    def render_logprobs(body: Sampling, pieces: list[tuple[str, float]], offset: int) -> dict | None:
        if isinstance(body, ChatRequest):
            if not body.logprobs:
                return None
            content = [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []} for t, p in pieces]
            return {"content": content}
        if body.logprobs is None:
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

    async def respond(prompt: str, body: Sampling, request: Request):
        chat = isinstance(body, ChatRequest)
        prompt_tokens = len(await asyncio.to_thread(tokenizer.encode, prompt))
        where = "messages" if chat else "prompt"
        if prompt_tokens == 0:
            raise OpenAIError(400, "the prompt is empty", param=where)
        if max_input_len and prompt_tokens > max_input_len:
            raise OpenAIError(
                400, f"{where}: {prompt_tokens} tokens exceed the engine's max_input_len {max_input_len}", param=where
            )
        room = max_seq_len - prompt_tokens if max_seq_len else INT32_MAX
        max_tokens = body.token_limit() or max(1, min(default_max_tokens, room))  # unset: what fits, up to the default
        if max_tokens > room:
            raise OpenAIError(
                400,
                f"max_tokens: {prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the engine's "
                f"max_seq_len {max_seq_len}",
                param="max_tokens",
            )
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if chat else "text_completion"
        generation = Generation(body.stops())
        visible = generation.pieces(generate(prompt, body, max_tokens))
        tools = body.callable_tools if chat else []  # an answer that calls them is tool calls, not content

        def choice(text: str, finish: str | None, pieces: list[tuple[str, float]] | None, offset: int = 0) -> dict:
            logprobs = None if pieces is None else render_logprobs(body, pieces, offset)
            if not chat:
                return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            message = {"role": "assistant", "content": text}
            calls = parse_calls(text, tools) if tools and finish is not None else None
            if calls:  # OpenAI: no content, the calls (streamed: each with its index), finish_reason tool_calls
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                if body.stream:
                    message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                finish = "tool_calls"
            return {
                "index": 0,
                "delta" if body.stream else "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }

        def finish_reason() -> str:
            """End-of-sequence is never in the output (ours or TensorRT-LLM's executor), so fewer tokens than
            max_tokens is the engine's own word that it stopped (end-of-sequence or a token-level stop word)."""
            return "stop" if generation.stopped or generation.tokens < max_tokens else "length"

        def usage() -> dict:
            total = prompt_tokens + generation.tokens
            return {"prompt_tokens": prompt_tokens, "completion_tokens": generation.tokens, "total_tokens": total}

        if not body.stream:

            async def collect() -> list[tuple[str, float]]:
                return [piece async for piece in visible]

            task = asyncio.ensure_future(collect())
            while (
                not task.done()
            ):  # a client that hangs up stops the generation (cancelling closes the stream: a `stop`)
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise OpenAIError(499, "client closed the request")
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": body.model,
                "choices": [choice(generation.text, finish_reason(), task.result())],
                "usage": usage(),
            }

        first = await anext(visible, None)  # fail before the 200 status line when the first response is an error
        header = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created, "model": body.model}
        options = body.stream_options or StreamOptions()
        with_usage, continuous = options.include_usage, options.include_usage and options.continuous_usage_stats
        if with_usage:  # OpenAI: every chunk has the field, null but in the last one
            header["usage"] = None

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        def chunk(choices: list[dict]) -> dict:
            return {**header, "choices": choices, **({"usage": usage()} if continuous else {})}

        async def events():
            try:
                piece = first
                while piece is not None and not tools:
                    offset = len(generation.text) - len(piece[0])
                    yield event(chunk([choice(piece[0], None, [piece], offset)]))
                    piece = await anext(visible, None)
                if tools:  # whether the answer is tool calls shows at its end: it comes whole, in one chunk
                    pieces = [first, *[piece async for piece in visible]] if first is not None else []
                    yield event(chunk([choice(generation.text, finish_reason(), pieces)]))
                else:
                    yield event(chunk([choice("", finish_reason(), None)]))
                if with_usage:
                    yield event({**header, "choices": [], "usage": usage()})
            except Exception as exc:  # after the 200 the error can only go in-band (e.g. tritonserver stopped)
                error = exc if isinstance(exc, OpenAIError) else OpenAIError(500, repr(exc), "server_error")
                yield event(error.body())
            finally:  # client gone: closing the stream stops the engine (`stream_responses`)
                await visible.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        return await respond(body.prompt, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check(body)
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
            prompt = await asyncio.to_thread(
                tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=False, **options
            )
        except TemplateError as exc:
            raise OpenAIError(400, f"the model's chat template refused the messages: {exc}", param="messages") from None
        return await respond(prompt, body, request)

    return app
