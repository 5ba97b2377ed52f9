"""The worker side of a benchmark engine: a process that loads one engine and answers JSON-line requests on stdin.

Why a process per engine: each peer lives in its own environment (llama.cpp's bindings, OpenVINO GenAI and
onnxruntime-genai cannot share ours), and a process's own peak RSS is its engine's. This module needs only the
standard library and numpy, so any peer's interpreter runs it (`python -m pipeline.bench.peers.<engine>` with the
checkout on PYTHONPATH).

Requests and answers, one JSON object per line:
- {"op": "generate", "prompts": [[ids]...], "output_len": n} -> {"ttft_s", "total_s"}: greedy, exactly n tokens per
  row (end of sequence ignored), the rows as one batch; the first token's time as the engine reports it to a caller.
- {"op": "logits", "ids": [...], "path": p} -> {"shape"}: float32 logits [len(ids), vocab] of one forward pass,
  saved with numpy at `p` (JSON would be 100 MB for a 512-token window).
- {"op": "greedy", "prompt": [...], "max_new_tokens": n, "end_id": e} -> {"tokens"}: the greedy answer, ending with
  `e` when the model ends its turn.
Failures answer {"error": "..."}; the first line a worker writes is {"ready": {facts about the loaded engine}}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Protocol

import numpy as np


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]: ...

    def logits(self, ids: list[int]) -> np.ndarray: ...

    def greedy(self, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]: ...


def serve(load) -> None:
    """Answer requests with the engine `load()` returns (with a dict of facts) until stdin closes. The protocol keeps
    a private copy of stdout: native libraries that print (llama.cpp, OpenVINO) write to stderr instead."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")

    try:
        engine, facts = load()
    except Exception as exc:
        traceback.print_exc()
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return
    answer({"ready": facts})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer({"result": handle(engine, request)})
        except Exception as exc:
            traceback.print_exc()
            answer({"error": f"{type(exc).__name__}: {exc}"})


def handle(engine: Engine, request: dict) -> dict:
    op = request["op"]
    if op == "generate":
        ttft, total = engine.generate(request["prompts"], request["output_len"])
        return {"ttft_s": ttft, "total_s": total}
    if op == "logits":
        logits = np.asarray(engine.logits(request["ids"]), dtype=np.float32)
        np.save(request["path"], logits)
        return {"shape": list(logits.shape)}
    if op == "greedy":
        return {
            "tokens": [int(t) for t in engine.greedy(request["prompt"], request["max_new_tokens"], request["end_id"])]
        }
    raise ValueError(f"unknown op {op!r}")


def arguments(argv: list[str] | None = None):
    """The options every worker takes: the model to load and the CPU threads to give it."""
    import argparse

    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    parser.add_argument("--model", required=True, help="the engine's model file or directory")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the engine (repeat)")
    args = parser.parse_args(argv)
    args.options = dict(item.split("=", 1) for item in args.option)
    return args
