"""A streaming gRPC client for the ensemble / BLS interface, shared by tests, benchmarks and the gateway.

Inputs are typed from the interface table, so a caller passes plain Python values:
`stream_text("127.0.0.1:8001", "ensemble", "Hello", max_tokens=16, temperature=0.7, top_k=40)`.
"""

from __future__ import annotations

import queue
import uuid
from typing import AsyncIterator, Iterator

import numpy as np

from pipeline.errors import PipelineError
from pipeline.triton.interface import CLIENT_INPUTS, LORA_LLM_INPUTS

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
_TYPES = {name: dtype for name, dtype, _, _ in CLIENT_INPUTS + LORA_LLM_INPUTS}


def client_inputs(values: dict) -> list:
    """InferInputs with a batch of one for the given client inputs (None values are left out)."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        if name not in _TYPES:
            raise PipelineError(f"unknown input '{name}'; the ensemble takes: {', '.join(_TYPES)}")
        dtype = _TYPES[name]
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


async def stream_responses(url: str, model: str, inputs: list) -> AsyncIterator[tuple]:
    """(result, error) of one streamed request over tritonclient's asyncio gRPC client, to the RPC's own end.

    Read to that end, not only to the final response: a client closed before the server has ended the stream
    cancels it, and a cancelled stream of a completed request keeps tritonserver 2.51 from unloading its model until
    the 30 s exit timeout. Closing this iterator early cancels the request (that is how generation is stopped).
    """
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}

    try:
        async for result, error in client.stream_infer(requests()):
            yield result, error
    finally:
        await client.close()
