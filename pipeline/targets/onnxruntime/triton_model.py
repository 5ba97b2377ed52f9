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
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.adapter_registry import Registry, read_index
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.scheduler import COUNTERS, GAUGES, LABELLED_COUNTERS, METRIC_PREFIX, Scheduler
from pipeline.targets.onnxruntime.runtime.speculative import from_parameters

faulthandler.enable()  # a crash dumps every thread's stack to stderr: tritonserver's log, which `serve` quotes

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonResponder:
    """The scheduler's Responder for one request: its answers as Triton responses, with the `tensorrt_llm` outputs."""

    def __init__(self, sender, model_name: str):
        self.sender = sender
        self.model_name = model_name

    def send_tokens(
        self, row: int, tokens: list[int], log_probs: list[float], cum_log_prob: float, final: bool
    ) -> None:
        outputs = [
            pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, 1, -1)),
            pb_utils.Tensor("sequence_length", np.asarray([[len(tokens)]], dtype=np.int32)),
            pb_utils.Tensor("cum_log_probs", np.asarray([[cum_log_prob]], dtype=np.float32)),
            pb_utils.Tensor("output_log_probs", np.asarray(log_probs, dtype=np.float32).reshape(1, 1, -1)),
            pb_utils.Tensor("batch_index", np.asarray([[row]], dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.asarray([[0]], dtype=np.int32)),
        ]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL if final else 0)

    def send_error(self, message: str) -> None:
        error = pb_utils.TritonError(f"{self.model_name}: {message}")
        self.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def send_final(self) -> None:
        self.sender.send(flags=FINAL)


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

        tokenizer = AutoTokenizer.from_pretrained(engine_dir)  # only to hold back incomplete UTF-8 when streaming
        # Triton's metrics: families must outlive their metrics, so both are kept on self
        self.metric_families, self.metrics = {}, {}
        for names, kind in ((COUNTERS, pb_utils.MetricFamily.COUNTER), (GAUGES, pb_utils.MetricFamily.GAUGE)):
            for name, description in names.items():
                family = pb_utils.MetricFamily(name=METRIC_PREFIX + name, description=description, kind=kind)
                self.metric_families[name] = family
                if name not in LABELLED_COUNTERS:  # those get a metric per label value, on first use
                    self.metrics[name] = family.Metric(labels={"model": self.model_name})
        self.scheduler = Scheduler(
            runner,
            kv_budget=int(params.get("max_tokens_in_paged_kv_cache") or 0) or None,
            tokens_per_block=int(params.get("tokens_per_block") or 32),
            kv_cache_reuse=params.get("enable_kv_cache_reuse", "false").lower() == "true",
            chunked_context=params.get("enable_chunked_context", "false").lower() == "true",
            exclude_input_default=params.get("exclude_input_in_output", "true").lower() == "true",
            ends_mid_character=lambda tokens: tokenizer.decode(tokens).endswith("\ufffd"),
            on_metrics=self._forward_metrics,
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
        """The scheduler died: end this process, as tritonserver 2.51 has no way to mark a model unhealthy. `serve`'s
        watchdog sees it gone and stops the server (its streams fail as UNAVAILABLE); a supervisor restarts `serve`."""
        print(f"{self.model_name}: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            responder = TritonResponder(sender, self.model_name)
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            stop = inputs.get("stop")
            if stop is not None and stop.any():
                self.scheduler.stop(request.request_id())
                responder.send_final()
                continue
            self.scheduler.submit(inputs, responder, request_id=request.request_id(), is_cancelled=sender.is_cancelled)
        return None

    def finalize(self):
        """What holds pb_utils objects (the metrics; the scheduler, its jobs' response senders in reference cycles)
        goes here, while the stub lives: left to the interpreter's exit, it was destroyed after the 2.51 stub and the
        process segfaulted at nearly every stop (while garbage-collecting; python_backend fixed that use-after-free
        later, commit 47f9e030ea1ef6d33f7069ab129747fe756ace70)."""
        self.scheduler.close()
        self.scheduler.on_metrics = None  # a step outliving close() touches no metric
        self.scheduler = None
        self.metrics.clear()
        self.metric_families.clear()
        gc.collect()
