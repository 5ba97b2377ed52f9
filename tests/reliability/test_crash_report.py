"""What `serve` says when a model process crashes (issue #45): the BLS process died once in six runs and nothing
told why. Every python model enables faulthandler, whose report (the stack of every thread) goes to the process's
stderr, tritonserver's log; the watchdog names the model, how its process ended (read from /proc while it is a
zombie) and what the model processes last wrote there. With it the cause showed: `malloc(): mismatching
next->prev_size (unsorted)`, SIGABRT, a thread in the BLS's cancellation path (see test_stream_stops.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from pipeline.build import cache_dir
from pipeline.triton.client import stream_text
from pipeline.triton.server import STUB, TritonServer


def test_a_crashed_model_process_is_reported_with_its_signal_and_every_threads_stack(smollm2_build, tmp_path):
    """A SIGSEGV sent to the BLS process while it streams: faulthandler reports it and `serve`'s log quotes it."""
    messages: list[str] = []
    server = TritonServer(
        smollm2_build / "triton_repo", cache_dir(), log_file=tmp_path / "tritonserver.log", log=messages.append
    ).start()
    try:
        url = f"127.0.0.1:{server.ports.grpc}"
        streaming = threading.Event()

        def stream() -> None:
            with contextlib.suppress(Exception):  # the stream fails once the server is stopped
                for _ in stream_text(url, "tensorrt_llm_bls", "Tell me a story.", 1000, end_id=-1, timeout=60):
                    streaming.set()

        threading.Thread(target=stream, daemon=True).start()
        assert streaming.wait(120)
        bls = next(p for p, model in server.stubs.items() if model == "tensorrt_llm_bls" and p.name() == STUB)
        os.kill(bls.pid, signal.SIGSEGV)
        deadline = time.monotonic() + 10
        while server.failure is None:
            assert time.monotonic() < deadline, messages
            time.sleep(0.1)
        server.process.wait(10)
    finally:
        server.stop()
    said = "\n".join(messages)
    print(f"\n{said}")
    assert (
        server.failure == f"the process of model 'tensorrt_llm_bls' (pid {bls.pid}) died: killed by signal 11 (SIGSEGV)"
    )
    assert "Fatal Python error: Segmentation fault" in said  # faulthandler's report, from tritonserver's log
    assert "tensorrt_llm_bls/1/model.py" in said and "in _generate" in said  # the streaming thread's stack
