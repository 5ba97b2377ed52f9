"""Triton python model serving an `onnxruntime` engine with in-flight batching.

It stands where TensorRT-LLM's `tensorrt_llm` model stands in the repository, with the same inputs and outputs, so
the ensemble and BLS are the same for both targets. The model is decoupled: `execute` only hands each request's
input tensors, as numpy arrays, to the scheduler (`runtime.scheduler`), whose thread owns the engine and
does all the batching: admission within max_batch_size and the KV-cache block pool, prefix reuse, chunked context,
streaming, retiring, cancellation, per-request errors. This file is the Triton side only: parameters, responses
through pb_utils, the `stop` input, metrics and logs.

The python backend runs in the project's virtualenv, where `pipeline` is installed, so the runtime is imported from
the package rather than copied next to this file.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.adapter_registry import Registry, read_index
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.outbox import END, Outbox
from pipeline.targets.onnxruntime.runtime.scheduler import COUNTERS, GAUGES, LABELLED_COUNTERS, METRIC_PREFIX, Scheduler
from pipeline.targets.onnxruntime.runtime.speculative import from_parameters
from pipeline.targets.onnxruntime.runtime.text_stream import TextStream, anchor_of
from pipeline.triton.interface import LLM_TEXT_OUTPUT

faulthandler.enable()  # a crash dumps every thread's stack to stderr: tritonserver's log, which `serve` quotes

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TEXT_OUTPUT = LLM_TEXT_OUTPUT[0]
CANCEL_CHECK_S = 0.05  # how soon a client's going away stops its generation, at most


class TritonResponder:
    """The scheduler's Responder for one request: its answers as Triton responses, with the `tensorrt_llm` outputs
    the request asked for, and `text_output` (each row's text delta, `runtime.text_stream`) when it asks for that.
    They are handed to the `Outbox`, which sends them on its own thread."""

    def __init__(
        self, sender, model_name: str, wanted: set[str], text: Callable[[], TextStream] | None, outbox: Outbox
    ):
        self.sender = sender
        self.model_name = model_name
        self.wanted = wanted
        self.text = text
        self.outbox = outbox
        self.rows: dict[int, TextStream] = {}

    def send_tokens(
        self, row: int, tokens: list[int], log_probs: list[float], cum_log_prob: float, final: bool
    ) -> None:
        self.outbox.put(self, row, (list(tokens), list(log_probs), cum_log_prob, final))

    def send_error(self, message: str) -> None:
        self.outbox.put(self, END, message)

    def send_final(self) -> None:
        self.outbox.put(self, END, None)

    def respond(self, row: int, answer) -> None:
        """Send one answer (on the outbox's thread): a row's tokens, or with row END an error (a message) or the
        empty final response (None)."""
        if row == END:
            if answer is None:
                self.sender.send(flags=FINAL)
            else:
                error = pb_utils.TritonError(f"{self.model_name}: {answer}")
                self.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        tokens, log_probs, cum_log_prob, final = answer
        outputs = {
            "output_ids": lambda: np.asarray(tokens, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": lambda: np.asarray([[len(tokens)]], dtype=np.int32),
            "cum_log_probs": lambda: np.asarray([[cum_log_prob]], dtype=np.float32),
            "output_log_probs": lambda: np.asarray(log_probs, dtype=np.float32).reshape(1, 1, -1),
            "batch_index": lambda: np.asarray([[row]], dtype=np.int32),
            "sequence_index": lambda: np.asarray([[0]], dtype=np.int32),
            "text_output": lambda: np.array([t.encode("utf-8") for t in self.deltas(row, tokens, final)], dtype=object),
        }
        tensors = [pb_utils.Tensor(name, make()) for name, make in outputs.items() if name in self.wanted]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)

    def deltas(self, row: int, tokens: list[int], final: bool) -> list[str]:
        """One text delta per token (empty for a token inside a character): an answer that merged several tokens
        still gives each its own text beside its log-probability."""
        stream = self.rows.get(row) or self.rows.setdefault(row, self.text())
        return [stream.add([token], final and i == len(tokens) - 1) for i, token in enumerate(tokens)]


class AskedNowAndThen:
    """A question asked of tritonserver at most every `period_s`, the last answer given in between: the scheduler
    asks each job whether its client went away at every step, and each asking is a round trip to tritonserver (9%
    of the engine thread's time at one request, 2026-11-28)."""

    def __init__(self, ask: Callable[[], bool], period_s: float):
        self.ask, self.period_s = ask, period_s
        self.answer, self.asked = False, float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.answer and now - self.asked >= self.period_s:
            self.answer, self.asked = bool(self.ask()), now
        return self.answer


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.model_name = args["model_name"]
        engine_dir = params["engine_dir"]
        threads = int(params.get("cpu_threads") or 0) or None
        spinning = str(params.get("cpu_thread_spinning", "false")).lower() == "true"
        runner = ModelRunner.from_dir(
            engine_dir,
            num_threads=threads,
            thread_spinning=spinning,
            speculative=from_parameters(params),
            batch_invariant=params.get("batch_invariant", "false").lower() == "true",
        )
        if runner.lora is not None:
            runner.lora.max_registered = int(params.get("max_cpu_loras") or 0) or None
        if params.get("lora_dir"):  # the build's adapters (pipeline.adapter_registry: its index, a directory each)
            lora_dir = Path(params["lora_dir"])
            for name, entry in read_index(lora_dir).items():
                runner.lora.register(name, lora_dir / name, entry["task_id"])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(engine_dir)  # incomplete UTF-8 held back, and `text_output`
        anchor = anchor_of(tokenizer)
        self.text_stream = lambda: TextStream(tokenizer, anchor)
        # Triton's metrics: families must outlive their metrics, so both are kept on self
        self.metric_families, self.metrics = {}, {}
        for names, kind in ((COUNTERS, pb_utils.MetricFamily.COUNTER), (GAUGES, pb_utils.MetricFamily.GAUGE)):
            for name, description in names.items():
                family = pb_utils.MetricFamily(name=METRIC_PREFIX + name, description=description, kind=kind)
                self.metric_families[name] = family
                if name not in LABELLED_COUNTERS:  # those get a metric per label value, on first use
                    self.metrics[name] = family.Metric(labels={"model": self.model_name})
        self.outbox = Outbox(
            lambda message: pb_utils.Logger.log_error(f"{self.model_name}: {message}"), self._forward_metrics
        )
        self.scheduler = Scheduler(
            runner,
            kv_budget=int(params.get("max_tokens_in_paged_kv_cache") or 0) or None,
            tokens_per_block=int(params.get("tokens_per_block") or 32),
            kv_cache_reuse=params.get("enable_kv_cache_reuse", "false").lower() == "true",
            chunked_context=params.get("enable_chunked_context", "false").lower() == "true",
            exclude_input_default=params.get("exclude_input_in_output", "true").lower() == "true",
            ends_mid_character=lambda tokens: tokenizer.decode(tokens).endswith("\ufffd"),
            on_metrics=self.outbox.put_metrics,
            log_error=lambda message: pb_utils.Logger.log_error(f"{self.model_name}: {message}"),
            on_death=self._exit,
            registry=Registry.from_env(),  # the adapters `serve` adds while serving; no request input loads files
        )
        self.scheduler.start()
        pb_utils.Logger.log_info(
            f"{self.model_name}: engine {engine_dir}, max_batch_size {runner.max_batch_size}, "
            f"KV cache {self.scheduler.kv.num_blocks} blocks of {self.scheduler.kv.tokens_per_block} tokens"
            + (", prefix reuse" if self.scheduler.kv.reuse else "")
        )

    def _forward_metrics(self, increments: dict[str, float], levels: dict[str, float]) -> None:
        for key, amount in increments.items():
            if key not in self.metrics:  # "<name>:<label value>" of a LABELLED_COUNTERS name
                name, _, value = key.partition(":")
                labels = {"model": self.model_name, LABELLED_COUNTERS[name]: value}
                self.metrics[key] = self.metric_families[name].Metric(labels=labels)
            self.metrics[key].increment(amount)
        for name, value in levels.items():
            self.metrics[name].set(value)

    def _exit(self, reason: str) -> None:
        """The scheduler died: end this process, once the outbox has sent what the scheduler answered, as
        tritonserver 2.51 has no way to mark a model unhealthy. `serve`'s watchdog sees it gone and stops the server
        (its streams fail as UNAVAILABLE); a supervisor restarts `serve`."""
        print(f"{self.model_name}: {reason}; exiting", file=sys.stderr, flush=True)
        self.outbox.close()  # what the scheduler answered before it died (its last tokens, the jobs' errors) first
        os._exit(1)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            wanted = set(request.requested_output_names())
            text = self.text_stream if TEXT_OUTPUT in wanted else None
            responder = TritonResponder(sender, self.model_name, wanted, text, self.outbox)
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            stop = inputs.get("stop")
            if stop is not None and stop.any():
                self.scheduler.stop(request.request_id())
                responder.send_final()
                continue
            is_cancelled = AskedNowAndThen(sender.is_cancelled, CANCEL_CHECK_S)
            self.scheduler.submit(inputs, responder, request_id=request.request_id(), is_cancelled=is_cancelled)
        return None

    def finalize(self):
        """What holds pb_utils objects (the metrics; the scheduler, its jobs' response senders in reference cycles)
        goes here, while the stub lives: left to the interpreter's exit, it was destroyed after the 2.51 stub and the
        process segfaulted at nearly every stop (while garbage-collecting; python_backend fixed that use-after-free
        later, commit 47f9e030ea1ef6d33f7069ab129747fe756ace70)."""
        self.scheduler.close()
        self.scheduler.on_metrics = None  # a step outliving close() touches no metric
        self.scheduler = None
        self.outbox.close()  # after the scheduler: its last answers are sent
        self.metrics.clear()
        self.metric_families.clear()
        gc.collect()
