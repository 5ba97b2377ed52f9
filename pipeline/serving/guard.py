"""The gateway's door, checked before any route runs: the API key, the body-size cap and readiness.

With an API key every path but /health (readiness only) needs it, FastAPI's /docs, /redoc and /openapi.json
included: the schema names every accepted field, and a gateway behind a key should tell an anonymous caller
nothing. Read it with the key (`curl -H "Authorization: Bearer $KEY" .../openapi.json`), or serve without a key.
"""

from __future__ import annotations

import secrets
from typing import Callable

from starlette.datastructures import Headers

from pipeline.errors import PipelineError
from pipeline.serving.protocol import OpenAIError

DEFAULT_MAX_BODY_BYTES = 4_000_000


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
    included. Until `ready()` (the upstream's) is true, every path answers 503."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, ready: Callable[[], bool]):
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
        if not self.ready():  # a client polling /v1/models must not start early
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
