"""A streaming gRPC client for the ensemble / BLS interface, shared by tests, benchmarks and the gateway.

Inputs are typed from the interface table, so a caller passes plain Python values:
`stream_text("127.0.0.1:8001", "ensemble", "Hello", max_tokens=16, temperature=0.7, top_k=40)`.
"""

from __future__ import annotations

import asyncio
import queue
import uuid
from typing import AsyncIterator, Iterator

import numpy as np

from pipeline.errors import PipelineError
from pipeline.triton.interface import CLIENT_INPUTS, LLM_INPUTS, LORA_LLM_INPUTS

_NUMPY = {
    "TYPE_STRING": object,
    "TYPE_INT32": np.int32,
    "TYPE_FP32": np.float32,
    "TYPE_UINT64": np.uint64,
    "TYPE_BOOL": bool,
    "TYPE_FP16": np.float16,
}
_WIRE = {
    "TYPE_STRING": "BYTES",
    "TYPE_INT32": "INT32",
    "TYPE_FP32": "FP32",
    "TYPE_UINT64": "UINT64",
    "TYPE_BOOL": "BOOL",
    "TYPE_FP16": "FP16",
}
# A stream closed early: how often it is stopped (`_stop`), and how long it is read towards its end each time.
STOP_ATTEMPTS, STOP_WAIT_S = 3, 2.0
_TYPES = {name: dtype for name, dtype, _, _ in CLIENT_INPUTS + LORA_LLM_INPUTS}
_LLM_TYPES = {name: dtype for name, dtype, _, _ in LLM_INPUTS + LORA_LLM_INPUTS}


def client_inputs(values: dict) -> list:
    """InferInputs with a batch of one for the given client inputs (None values are left out)."""
    return typed_inputs(values, _TYPES, "the ensemble")


def llm_inputs(values: dict) -> list:
    """InferInputs with a batch of one for the given inputs of the LLM model (None values are left out)."""
    return typed_inputs(values, _LLM_TYPES, "the LLM model")


def typed_inputs(values: dict, types: dict[str, str], taker: str) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name not in types:
            raise PipelineError(f"unknown input '{name}'; {taker} takes: {', '.join(types)}")
        dtype = types[name]
        items = value if isinstance(value, (list, tuple)) else [value]
        if dtype == "TYPE_STRING":
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
        array = np.array([items], dtype=_NUMPY[dtype])
        tensor = grpcclient.InferInput(name, list(array.shape), _WIRE[dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_text(
    url: str, model: str, prompt: str, max_tokens: int, *, timeout: float = 300.0, **params
) -> Iterator[str]:
    """Yield text chunks as the server streams them; closing the generator early cancels the request."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(
            model,
            client_inputs({"text_input": prompt, "max_tokens": max_tokens, "stream": True, **params}),
            request_id=uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise PipelineError(f"{model}: no response within {timeout:.0f} s") from None
            if error is not None:
                raise PipelineError(f"{model}: {error.message() if hasattr(error, 'message') else error}")
            response = result.get_response()
            if any(o.name == "text_output" for o in response.outputs):
                yield "".join(t.decode("utf-8") for t in result.as_numpy("text_output").reshape(-1))
            if response.parameters["triton_final_response"].bool_param:
                finished = True
                return
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


async def stream_responses(
    url: str, model: str, inputs: list, outputs: list[str] = (), client=None
) -> AsyncIterator[tuple]:
    """(result, error) of one streamed request over tritonclient's asyncio gRPC client, to the RPC's own end; the
    responses carry the `outputs` named (none named: every output of the model). `client`: an asyncio client of
    `url` its owner keeps open (a channel made per request cost the gateway about a millisecond of CPU each); None:
    one for this request.

    Closing this iterator early stops the generation, but never by cancelling the stream: tritonserver 2.51's gRPC
    frontend crashed under clients cancelling BLS streams (a segfault or a heap corruption within two minutes of 4-8
    clients doing it; none without cancelling, nor cancelling the LLM model's own streams), and a cancel that reached
    it while the request completed held the model at a stop until the 30 s exit timeout. So a `stop` naming the
    request goes to the LLM model (`_stop`), and the stream is read to its end; after an error, the request's final
    response (the models send errors with the final flag), it is only read to its end. A stream still running then
    is cancelled after all.
    """
    import tritonclient.grpc.aio as grpcclient

    owned = client is None
    client = grpcclient.InferenceServerClient(url) if owned else client
    request_id = uuid.uuid4().hex

    requested = [grpcclient.InferRequestedOutput(name) for name in outputs]

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id, "outputs": requested or None}

    responses = client.stream_infer(requests())
    ended = failed = False
    try:
        async for result, error in responses:
            failed = error is not None
            yield result, error
        ended = True
    finally:
        try:
            if not ended:
                await _end(client, model, request_id, responses, stop=not failed)
        except Exception:  # the server failed or stopped: nothing left to end
            pass
        finally:
            if owned:
                await client.close()


async def _end(client, model: str, request_id: str, responses, stop: bool) -> None:
    """Read `responses` to the RPC's end, the generation stopped first when `stop` (`_stop`), again each time the
    stream does not end within STOP_WAIT_S (a stop that came before the BLS had asked the LLM model stops nothing);
    a stream running after STOP_ATTEMPTS is cancelled. The read is waited on, never timed out: grpc's asyncio client
    cancels the RPC whose read is cancelled (that was the cancel a loaded machine sent after 2 s)."""
    reading = asyncio.ensure_future(_read_to_end(responses))
    try:
        for _ in range(STOP_ATTEMPTS):
            if stop:
                await _stop(client, model, request_id)
            if (await asyncio.wait({reading}, timeout=STOP_WAIT_S))[0]:
                return reading.result()
    finally:
        reading.cancel()


async def _read_to_end(responses) -> None:
    async for _response in responses:
        pass


async def _stop(client, model: str, request_id: str) -> None:
    """TensorRT-LLM's `stop` input, naming `request_id`, to the model that generates for `model`: the LLM model a BLS
    names in its config (the BLS passes its request id on to it), or `model` itself when it takes `stop`."""
    config = (await client.get_model_config(model, as_json=True))["config"]
    target = config.get("parameters", {}).get("tensorrt_llm_model_name", {}).get("string_value")
    if not target and any(tensor["name"] == "stop" for tensor in config.get("input", [])):
        target = model
    if not target:
        return
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value, dtype in (
        ("stop", True, "BOOL"),
        ("input_lengths", 0, "INT32"),
        ("request_output_len", 0, "INT32"),
    ):
        tensor = grpcclient.InferInput(name, [1, 1], dtype)
        tensor.set_data_from_numpy(np.array([[value]], dtype=bool if dtype == "BOOL" else np.int32))
        inputs.append(tensor)

    async def requests():
        yield {"model_name": target, "inputs": inputs, "request_id": request_id}

    async for _ in client.stream_infer(requests()):  # one empty final response, then the RPC's end
        pass
