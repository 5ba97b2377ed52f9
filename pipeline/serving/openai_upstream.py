"""An OpenAI-compatible HTTP server as the gateway's `Upstream` (trtllm-serve, or another of these gateways): each
request's generation goes to the server's /v1/completions, streamed, with the prompt the gateway rendered.

The gateway does what it does in front of tritonserver (API key, model names, chat templates, limits, stop strings,
the OpenAI shapes); the server only generates. Where OpenAI-compatible servers differ, a `Dialect` says what this one
takes: how the gateway's guided-decoding guide is written as its `response_format` (a target supplies that for its
release: the serving package knows no target), and which `logprobs` value returns the chosen token's
log-probability. A guide or field the server would not enforce is a 400 naming the field and the server, never a
silently different answer.

LoRA adapters the server holds from the build are models of the gateway's own (`adapters`: model name -> the request
fields that pick one, e.g. trtllm-serve's `lora_request`, as the target wrote them from the build): a request naming
one gets its fields, the base model's none, and a client's own such fields are never forwarded (the gateway writes
every field it sends), so no request makes the server load anything the operator did not build.

Tokens are counted from the server's usage in every chunk (`stream_options.continuous_usage_stats`), so `usage` and
`finish_reason` mean what they mean in front of tritonserver. Readiness is the server's /health answering 200, polled
while the app runs (`run`); until then, and whenever it stops answering, every route answers 503. Closing a
generation closes its HTTP stream, which is how the server learns to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from pipeline.serving.protocol import Guide, OpenAIError, Sampling
from pipeline.serving.upstream import Piece
from pipeline.targets import Dialect, OwnServer

__all__ = ["GATEWAY", "Dialect", "OpenAIUpstream", "OwnServer", "gateway_response_format"]

HEALTH = "/health"  # readiness of trtllm-serve and of this gateway: 200 once requests are served
COMPLETIONS = "/v1/completions"


def gateway_response_format(guide: Guide) -> dict:
    """A guide as this gateway's own `response_format` takes it (pipeline.serving.protocol.ResponseFormat)."""
    kind, text = guide
    if kind == "json":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "guide", "schema": json.loads(text)}}
    if kind == "regex":
        return {"type": "regex", "regex": text}
    if kind == "ebnf_grammar":
        return {"type": "ebnf", "ebnf": text}
    raise ValueError(f"a {kind} guide has no response_format")


# Another of these gateways as the upstream (a gateway in front of a gateway; the tests' OpenAI-HTTP server).
GATEWAY = Dialect("the trtllm-pipeline OpenAI gateway", gateway_response_format, chosen_logprobs=0)


