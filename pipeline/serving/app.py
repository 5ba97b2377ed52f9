"""An OpenAI-compatible HTTP front door for a served repository (`trtllm-pipeline serve --openai`): `create_app`
assembles the gateway (vLLM's api_server) from the door (`guard`), the routes and the server behind it (`upstream`).

`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming as server-sent events) are translated into
requests to the repository's `tensorrt_llm_bls` model (`pipeline.serving.upstream`). vLLM's `ignore_eos` generates on
past end of sequence, to max_tokens. `response_format`, vLLM's `structured_outputs` and `tools` become the engine's
guided-decoding guide (`pipeline.serving.protocol`).

Every error uses OpenAI's error body and HTTP status: 400 for a value the engine cannot take (bounds
are those of the engine's tensors: int32 lengths, uint64 seed) or an OpenAI field it cannot honour,
401 without the API key (when one is set), 404 for another model, 413 for a body over the cap.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from pipeline.serving import adapters, chat, completions, health, models
from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard, configured_key
from pipeline.serving.protocol import OpenAIError
from pipeline.serving.state import Gateway
from pipeline.serving.upstream import TritonUpstream

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
    from transformers import AutoTokenizer

    api_key = configured_key(api_key)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    max_input_len, max_seq_len = engine_limits(tokenizer_dir)
    upstream = TritonUpstream(grpc_url, triton_model, lora, ready)
    app = FastAPI(title="trtllm-pipeline OpenAI gateway")
    app.state.gateway = Gateway(served_name, tokenizer, upstream, lora, default_max_tokens, max_input_len, max_seq_len)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, ready=upstream.ready)
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    admin = [adapters.router] if lora is not None else []
    for router in (health.router, models.router, *admin, completions.router, chat.router):
        app.include_router(router)
    return app
