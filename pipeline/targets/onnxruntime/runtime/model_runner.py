"""ModelRunner for the CPU engine, with the calling conventions of TensorRT-LLM's `ModelRunnerCpp`.

Why: code written against `tensorrt_llm.runtime.ModelRunnerCpp` (`from_dir(...)`, then
`generate(batch_input_ids, max_new_tokens=..., end_id=..., streaming=..., return_dict=...)`
returning `output_ids` [batch, beams, max_seq_len] that start with the prompt) runs unchanged on an
engine directory built by the `onnxruntime` target, so examples, benchmarks and the Triton model
need one code path for both targets.

How:
* The KV cache is kept in one of two layouts, as the engine's graph needs (`runtime.kv_layouts`:
  `SharedCache` for the fused graph, `ConcatCache` for the optimum-onnx graph).
* Decoding is split into steps on a `Batch` whose row i is request i's KV slot: `prefill` (new
  requests -> a batch holding next-token logits), `merge` (requests join a running batch),
  `sample` (one token per row, stop checks), `retire` (finished rows leave, freeing their slot) and
  `decode_step`. `generate` is a loop over these; the Triton python backend reuses them for
  in-flight batching.
* ModelRunnerCpp's sampling arguments become requests, and finished requests its result tensors, in
  `runtime.generate_io`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from pipeline.models import ModelFacts
from pipeline.targets.onnxruntime.runtime.generate_io import SamplingArguments, generate_result
from pipeline.targets.onnxruntime.runtime.guided import Grammars, constrain
from pipeline.targets.onnxruntime.runtime.kv_layouts import Batch, ConcatCache, SharedCache
from pipeline.targets.onnxruntime.runtime.lora_slots import LoraSlots, LoraSpec, check_names, engine_facts
from pipeline.targets.onnxruntime.runtime.sampling import (
    OPS,
    SAMPLING_CHECKS,
    SAMPLING_SETTINGS,
    Request,
    SamplingParams,
    append,
    broken_rows,
    choose,
    greedy_log_probs,
)
from pipeline.targets.onnxruntime.runtime.speculative import speculate_step

ENGINE_TARGET = "onnxruntime"  # the engines this runner reads: the onnxruntime target's (config.json `target`)

ENGINE_CONFIG = "config.json"
ONNX_FILE = "model.onnx"
MAX_DEFAULT_THREADS = 16
# ModelRunnerCpp.from_dir options without a CPU meaning, accepted at these (their default) values.
GPU_OPTION_DEFAULTS = {
    "rank": 0,
    "lora_ckpt_source": "hf",
    "gpu_weights_percent": 1,
    "multi_block_mode": True,
    "use_runtime_defaults": True,
}


class ModelRunner:
    """Generate with an `onnxruntime` engine directory (config.json + model.onnx + tokenizer files)."""

    def __init__(
        self,
        engine_dir: Path,
        config: dict,
        session,
        *,
        max_batch_size: int,
        max_input_len: int,
        max_seq_len: int,
        max_beam_width: int,
        batch_invariant: bool = False,
        speculative=None,
    ):
        self.engine_dir = engine_dir
        self.config = config
        self.session = session
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.max_beam_width = max_beam_width
        pretrained, built = config["pretrained_config"], config["build_config"]
        self._pretrained = pretrained
        self.end_id, self.pad_id = special_ids(engine_dir, config)
        self.max_num_tokens = built.get("max_num_tokens") or max_batch_size * max_input_len
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        past = sorted(n for n in inputs if n.startswith("past_key_values."))
        missing = [
            n for n in ["logits", *(p.replace("past_key_values.", "present.") for p in past)] if n not in outputs
        ]
        if missing or not past:
            raise ValueError(
                f"{engine_dir / ONNX_FILE} is not a decoder with KV cache (past_key_values.* -> present.*): "
                f"missing {missing or 'past_key_values.* inputs'}"
            )
        layout = SharedCache if "seqlens_k" in inputs else ConcatCache
        spec = LoraSpec.from_engine(config)
        carries_lora = any(name.startswith("lora.") for name in inputs)
        self.lora = LoraSlots(spec, self._facts()) if carries_lora and spec else None
        if batch_invariant and layout is ConcatCache:
            raise ValueError(
                f"{engine_dir / ONNX_FILE}: batch-invariant decoding needs the fused graph (target.onnx_graph: fused); "
                "this engine has the optimum graph, whose left-padded rows change with the batch"
            )
        self.cache = layout(
            session,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            vocab_size=self.vocab_size,
            max_num_tokens=self.max_num_tokens,
            max_seq_len=max_seq_len,
            **({"batch_invariant": True} if batch_invariant else {}),
            **({"lora": self.lora} if self.lora else {}),
        )
        if speculative is not None and layout is not SharedCache:
            raise ValueError(
                f"{engine_dir / ONNX_FILE}: speculative decoding needs the fused graph (its KV cache is rolled back "
                "in place); rebuild with target.onnx_graph: fused, or remove runtime.speculative"
            )
        self.speculative = speculative  # speculative.NGram or None

    # ------------------------------------------------------------ construction

    @classmethod
    def from_dir(
        cls,
        engine_dir: str | Path,
        *,
        max_batch_size: int | None = None,
        max_input_len: int | None = None,
        max_output_len: int | None = None,
        max_beam_width: int | None = None,
        num_threads: int | None = None,
        thread_spinning: bool = False,
        batch_invariant: bool = False,
        speculative=None,
        profile_prefix: Path | None = None,
        lora_dir: Sequence[str | Path] | None = None,
        **gpu_options,
    ) -> "ModelRunner":
        """Load an engine. Limits default to the engine's build_config and may only be lowered.

        Args:
            max_output_len: if given, max_seq_len becomes max_input_len + max_output_len (as in ModelRunnerCpp).
            num_threads: ONNX Runtime intra-op threads (default: the CPUs this process may use, at most 16).
            thread_spinning: idle threads spin (faster steps when the cores are ours alone) instead of sleeping.
            batch_invariant: a request's greedy tokens do not depend on what else is in the batch or how its prompt
                is chunked (every forward pass runs an even number of rows; see SharedCache._forward).
            speculative: a `runtime.speculative.NGram`: greedy requests decode with n-gram drafts.
            profile_prefix: ONNX Runtime's profiler writes its trace there (`bench profile`).
            lora_dir: PEFT LoRA adapter directories, selected in `generate` by lora_uids "0", "1", ... (their
                positions, as ModelRunnerCpp names them); the engine must be built with a `lora` section.
            gpu_options: other ModelRunnerCpp.from_dir arguments (lora_dir, rank, kv_cache_free_gpu_memory_fraction,
                ...) are accepted when they hold their defaults, and rejected otherwise.
        """
        engine_dir = Path(engine_dir)
        config_file = engine_dir / ENGINE_CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: build the engine first (trtllm-pipeline build CONFIG)")
        config = json.loads(config_file.read_text())
        built = config.get("build_config", {})
        if config.get("target") != ENGINE_TARGET:  # trtllm-build's config.json names no target
            raise ValueError(
                f"{config_file}: target is {config.get('target', 'trtllm')!r}; this runner serves onnxruntime engines "
                "(use tensorrt_llm.runtime.ModelRunnerCpp for TensorRT-LLM engines)"
            )
        unsupported = sorted(
            k for k, v in gpu_options.items() if v not in (None, False) and GPU_OPTION_DEFAULTS.get(k, object()) != v
        )
        if unsupported:
            raise TypeError(f"ModelRunner.from_dir: not supported by the onnxruntime engine: {', '.join(unsupported)}")

        def limit(name: str, requested: int | None) -> int:
            if requested is not None and requested > built[name]:
                raise ValueError(f"{name}={requested} exceeds the engine's {name} {built[name]} ({config_file})")
            return requested or built[name]

        limits = {
            name: limit(name, value)
            for name, value in (
                ("max_batch_size", max_batch_size),
                ("max_input_len", max_input_len),
                ("max_beam_width", max_beam_width),
            )
        }
        limits["max_seq_len"] = built["max_seq_len"]
        if max_output_len is not None:
            limits["max_seq_len"] = limits["max_input_len"] + max_output_len
            if limits["max_seq_len"] > built["max_seq_len"]:
                raise ValueError(
                    f"max_input_len {limits['max_input_len']} + max_output_len {max_output_len} exceeds the engine's "
                    f"max_seq_len {built['max_seq_len']} ({config_file})"
                )
        session = _ort_session(
            engine_dir / ONNX_FILE, num_threads or default_threads(), thread_spinning, profile_prefix
        )
        runner = cls(engine_dir, config, session, **limits, batch_invariant=batch_invariant, speculative=speculative)
        if lora_dir:
            if runner.lora is None:
                raise ValueError(f"lora_dir: {engine_dir} was built without LoRA (add a lora section and rebuild)")
            for uid, path in enumerate(lora_dir):
                runner.lora.register(str(uid), Path(path))
        return runner

    # ------------------------------------------------------------ ModelRunnerCpp properties

    @property
    def dtype(self):
        import torch

        return getattr(torch, self._pretrained.get("dtype", "float32"))

    @property
    def vocab_size(self) -> int:
        return self._pretrained["vocab_size"]

    @property
    def vocab_size_padded(self) -> int:
        return self.vocab_size

    @property
    def hidden_size(self) -> int:
        return self._pretrained["hidden_size"]

    @property
    def num_heads(self) -> int:
        return self._pretrained["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self._pretrained.get("num_key_value_heads", self.num_heads)

    @property
    def head_size(self) -> int:
        return self._pretrained.get("head_size") or self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        return self._pretrained["num_hidden_layers"]

    @property
    def max_sequence_length(self) -> int:
        return self.max_seq_len

    @property
    def remove_input_padding(self) -> bool:
        return False

    @property
    def max_prompt_embedding_table_size(self) -> int:
        return 0

    @property
    def gather_context_logits(self) -> bool:
        return False

    @property
    def gather_generation_logits(self) -> bool:
        return False

    def _facts(self) -> ModelFacts:
        return engine_facts(self.config)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Guided decoding's compiled guides, for this engine's tokenizer and logits (made on the first guide)."""
        return Grammars(self.engine_dir / "tokenizer.json", self.end_id, self.vocab_size_padded, self.max_seq_len)

    # ------------------------------------------------------------ steps (shared with in-flight batching)

    def prefill(self, requests: list[Request]) -> Batch:
        """Run the prompts; the batch holds their next-token logits."""
        return self.cache.prefill(requests)

    def prefill_chunk(self, partial: Batch | None, request: Request, budget: int) -> Batch:
        """Chunked context: up to `budget` more prompt tokens of one request (start with partial=None);
        once `partial.length == len(request.prompt)` it holds the next-token logits and can be merged."""
        return self.cache.extend(partial, request, budget)

    @property
    def reuses_kv(self) -> bool:
        """Whether a row can start from stored prefix K/V (`seed`, `export`): the fused graph's layout only."""
        return isinstance(self.cache, SharedCache)

    def seed(self, request: Request, prefix: np.ndarray) -> Batch:
        """A 1-row batch holding `prefix`'s K/V for `request`; continue it with `prefill_chunk`."""
        return self.cache.seed(request, prefix)

    def export(self, batch: Batch, row: int, start: int, stop: int) -> np.ndarray:
        """Row `row`'s K/V at positions [start, stop), for the prefix store."""
        return self.cache.export(batch, row, start, stop)

    def decode_step(self, batch: Batch) -> None:
        """Feed each row's last token; updates the batch's cache and logits."""
        self.cache.decode_step(batch)

    def advance(self, batch: Batch) -> tuple[int, int]:
        """The decode step, speculative when configured; returns (draft tokens verified, drafts accepted)."""
        if self.speculative is None:
            self.decode_step(batch)
            return 0, 0
        return speculate_step(self, batch, self.speculative)

    @staticmethod
    def sample(batch: Batch) -> list[Request]:
        """Choose one token per row from the batch's logits (a guided row's masked by its grammar first); returns the
        requests that just finished."""
        logits = batch.logits
        broken = fail_non_finite(batch.requests, logits)
        for row, request in enumerate(batch.requests):
            if request.matcher is not None and row not in broken:
                constrain(request.matcher, logits[row])
        argmax = logits.argmax(axis=1)
        log_probs = greedy_log_probs(logits, argmax)
        done = []
        for row, request in enumerate(batch.requests):
            if row in broken:
                pass
            elif request.params.plain_greedy:
                append(request, int(argmax[row]), float(log_probs[row]))
            else:
                append(request, *choose(request, logits[row]))
            if request.finished:
                done.append(request)
        return done

    def retire(self, batch: Batch) -> Batch:
        """The batch without its finished rows (their KV slots are freed)."""
        keep = [i for i, r in enumerate(batch.requests) if not r.finished]
        return batch if len(keep) == len(batch) else self.cache.select(batch, keep)

    def merge(self, a: Batch, b: Batch) -> Batch:
        """One batch from two (requests joining a running batch)."""
        if not len(a):
            return b
        if not len(b):
            return a
        return self.cache.merge(a, b)

    def run(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Drive requests to completion; yields after every step (each live row got one token, or more when
        speculating)."""
        batch = self.prefill(requests)
        while True:
            self.sample(batch)
            yield requests
            batch = self.retire(batch)
            if not len(batch):
                return
            self.advance(batch)

    # ------------------------------------------------------------ ModelRunnerCpp.generate

    def check_inputs(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], beam_widths: Sequence[int]
    ) -> None:
        """Reject what the engine cannot run, naming the input and the limit it breaks; prompt i asks for
        max_new_tokens[i] tokens with beam_widths[i]. One check for `generate` and for the requests of the
        Triton scheduler (`runtime.scheduler`), so clients of both get the same messages."""
        if not prompts:
            raise ValueError("the batch is empty: pass one token-id sequence per prompt")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts exceeds max_batch_size {self.max_batch_size}")
        for index, (ids, new_tokens, beams) in enumerate(zip(prompts, max_new_tokens, beam_widths)):
            label, length = f"input {index}", len(ids)
            if beams != 1:
                raise ValueError(
                    f"{label}: beam width {beams} is not supported, the onnxruntime engine does not "
                    f"implement beam search (its max_beam_width is {self.max_beam_width}); use 1"
                )
            if new_tokens < 1:
                raise ValueError(f"{label}: max_tokens must be at least 1, got {new_tokens}")
            if not ids:
                raise ValueError(f"{label} is empty; every prompt needs at least one token")
            if length > self.max_input_len:
                raise ValueError(
                    f"{label}: a prompt of {length} tokens exceeds the engine's max_input_len "
                    f"{self.max_input_len} ({length} is more than max_input_len {self.max_input_len}); "
                    "shorten it"
                )
            if length + new_tokens > self.max_seq_len:
                raise ValueError(
                    f"{label}: {length} prompt tokens + max_tokens {new_tokens} exceed the engine's "
                    f"max_seq_len {self.max_seq_len} ({length + new_tokens} exceeds max_seq_len "
                    f"{self.max_seq_len}); lower max_tokens"
                )
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{label} has token ids outside the vocabulary [0, {self.vocab_size}), e.g. {outside[0]}"
                )

    def check_sampling(self, params: Sequence[SamplingParams]) -> None:
        """Reject settings TensorRT-LLM's executor rejects (`SAMPLING_CHECKS`, tabulated from its source), NaN or
        infinite ones (they turn every log-probability into NaN) and end ids outside the vocabulary, naming the
        input, the bound and the value."""
        for index, p in enumerate(params):
            for name, checker in SAMPLING_SETTINGS.items():
                value = getattr(p, name)
                if name == "top_p" and value <= 0:
                    continue  # tensorrtllm_backend's utils.cc: top_p <= 0 means "no top-p" and is never checked
                broken = [
                    f"{op} {bound}" for op, bound in SAMPLING_CHECKS.get(checker, []) if not OPS[op](value, bound)
                ]
                if broken or not math.isfinite(value):
                    raise ValueError(f"input {index}: {name} must be {' and '.join(broken) or 'finite'}, got {value}")
            if not -1 <= p.end_id < self.vocab_size:  # -1: never end, as TensorRT-LLM's ignore_eos sends it
                raise ValueError(
                    f"input {index}: end_id must be -1 (never end) or a token of the vocabulary "
                    f"[0, {self.vocab_size}), got {p.end_id}"
                )

    def generate(
        self,
        batch_input_ids: Sequence,
        *,
        max_new_tokens: int = 1,
        end_id: int | None = None,
        pad_id: int | None = None,
        temperature: float = 1.0,
        top_k: int = 1,
        top_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        random_seed: int | Sequence[int] | None = None,
        num_beams: int = 1,
        stop_words_list=None,
        bad_words_list=None,
        streaming: bool = False,
        return_dict: bool = False,
        output_sequence_lengths: bool = False,
        output_log_probs: bool = False,
        output_cum_log_probs: bool = False,
        sampling_config=None,
        lora_uids: Sequence[str | int | None] | None = None,
        **unsupported,
    ):
        """Generate for a batch of token-id tensors (or lists), like `ModelRunnerCpp.generate`.

        Returns `output_ids` int32 [batch, 1, max_seq_len]: each row is the prompt then the generated
        tokens (end_id excluded), padded with end_id. With `return_dict`, a dict with `output_ids`,
        `sequence_lengths` [batch, 1] (prompt + generated), and when asked `log_probs`
        [batch, 1, max generated] and `cum_log_probs` [batch, 1]. With `streaming`, a generator
        yielding that result after every decode step. `lora_uids`: per prompt, the adapter (an uid of
        `from_dir(lora_dir=...)` or a name registered on `lora`; "-1" or None: the base model).
        """
        import torch  # noqa: F401  (the result is torch tensors: without torch, fail before decoding, not after)

        args = SamplingArguments(
            end_id, pad_id, max_new_tokens, num_beams, temperature, top_k, top_p, repetition_penalty, random_seed
        )
        if sampling_config is not None:  # a tensorrt_llm SamplingConfig: read the fields we implement
            args = args.read(sampling_config)
        given = sorted(k for k, v in unsupported.items() if v not in (None, False))
        if given:
            raise TypeError(f"generate(): not supported by the onnxruntime engine: {', '.join(given)}")
        prompts = [[int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)] for ids in batch_input_ids]
        self.check_inputs(prompts, [args.max_new_tokens] * len(prompts), [args.num_beams or 1] * len(prompts))
        end_id = self._end_id(args)
        requests = args.requests(prompts, end_id, stop_words_list, bad_words_list)
        self.check_sampling([r.params for r in requests])
        if lora_uids is not None:
            self._assign_adapters(requests, lora_uids)
        steps = self._releasing(requests, self.run(requests))
        result = functools.partial(
            generate_result, requests, self.max_seq_len, end_id, return_dict, output_log_probs, output_cum_log_probs
        )
        if streaming:
            return (result() for _ in steps)
        for _ in steps:
            pass
        return result()

    def _end_id(self, args: SamplingArguments) -> int:
        """The id that ends and pads every row: the one given, else the engine's. A pad_id given is only checked
        to be an integer: rows are padded with end_id."""
        end_id = self.end_id if args.end_id is None else int(args.end_id)
        if end_id is None:
            raise ValueError(
                f"no end_id: pass end_id=..., or record end_id in {self.engine_dir / ENGINE_CONFIG} build_config"
            )
        if args.pad_id is not None:
            int(args.pad_id)  # raises for what is no integer
        return end_id

    def _assign_adapters(self, requests: list[Request], lora_uids: Sequence[str | int | None]) -> None:
        """Give each request its LoRA adapter of `lora_uids` ("-1" or None: the base model) and hold their slots."""
        if len(lora_uids) != len(requests):
            raise ValueError(f"lora_uids has {len(lora_uids)} entries for {len(requests)} prompts: one per prompt")
        for request, uid in zip(requests, lora_uids):
            request.adapter = None if uid is None or str(uid) == "-1" else str(uid)
        check_names(self.lora, [r.adapter for r in requests], str(self.engine_dir))
        if self.lora is not None:
            self.lora.hold(requests)  # no other rows hold slots here: it cannot fail

    def _releasing(self, requests: list[Request], steps: Iterator) -> Iterator:
        """`steps`, then the requests' LoRA slots freed, however the caller stops iterating."""
        try:
            yield from steps
        finally:
            if self.lora is not None:
                self.lora.release(requests)


def fail_non_finite(requests: list[Request], logits: np.ndarray) -> set[int]:
    """Rows whose logits are not finite (an adapter or a prompt that overflowed): each such request fails on its own,
    naming its adapter; the others go on (no op of the engine mixes rows). Returns those rows."""
    broken = {int(row) for row in np.flatnonzero(broken_rows(logits))}
    for row in broken:
        request = requests[row]
        source = f"LoRA adapter {request.adapter!r}" if request.adapter else "the model"
        request.finish_reason = "error"
        request.error = f"{source} produced non-finite logits (NaN or inf) for this request; it was stopped"
    return broken


def default_threads() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_THREADS))


