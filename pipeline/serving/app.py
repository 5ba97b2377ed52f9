"""An OpenAI-compatible HTTP front door for a served repository (`trtllm-pipeline serve --openai`): `create_app`
assembles the gateway (vLLM's api_server) from the door (`guard`), the routes and the server behind it (`upstream`).

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming as server-sent events) are translated into
requests to the server behind the gateway (`pipeline.serving.upstream`): the repository's `tensorrt_llm_bls` model
over gRPC, or an OpenAI-compatible HTTP server such as trtllm-serve (`pipeline.serving.openai_upstream`). vLLM's
`ignore_eos` generates on past end of sequence, to max_tokens. `response_format`, vLLM's `structured_outputs` and
`tools` become the engine's guided-decoding guide (`pipeline.serving.protocol`).

Every error uses OpenAI's error body and HTTP status: 400 for a value the engine cannot take (bounds
are those of the engine's tensors: int32 lengths, uint64 seed) or an OpenAI field it cannot honour,
401 without the API key (when one is set), 404 for another model, 413 for a body over the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from pipeline.serving import adapters, chat, completions, health, models
from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard, configured_key
from pipeline.serving.protocol import OpenAIError
from pipeline.serving.state import Gateway
from pipeline.serving.upstream import TritonUpstream, Upstream

__all__ = ["DEFAULT_MAX_BODY_BYTES", "configured_key", "create_app", "engine_limits"]


def engine_limits(engine_dir: str) -> tuple[int | None, int | None]:
    """(max_input_len, max_seq_len) of the engine whose config sits next to the tokenizer, as both targets
    write it; (None, None) for a plain tokenizer directory, leaving the check to the engine. Checking
    here keeps an over-long prompt out of tritonserver, whose shared memory grows to the largest input
    and stays there."""
    config = Path(engine_dir) / "config.json"
    built = json.loads(config.read_text()).get("build_config", {}) if config.is_file() else {}
    return built.get("max_input_len"), built.get("max_seq_len")


async def openai_error(_, exc: OpenAIError):
    """A route's refusal, with the status and body it chose."""
    return exc.response()


async def invalid(_, exc: RequestValidationError):
    """A body that does not validate, as a 400 naming the first field at fault."""
    first = exc.errors()[0]
    reason = first.get("ctx", {}).get("error", first["msg"])  # a validator's own words, without pydantic's prefix
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {reason} (character {first['loc'][-1]})").response()
    param = ".".join(str(p) for p in first["loc"][1:]) or None
    message = str(reason) if first["type"] == "value_error" else first["msg"]
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param).response()


async def http_error(_, exc: HTTPException):
    """FastAPI's own errors (unknown route, wrong method, a body that is not UTF-8) in OpenAI's shape."""
    cause = f": {exc.__cause__}" if exc.__cause__ else ""
    return OpenAIError(exc.status_code, f"{exc.detail}{cause}").response(exc.headers)


async def failed(_, exc: Exception):
    """Anything else as a 500 in OpenAI's shape, so a client's error handling sees it."""
    return OpenAIError(500, f"the gateway failed: {exc!r}", "server_error").response()


ERROR_HANDLERS = {
    OpenAIError: openai_error,
    RequestValidationError: invalid,
    HTTPException: http_error,
    Exception: failed,
}


@dataclass(frozen=True)
class ServerAdapters:
    """The LoRA adapters a server behind the gateway holds from the build (an `Upstream`'s `adapters`, e.g.
    trtllm-serve's): listed by /v1/models and taken as a request's `model` as `AdapterAdmin`'s are; none is added or
    removed while serving, so no admin route is served for them."""

    names: tuple[str, ...]

    def served(self) -> dict[str, int]:
        """name -> its position (the server behind picks an adapter by the fields its upstream sends, not by this)."""
        return {name: position for position, name in enumerate(self.names, 1)}


def server_adapters(upstream: Upstream, served_name: str) -> ServerAdapters | None:
    """The adapters `upstream` holds from the build (None: none); ValueError where one is named as the base model."""
    names = tuple(getattr(upstream, "adapters", None) or ())
    if served_name in names:
        raise ValueError(f"a LoRA adapter is named {served_name!r}, the base model's name")
    return ServerAdapters(names) if names else None


def lifespan(upstream: Upstream):
    """The app's lifespan: the upstream's `run` (e.g. readiness polling) as a task, cancelled when the app stops."""

    @contextlib.asynccontextmanager
    async def running(_app):
        task = asyncio.ensure_future(upstream.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    return running


def create_app(
    upstream: Upstream | str,
    tokenizer_dir: str,
    served_name: str,
    triton_model: str = "tensorrt_llm_bls",
    default_max_tokens: int = 256,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora: AdapterAdmin | None = None,
    ready: threading.Event | None = None,
    limits_dir: str | None = None,
) -> FastAPI:
    """The gateway app in front of `upstream`: an `Upstream`, or tritonserver's gRPC address (its BLS model
    `triton_model`). With `api_key` (see configured_key), every route but /health needs `Authorization: Bearer
    <api_key>`.

    `lora`: the served LoRA adapters, each a model of its own (vLLM's --lora-modules), and the operator's routes that
    add and remove them (`pipeline.serving.adapter_admin`); None: the base model only, or the adapters an `Upstream`
    holds from the build (`ServerAdapters`).
    `ready`: set once tritonserver's models are ready; until then every route answers 503 (None: ready at once; an
    `Upstream` says itself).
    `limits_dir`: the directory whose config.json holds the engine's limits (default: `tokenizer_dir`).
    """
    from transformers import AutoTokenizer

    api_key = configured_key(api_key)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    max_input_len, max_seq_len = engine_limits(limits_dir or tokenizer_dir)
    if isinstance(upstream, str):
        upstream = TritonUpstream(upstream, triton_model, lora, ready)
    app = FastAPI(title="trtllm-pipeline OpenAI gateway", lifespan=lifespan(upstream))
    listed = lora if lora is not None else server_adapters(upstream, served_name)
    app.state.gateway = Gateway(
        served_name, tokenizer, upstream, listed, default_max_tokens, max_input_len, max_seq_len
    )
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, ready=upstream.ready)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    admin = [adapters.router] if lora is not None else []
    for router in (health.router, models.router, *admin, completions.router, chat.router):
        app.include_router(router)
    return app
