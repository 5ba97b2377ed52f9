"""Ending streams early, and stopping the server after it (issue #45).

Found: clients cancelling BLS streams crashed tritonserver 2.51 (its gRPC frontend: a segfault or a heap corruption
within two minutes of 4-8 clients closing streams after 1-3 responses, 3 of 3 runs; none in as long without cancelling,
nor cancelling the LLM model's own streams), and took the BLS process down once (a heap corruption, SIGABRT) under
the gateway's stop strings and disconnects. A cancel that reached it while a request completed (a client closing its
stream on the last answer or on an error) kept that model loaded at a stop: `serve` took 32 s, tritonserver waiting
its whole exit timeout with nothing in flight. So `stream_responses` never cancels (it stops the generation through
the LLM model's `stop` and reads the stream to its end), and `TritonServer.stop` gives the models UNLOAD_S to unload.
Each test starts its own real tritonserver (the stops are what they measure).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pipeline.build import cache_dir
from pipeline.triton.client import client_inputs, stream_responses
from pipeline.triton.server import UNLOAD_S, TritonServer

STOP_WITHIN = 8.0  # seconds from SIGINT to a stopped server, however it was used (measured 2-4 s)
LONG = {"text_input": "Tell me a story.", "max_tokens": 1000, "end_id": -1, "stream": True}  # runs to max_tokens


@pytest.fixture
def started(smollm2_build, tmp_path):
    """A started TritonServer on the SmolLM2 build and what it logged (`serve`'s console); stopped by the test. Its
    log is verbose: tritonserver's gRPC frontend logs each cancel it gets ("Issuing cancellation for ...")."""
    messages: list[str] = []
    server = TritonServer(
        smollm2_build / "triton_repo",
        cache_dir(),
        log_file=tmp_path / "tritonserver.log",
        extra_args=("--log-verbose=1",),
        log=messages.append,
    ).start()
    yield server, messages
    server.stop()


def timed_stop(server: TritonServer) -> float:
    started = time.monotonic()
    server.stop()
    return time.monotonic() - started


async def first_then_close(url: str, params: dict) -> float:
    """Seconds from closing a BLS stream after its first response to `stream_responses` having ended it."""
    async with contextlib.aclosing(stream_responses(url, "tensorrt_llm_bls", client_inputs(params))) as stream:
        result, error = await anext(stream)
        assert error is None, error
        closing = time.monotonic()
    return time.monotonic() - closing


def test_streams_closed_early_are_stopped_not_cancelled_and_the_server_stops_at_once(started):
    """Eight streams closed at their first response, four at once, and four closed at their error: tritonserver gets
    no cancel, each generation ends within seconds of the close (1000 tokens take a minute or more), and every model
    unloads by itself. (A plain client closing so made tritonserver issue cancellations, and hold the BLS at stop.)"""
    server, messages = started
    url = f"127.0.0.1:{server.ports.grpc}"
    bad_guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{"}

    async def closing_at_error() -> None:
        params = {"text_input": "Hello", "max_tokens": 16, "stream": True, **bad_guide}
        async with contextlib.aclosing(stream_responses(url, "tensorrt_llm_bls", client_inputs(params))) as stream:
            async for _, error in stream:
                assert error is not None and "guided_decoding_guide" in error.message(), error
                break

    async def traffic() -> list[float]:
        ends = [await first_then_close(url, LONG) for _ in range(4)]
        ends += await asyncio.gather(*(first_then_close(url, LONG) for _ in range(4)))
        await asyncio.gather(*(closing_at_error() for _ in range(4)))
        return ends

    ends = asyncio.run(traffic())
    print(f"\nstreams ended {[round(e, 2) for e in ends]} s after their close")
    assert max(ends) < 5.0, ends
    stop = timed_stop(server)
    print(f"stop: {stop:.1f} s")
    assert stop < STOP_WITHIN and not [m for m in messages if "still held" in m], messages  # every model unloaded
    log = server.log_file.read_text()
    assert "Issuing cancellation" not in log and "Cancellation notification received" not in log
    assert "Fatal Python error" not in log  # the LLM model segfaulted at its exit before finalize dropped its objects


# A decoupled python model that answers once and keeps the response sender, never sending its final flag: what a
# request tritonserver never completes looks like at a stop (the model stays loaded, nothing in flight).
HOLDING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.held = []

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))]))
            self.held.append(sender)
"""
HOLDING_CONFIG = """
name: "holding"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "IN", data_type: TYPE_INT32, dims: [1] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


def test_a_model_held_by_an_unfinished_request_holds_the_stop_only_unload_s(tmp_path):
    """tritonserver 2.51 waited its whole 30 s exit timeout for such a model (`serve` took 32 s after clients had
    cancelled BLS streams as their requests completed: 3 of 3 tries of closing on the last answer, 1 of 3 on an
    error); `stop` gives the unloading models UNLOAD_S, then kills the server naming what held it."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    model = tmp_path / "repo" / "holding"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(HOLDING_MODEL)
    (model / "config.pbtxt").write_text(HOLDING_CONFIG)
    messages: list[str] = []
    server = TritonServer(model.parent, cache_dir(), log_file=tmp_path / "tritonserver.log", log=messages.append)
    server.start()
    try:
        answers = []
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        client.start_stream(callback=lambda result, error: answers.append((result, error)))
        value = grpcclient.InferInput("IN", [1], "INT32")
        value.set_data_from_numpy(np.array([1], dtype=np.int32))
        client.async_stream_infer("holding", [value])
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client.stop_stream(cancel_requests=True)  # the model takes no notice: its request never completes
        client.close()
    finally:
        stop = timed_stop(server)
    print(f"\nstop with a request never completed: {stop:.1f} s; {messages}")
    assert answers[0][1] is None and stop < STOP_WITHIN
    assert f"tritonserver still held model(s) holding {UNLOAD_S:.0f} s into unloading: killed" in messages