def _ort_session(onnx_path: Path, threads: int, spinning: bool = False, profile_prefix: Path | None = None):
    """A CPU session whose idle threads sleep unless `spinning`: spinning threads decode ~30% faster when nothing
    else needs the cores, far slower when other work does. They spin within a run only, and sleep once it returns
    (`session.force_spinning_stop`): between steps the cores are free for the scheduler's Python and, when served,
    tritonserver and the gateway (2026-11-28, `bench serve` 16 x 64 tokens: 129 against 115 output tokens/s at one
    request, 307 against 290 at 8; `bench offline` unchanged within its noise)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spinning)))
    options.add_session_config_entry("session.inter_op.allow_spinning", str(int(spinning)))
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for missing or corrupt files
        raise RuntimeError(
            f"cannot load {onnx_path}: {exc}; rebuild the engine (trtllm-pipeline build CONFIG --force)"
        ) from None


def special_ids(engine_dir: Path, config: dict) -> tuple[int | None, int | None]:
    """end_id and pad_id: build_config, then top-level config, then the engine's generation_config.json."""
    built = config.get("build_config", {})
    generation = {}
    if (engine_dir / "generation_config.json").is_file():
        generation = json.loads((engine_dir / "generation_config.json").read_text())

    def first(*values):
        for value in values:
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return None

    end_id = first(built.get("end_id"), config.get("end_id"), generation.get("eos_token_id"))
    pad_id = first(built.get("pad_id"), config.get("pad_id"), generation.get("pad_token_id"), end_id)
    return end_id, pad_id
