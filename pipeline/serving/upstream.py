"""The server behind the gateway, as the routes see it (`Upstream`), and tritonserver's BLS as one (`TritonUpstream`).

Routes call only the protocol: one request's generation streamed as (text, log-probabilities) pieces, cancelled by
closing that stream, and whether the server takes requests yet; so another server stands behind the same routes just
as well (an OpenAI-compatible HTTP one such as trtllm-serve: `pipeline.serving.openai_upstream`).

Triton: requests go to the repository's `tensorrt_llm_bls` model over gRPC streaming; the BLS is used rather than
the ensemble because only it stops generating when the client goes away (closing the stream stops it:
`pipeline.triton.client.stream_responses`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import numpy as np

from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.protocol import OpenAIError, Sampling
from pipeline.triton.client import client_inputs, stream_responses

# tritonserver 2.51's python backend answers this for a model whose process died, until `serve`'s watchdog stops it
DEAD_MODEL = "is not healthy"

Piece = tuple[str, list[float]]  # a text delta and the log-probabilities of the tokens that made it


class Upstream(Protocol):
    """What a route needs from the server that generates."""

    def ready(self) -> bool:
        """Whether the server takes requests yet: until then the gateway answers 503."""
        ...

    async def run(self) -> None:
        """What the upstream keeps doing while the app runs (e.g. polling the server's readiness); cancelled when the
        app stops. Returns at once when there is nothing to do."""
        ...

    def generate(self, prompt: str, body: Sampling, max_tokens: int) -> AsyncIterator[Piece]:
        """The pieces of one request's answer as the server streams them, to the generation's end. Closing the
        iterator early cancels the request, so the server stops generating. A failure is an OpenAIError with the
        client's status: 400 refused before any text, 502 failed after it, 503 the server unavailable."""
        ...


def triton_inputs(prompt: str, body: Sampling, max_tokens: int, lora_task_id: int | None) -> dict:
    """The BLS's inputs for an OpenAI request (`client_inputs` leaves out the None values)."""
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
        "lora_task_id": lora_task_id,
    }
    guide = body.guide
    if guide is not None:
        params["guided_decoding_guide_type"], params["guided_decoding_guide"] = guide
    return params


def response_error(error, started: bool) -> OpenAIError:
    """An error response of the BLS as the client's error: before any text the request was refused; after it, the
    server failed."""
    message = str(error.message() if hasattr(error, "message") else error)
    if DEAD_MODEL in message:  # not the client's fault: `serve` is stopping tritonserver
        return OpenAIError(503, f"a model process of the server died: {message}", "server_error")
    return OpenAIError(502, message, "server_error") if started else OpenAIError(400, message)


@dataclass
class TritonUpstream:
    """tritonserver's BLS model `model` at `grpc_url`; `lora` maps adapter model names to task ids; `ready_event`,
    once set, says its models are loaded (None: ready at once)."""

    grpc_url: str
    model: str
    lora: AdapterAdmin | None = None
    ready_event: threading.Event | None = None

    def ready(self) -> bool:
        return self.ready_event is None or self.ready_event.is_set()

    async def run(self) -> None:
        return None  # readiness is set by `serve` once tritonserver's models are loaded

    async def generate(self, prompt: str, body: Sampling, max_tokens: int) -> AsyncIterator[Piece]:
        """Streamed until the RPC ends (the aio client cannot ask for the empty final response)."""
        import grpc

        adapters = self.lora.served() if self.lora is not None else {}
        inputs = client_inputs(triton_inputs(prompt, body, max_tokens, adapters.get(body.model)))
        started = False
        adapter = self.lora.using(body.model) if body.model in adapters else contextlib.nullcontext()
        try:
            with adapter:  # not evicted while it runs (lora.evict_idle_adapters)
                async with contextlib.aclosing(stream_responses(self.grpc_url, self.model, inputs)) as stream:
                    async for result, error in stream:
                        if error is not None:
                            raise response_error(error, started)
                        response = result.get_response()
                        if any(o.name == "text_output" for o in response.outputs):
                            text = "".join(t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1))
                            started = True
                            yield text, np.asarray(result.as_numpy("output_log_probs")).reshape(-1).tolist()
        except grpc.aio.AioRpcError as exc:  # tritonserver stopped, crashed or unreachable
            status = 503 if exc.code() == grpc.StatusCode.UNAVAILABLE else 502
            raise OpenAIError(status, f"the inference server failed: {exc.details()}", "server_error") from None
