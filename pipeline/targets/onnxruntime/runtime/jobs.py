"""A request's named inputs, as TensorRT-LLM's `tensorrt_llm` model takes them, turned into a `Job` of the
in-flight batching scheduler (`runtime.scheduler`): its rows, their sampling settings, LoRA adapters and
guides, checked as the engine and TensorRT-LLM's executor check them, and how it is answered (`Responder`)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from pipeline.targets.onnxruntime.runtime.guided import Guide
from pipeline.targets.onnxruntime.runtime.kv_cache import BlockManager
from pipeline.targets.onnxruntime.runtime.lora_slots import task_adapters
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams, to_words_list


class Responder(Protocol):
    """How one job is answered. Each job gets exactly one final answer: tokens with final=True, an error or an
    empty final (cancelled or stopped)."""

    def send_tokens(
        self, row: int, tokens: list[int], log_probs: list[float], cum_log_prob: float, final: bool
    ) -> None:
        """Row `row`'s new tokens (streaming) or its whole output."""

    def send_error(self, message: str) -> None:
        """The job failed; final."""

    def send_final(self) -> None:
        """An empty final response."""


def never() -> bool:
    return False


@dataclass
class Job:
    """One client request: its rows (one Request per batch entry) and how to answer it."""

    responder: Responder
    request_id: str
    rows: list[Request]
    streaming: bool
    exclude_input: bool
    is_cancelled: Callable[[], bool] = never  # the client went away
    sent: list[int] = field(init=False)  # per row: output tokens already streamed
    finished_rows: int = 0
    stopped: bool = False  # by a `stop` naming this request's id, or by the client cancelling
    failed: bool = False  # a row failed on its own (`Request.error`): the job got that error as its answer
    guides: list[tuple[Request, Guide, Future]] = field(default_factory=list)  # guided rows, their guides' compiles
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.sent = [0] * len(self.rows)

    @property
    def done(self) -> bool:
        return self.finished_rows == len(self.rows)

    def cancelled(self) -> bool:
        self.stopped = self.stopped or self.is_cancelled()
        return self.stopped


def _per_row(value, rows: int, default, cast) -> list:
    """A [batch, 1] input as one Python value per row (a scalar default when absent, row 0's value when given once)."""
    if value is None:
        return [default] * rows
    flat = np.asarray(value).reshape(len(value), -1)[:, 0] if np.asarray(value).ndim else np.asarray([value])
    return [cast(v) for v in (flat if len(flat) == rows else np.repeat(flat[:1], rows))]


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def guides_of(inputs: Mapping[str, np.ndarray], rows: int) -> list[Guide | None]:
    """Each row's guide from `guided_decoding_guide_type` and `guided_decoding_guide` (None: unconstrained)."""
    kinds = _per_row(inputs.get("guided_decoding_guide_type"), rows, "", _text)
    texts = _per_row(inputs.get("guided_decoding_guide"), rows, "", _text)
    guides = []
    for kind, text in zip(kinds, texts):
        if not kind and text:
            raise ValueError("guided_decoding_guide is given without guided_decoding_guide_type: send both")
        if kind and kind != "json" and not text:
            raise ValueError(f"guided_decoding_guide_type {kind!r} needs its guided_decoding_guide")
        guides.append(Guide(kind, text) if kind else None)
    return guides


def parse_job(
    inputs: Mapping[str, np.ndarray],
    runner: ModelRunner,
    responder: Responder,
    *,
    kv: BlockManager,
    exclude_input_default: bool = True,
    request_id: str = "",
    is_cancelled: Callable[[], bool] = never,
) -> Job:
    """A job from the named inputs of TensorRT-LLM's `tensorrt_llm` model (input_ids [batch, len], the others
    [batch, 1] or one value for every row).

    Raises ValueError, with a message for the client, for what the engine cannot run (`ModelRunner.check_inputs`) and
    for a job whose rows alone need more KV-cache blocks than the pool: it could never be admitted. The guided rows'
    guides start compiling, on `Grammars`' thread (`Job.guides`).
    """
    ids = inputs.get("input_ids")
    if ids is None:
        raise ValueError("input_ids is required unless stop is true")
    ids = np.asarray(ids)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    rows = len(ids)

    def per_row(name: str, default, cast) -> list:
        return _per_row(inputs.get(name), rows, default, cast)

    lengths, max_new = per_row("input_lengths", ids.shape[1], int), per_row("request_output_len", 0, int)
    prompts = [[int(t) for t in ids[row, : lengths[row]]] for row in range(rows)]
    runner.check_inputs(prompts, max_new, per_row("beam_width", 1, int))
    settings = {  # SamplingParams field -> one value per row
        "max_new_tokens": max_new,
        "end_id": per_row("end_id", runner.end_id, int),
        "temperature": per_row("temperature", 1.0, float),
        "top_k": per_row("runtime_top_k", 0, int),
        "top_p": per_row("runtime_top_p", 0.0, float),
        "repetition_penalty": per_row("repetition_penalty", 1.0, float),
        "random_seed": per_row("random_seed", 0, int),
        "stop_words": to_words_list(inputs.get("stop_words_list"), rows),
        "bad_words": to_words_list(inputs.get("bad_words_list"), rows),
        "min_length": per_row("min_length", 0, int),
        "presence_penalty": per_row("presence_penalty", 0.0, float),
        "frequency_penalty": per_row("frequency_penalty", 0.0, float),
    }
    requests = [
        Request(prompt, SamplingParams(**{name: values[row] for name, values in settings.items()}))
        for row, prompt in enumerate(prompts)
    ]
    runner.check_sampling([r.params for r in requests])
    for request, adapter in zip(requests, task_adapters(runner.lora, per_row("lora_task_id", 0, int), "the engine")):
        request.adapter = adapter
        request.adapter_key = runner.lora.identity(adapter) if adapter else None
    guided = []
    for request, guide in zip(requests, guides_of(inputs, rows)):
        if guide is None:
            continue
        if request.params.end_id != runner.end_id:
            raise ValueError(
                f"end_id {request.params.end_id} with guided decoding: a guide ends the output with the model's "
                f"end-of-sequence token {runner.end_id}; leave end_id unset"
            )
        if request.params.min_length:
            raise ValueError("min_length with guided decoding: the guide decides where the output ends; leave it unset")
        guided.append((request, guide))
    need = sum(kv.blocks_for(request) for request in requests)
    if need > kv.num_blocks:
        raise ValueError(
            f"needs {need} KV-cache blocks of {kv.tokens_per_block} tokens (per row: prompt + max_tokens), more than "
            f"the {kv.num_blocks} of max_tokens_in_paged_kv_cache {kv.num_blocks * kv.tokens_per_block}"
        )
    return Job(
        responder,
        request_id,
        requests,
        streaming=per_row("streaming", False, bool)[0],
        exclude_input=per_row("exclude_input_in_output", exclude_input_default, bool)[0],
        is_cancelled=is_cancelled,
        guides=[(request, guide, runner.grammars.compile(guide)) for request, guide in guided],
    )
