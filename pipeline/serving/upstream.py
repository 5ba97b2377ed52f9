"""The server behind the gateway, as the routes see it (`Upstream`), and tritonserver's BLS as one (`TritonUpstream`).

Routes call only the protocol: one request's generation streamed as (text, log-probabilities) pieces, cancelled by
closing that stream, and whether the server takes requests yet; so another server stands behind the same routes just
as well (an OpenAI-compatible HTTP one such as trtllm-serve: `pipeline.serving.openai_upstream`).

Triton: where the repository's LLM model streams text itself (it declares `text_output`, as our CPU model does), the
gateway does what the BLS and preprocessing would (the prompt and stop words tokenized, the sampling fields named as
the LLM model names them) and streams from the LLM model directly: a token then crosses tritonserver and one model
process, not the BLS and the postprocessing model as well. Otherwise requests go to the `tensorrt_llm_bls` model,
rather than the ensemble because only the BLS stops generating when the client goes away. Either stops when the
gateway closes its stream (`pipeline.triton.client.stream_responses`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import numpy as np

from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.protocol import OpenAIError, Sampling
from pipeline.triton.client import client_inputs, llm_inputs, stream_responses

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


# the BLS's client inputs the LLM model takes under another name (bls.py's TO_LLM; the others keep theirs)
LLM_NAMES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "stream": "streaming"}
TEXT_OUTPUTS = ["text_output", "output_log_probs"]  # what the gateway reads of each response


@dataclass(frozen=True)
class LLMRequests:
    """Requests straight to an LLM model that streams text: the preprocessing model's work done here, as the
    repository's preprocessing model is configured (`tokenizer`, whether special tokens are added, end and pad ids)."""

    tokenizer: Any
    add_special_tokens: bool
    end_id: int
    pad_id: int

    def inputs(self, prompt: str, body: Sampling, max_tokens: int, lora_task_id: int | None) -> list:
        values = triton_inputs(prompt, body, max_tokens, lora_task_id)
        ids = self.tokenizer.encode(values.pop("text_input"), add_special_tokens=self.add_special_tokens)
        stops = values.pop("stop_words")
        values.pop("max_tokens")
        end_id = values.pop("end_id")
        return llm_inputs(
            {
                "input_ids": ids,
                "input_lengths": len(ids),
                "request_output_len": max_tokens,
                "end_id": self.end_id if end_id is None else end_id,
                "pad_id": self.pad_id,
                "stop_words_list": self.word_list(stops or []),
                **{LLM_NAMES.get(name, name): value for name, value in values.items()},
            }
        )

    @classmethod
    def from_preprocessing(cls, parameters: dict[str, str]) -> LLMRequests:
        """As the preprocessing model with these parameters tokenizes (pipeline/triton/models/preprocessing.py)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(parameters["tokenizer_dir"])
        eos = tokenizer.eos_token_id
        end_id = int(parameters.get("end_id") or (eos if eos is not None else 0))
        pad = tokenizer.pad_token_id
        pad_id = int(parameters.get("pad_id") or (pad if pad is not None else end_id))
        return cls(tokenizer, parameters.get("add_special_tokens", "false").lower() == "true", end_id, pad_id)

    def word_list(self, words: list[str]) -> list[list[int]] | None:
        """TensorRT-LLM's [2, n] word list: every word's tokens one after the other, then where each word ends."""
        encoded = [ids for ids in (self.tokenizer.encode(w, add_special_tokens=False) for w in words if w) if ids]
        flat = [token for ids in encoded for token in ids]
        ends = [sum(len(ids) for ids in encoded[: i + 1]) for i in range(len(encoded))]
        return [flat, ends + [-1] * (len(flat) - len(ends))] if flat else None


def response_error(error, started: bool) -> OpenAIError:
    """An error response of the BLS as the client's error: before any text the request was refused; after it, the
    server failed."""
    message = str(error.message() if hasattr(error, "message") else error)
    if DEAD_MODEL in message:  # not the client's fault: `serve` is stopping tritonserver
        return OpenAIError(503, f"a model process of the server died: {message}", "server_error")
    return OpenAIError(502, message, "server_error") if started else OpenAIError(400, message)


@dataclass
class TritonUpstream:
    """tritonserver's model `model` at `grpc_url`: the BLS, or with `llm` the LLM model that streams text; `lora`
    maps adapter model names to task ids; `ready_event`, once set, says its models are loaded (None: ready at once)."""

    grpc_url: str
    model: str
    lora: AdapterAdmin | None = None
    ready_event: threading.Event | None = None
    llm: LLMRequests | None = None
    tokenizer_dir: str = ""  # the tokenizer the repository's preprocessing model loads

    def ready(self) -> bool:
        return self.ready_event is None or self.ready_event.is_set()

    def __post_init__(self):
        self.client = None  # one asyncio gRPC client for every request, made on the app's event loop (`run`)

    async def run(self) -> None:
        """Hold one gRPC client while the app runs, made once tritonserver is ready (`serve` sets readiness when its
        models are loaded; requests before the client exists make their own). Not before: `serve` starts
        tritonserver after the gateway listens, and a fork while gRPC's threads ran aborted tritonserver's child
        (SIGABRT from gRPC's at-fork handler, which a Popen with a preexec_fn runs; once in a CI run)."""
        import tritonclient.grpc.aio as grpcclient

        while not self.ready():
            await asyncio.sleep(0.05)
        self.client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            await asyncio.Event().wait()
        finally:
            client, self.client = self.client, None
            await client.close()

    async def generate(self, prompt: str, body: Sampling, max_tokens: int) -> AsyncIterator[Piece]:
        """Streamed until the RPC ends (the aio client cannot ask for the empty final response)."""
        import grpc

        adapters = self.lora.served() if self.lora is not None else {}
        task_id = adapters.get(body.model)
        if self.llm is not None:  # tokenizing takes a while on a long prompt: not on the event loop
            inputs = await asyncio.to_thread(self.llm.inputs, prompt, body, max_tokens, task_id)
        else:
            inputs = client_inputs(triton_inputs(prompt, body, max_tokens, task_id))
        outputs = TEXT_OUTPUTS if self.llm is not None else ()
        started = False
        adapter = self.lora.using(body.model) if body.model in adapters else contextlib.nullcontext()
        try:
            with adapter:  # not evicted while it runs (lora.evict_idle_adapters)
                async with contextlib.aclosing(
                    stream_responses(self.grpc_url, self.model, inputs, outputs, self.client)
                ) as stream:
                    async for result, error in stream:
                        if error is not None:
                            raise response_error(error, started)
                        response = result.get_response()
                        if any(o.name == "text_output" for o in response.outputs):
                            texts = [t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1)]
                            log_probs = np.asarray(result.as_numpy("output_log_probs")).reshape(-1).tolist()
                            started = True
                            # the LLM model's text is one string per token: shown one by one where asked for
                            if len(texts) == len(log_probs) > 1 and body.shows_tokens():
                                for text, log_prob in zip(texts, log_probs):
                                    yield text, [log_prob]
                            else:
                                yield "".join(texts), log_probs
        except grpc.aio.AioRpcError as exc:  # tritonserver stopped, crashed or unreachable
            status = 503 if exc.code() == grpc.StatusCode.UNAVAILABLE else 502
            raise OpenAIError(status, f"the inference server failed: {exc.details()}", "server_error") from None


def triton_upstream(
    models: dict, bls: str, grpc_url: str, lora: AdapterAdmin | None = None, ready: threading.Event | None = None
) -> TritonUpstream:
    """The gateway's upstream for a repository whose model configs are `models` (name -> ModelConfig) and whose BLS
    model is `bls`: the LLM model the BLS names where it streams text itself (it declares `text_output`), else the
    BLS. The preprocessing model the BLS names says how prompts are tokenized."""
    names = {key: value.string_value for key, value in models[bls].parameters.items()}
    preprocessing = {k: v.string_value for k, v in models[names["preprocessing_model_name"]].parameters.items()}
    llm = models.get(names.get("tensorrt_llm_model_name", ""))
    if llm is not None and any(output.name == TEXT_OUTPUTS[0] for output in llm.output):
        return TritonUpstream(
            grpc_url,
            llm.name,
            lora,
            ready,
            LLMRequests.from_preprocessing(preprocessing),
            preprocessing["tokenizer_dir"],
        )
    return TritonUpstream(grpc_url, bls, lora, ready, None, preprocessing["tokenizer_dir"])