def _message(response_body: bytes) -> str:
    """The error message of an OpenAI error body (OpenAI's `{"error": {...}}` or trtllm-serve's flat one)."""
    try:
        body = json.loads(response_body)
    except ValueError:
        return response_body.decode("utf-8", "replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _asked_logprobs(body: Sampling) -> bool:
    """Whether the client asked for log-probabilities (chat: `logprobs: true`; completions: `logprobs: 0`)."""
    return getattr(body, "logprobs", None) not in (None, False)


@dataclass
class OpenAIUpstream:
    """The OpenAI-compatible server at `url` (no trailing /v1) serving `model`, spoken to in its `dialect`, with the
    LoRA `adapters` it holds (model name -> the request fields that pick each)."""

    url: str
    model: str
    dialect: Dialect
    poll_s: float = 1.0  # how often readiness is polled
    adapters: dict[str, dict] = field(default_factory=dict)
    _ready: bool = field(default=False, init=False)
    _client: object = field(default=None, init=False)

    def __post_init__(self):
        takes = self.dialect.takes
        for name, fields in self.adapters.items():
            missing = [f for f in fields if takes is not None and f not in takes]
            if missing:
                raise ValueError(f"adapter {name}: {self.dialect.server} has no field {', '.join(missing)}")

    def ready(self) -> bool:
        return self._ready

    def client(self):
        import httpx

        if self._client is None:  # made in the serving event loop, on first use
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=5.0))
        return self._client

    async def poll(self) -> bool:
        """Whether the server's /health answers 200 now."""
        import httpx

        try:
            response = await self.client().get(HEALTH, timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def run(self) -> None:
        """While the app runs: readiness polled from the server's /health; the client closed at the end."""
        try:
            while True:
                self._ready = await self.poll()
                await asyncio.sleep(self.poll_s)
        finally:
            self._ready = False
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._client.aclose())
                self._client = None

    def guide_field(self, body: Sampling) -> str:
        """The request field the guide came from (response_format, structured_outputs or tool_choice)."""
        return next(
            (name for name, constrained in body.formats().items() if constrained() is not None), "response_format"
        )

    def completion_body(self, prompt: str, body: Sampling, max_tokens: int) -> dict:
        """The /v1/completions request for one generation; OpenAIError 400 naming the field the server would not
        honour."""
        d = self.dialect
        request = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "temperature": body.temperature,
            "top_p": body.top_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "seed": body.seed,
            "stop": body.stops() or None,
            "min_tokens": body.min_tokens,
            "ignore_eos": body.ignore_eos or None,
            **self.adapters.get(body.model, {}),  # the build's adapter the request names (the base model: none)
        }
        if _asked_logprobs(body):
            if d.chosen_logprobs is None:
                raise OpenAIError(400, f"logprobs: {d.server} returns no log-probabilities here", param="logprobs")
            request["logprobs"] = d.chosen_logprobs
        if body.guide is not None:
            name = self.guide_field(body)
            try:
                request["response_format"] = d.response_format(body.guide)
            except ValueError as exc:
                raise OpenAIError(400, f"{name}: {exc}", param=name) from None
        request = {key: value for key, value in request.items() if value is not None}
        for name in request:
            if d.takes is not None and name not in d.takes:
                raise OpenAIError(400, f"{name}: {d.server} has no such field", param=name)
        return request

    def refused(self, status: int, content: bytes, started: bool) -> OpenAIError:
        """A failure status of the server as the client's error."""
        message = f"{self.dialect.server}: {_message(content)}"
        if status == 503:
            return OpenAIError(503, message, "server_error")
        if 400 <= status < 500 and status not in (401, 403, 404) and not started:
            return OpenAIError(400, message)
        return OpenAIError(502, message, "server_error")

    async def generate(self, prompt: str, body: Sampling, max_tokens: int) -> AsyncIterator[Piece]:
        import httpx

        request = self.completion_body(prompt, body, max_tokens)
        started, counted = False, 0
        try:
            async with self.client().stream("POST", COMPLETIONS, json=request) as response:
                if response.status_code != 200:
                    raise self.refused(response.status_code, await response.aread(), started)
                async for line in response.aiter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                    if not data:
                        continue
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise OpenAIError(
                            502, f"{self.dialect.server} streamed {data[:200]!r}", "server_error"
                        ) from None
                    if "error" in chunk or chunk.get("object") == "error":  # in-band, after the 200
                        error = chunk.get("error", chunk)
                        code = error.get("code") if isinstance(error.get("code"), int) else 502
                        raise self.refused(code, json.dumps(chunk).encode(), started)
                    for text, log_probs in self._pieces(chunk, counted):
                        counted += len(log_probs)
                        started = started or bool(text)
                        yield text, log_probs
        except httpx.HTTPError as exc:  # the server stopped, crashed or is unreachable
            status = 502 if started else 503
            raise OpenAIError(status, f"{self.dialect.server} failed: {exc!r}", "server_error") from None

    @staticmethod
    def _pieces(chunk: dict, counted: int) -> list[Piece]:
        """The pieces of one streamed chunk: its text, and one log-probability per token it adds (the server's, when
        asked for; 0.0 otherwise), the tokens counted from its cumulative usage where it carries one."""
        choices = chunk.get("choices") or []
        usage = chunk.get("usage") or {}
        text = "".join(c.get("text") or "" for c in choices)
        given = [p for c in choices for p in ((c.get("logprobs") or {}).get("token_logprobs") or [])]
        if usage.get("completion_tokens") is not None:
            tokens = max(0, usage["completion_tokens"] - counted)
        else:
            tokens = len(given) or int(bool(text))
        if not text and not tokens:
            return []
        log_probs = [float(p) if p is not None else 0.0 for p in given[:tokens]]
        return [(text, log_probs + [0.0] * (tokens - len(log_probs)))]
