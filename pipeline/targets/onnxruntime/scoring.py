"""How this machine runs an onnxruntime build for the quality gate (`pipeline.quality`): the engine through the
ModelRunner users get, against the fp32 ONNX graph the export stage wrote and held to transformers' logits
(`verify.max_export_logits_diff`). That graph is the fp32 model with a KV cache, so its greedy chat answers take
seconds where transformers' generate took minutes, and both sides decode the same way.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import numpy as np

from pipeline.quality import Loaded, LogitsFn, Model
from pipeline.targets.onnxruntime import ONNX_NAME


def scored(cfg, output: Path, engine_dir: Path) -> tuple[Model, Model]:
    """(the engine in `engine_dir`, its reference by `verify.reference_dtype`: float32, the graph the export stage of
    `output` wrote; bfloat16, its imported checkpoint run by transformers, as ONNX Runtime's CPU provider has almost
    no bfloat16 kernels), each loaded on first use and dropped by its `release`. The reference's greedy chat answers
    are kept in the cache under its stage's hash: a rebuild that changes only the quantization or the engine's limits
    does not decode them again. They are decoded 8 prompts at a time (`batched_greedy`: SmolLM2's 30 answers in 7.9 s
    against 26.3 s one at a time, the same 30 answers)."""
    import onnxruntime as ort

    from pipeline.lock import read_lock
    from pipeline.targets.onnxruntime.runtime import speculative
    from pipeline.targets.onnxruntime.runtime.model_runner import ENGINE_CONFIG, ModelRunner, special_ids
    from pipeline.torch_models import transformers_reference

    threads, stages = cfg.runtime.cpu_threads, read_lock(output)["stages"]
    config = json.loads((engine_dir / ENGINE_CONFIG).read_text())
    built = config["build_config"]
    engine = Loaded(  # with the runtime settings that shape greedy tokens: users get those
        lambda: ModelRunner.from_dir(
            engine_dir,
            num_threads=threads,
            batch_invariant=cfg.runtime.batch_invariant,
            speculative=speculative.from_config(cfg.runtime.speculative),
        )
    )
    end_id = special_ids(engine_dir, config)[0]
    model = runner_model("engine", engine_dir, engine, end_id)
    if cfg.verify.reference_dtype == "bfloat16":
        imported = stages.get("import", {}).get("output_hash")
        return model, transformers_reference(output / "import", imported, "bfloat16")
    exported = output / "export" / ONNX_NAME
    fp32 = Loaded(  # the engine's limits and end token over the exported graph, one prompt at a time
        lambda: ModelRunner(
            engine_dir,
            config,
            ort_session(exported, threads),
            max_batch_size=1,
            max_input_len=built["max_input_len"],
            max_seq_len=built["max_seq_len"],
            max_beam_width=1,
        )
    )
    export_hash = stages.get("export", {}).get("output_hash")
    answers_key = export_hash and (
        f"{export_hash} onnxruntime {ort.__version__} intra-op threads {threads or 'auto'} of {os.cpu_count()} CPUs "
        f"max_input_len {built['max_input_len']} max_seq_len {built['max_seq_len']} batch-invariant, "
        f"{REFERENCE_ROWS} rows"
    )
    reference = runner_model("fp32 ONNX graph", exported, fp32, end_id, answers_key)
    reference.greedy_all = partial(batched_greedy, fp32)
    return model, reference


# The reference's greedy chat answers decode this many prompts at once: a decode step reads every weight whatever the
# rows, so 8 rows cost little more than one (1.1B: 260 s of a 536 s engine stage one prompt at a time)
REFERENCE_ROWS = 8


def batched_greedy(runner: Loaded, prompts: list[list[int]], max_new_tokens: int, end_id: int) -> list[list[int]]:
    """The greedy answers to `prompts`, REFERENCE_ROWS at a time, batch-invariant (`ModelRunner`'s batch_invariant:
    each row's tokens are those it gets alone), on the session of `runner`, with a KV cache as long as the longest
    prompt and its answer rather than the engine's max_seq_len times the rows."""
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    alone = runner()
    longest = max(len(prompt) for prompt in prompts)
    rows = ModelRunner(
        alone.engine_dir,
        alone.config,
        alone.session,
        max_batch_size=REFERENCE_ROWS,
        max_input_len=min(longest, alone.max_input_len),
        max_seq_len=min(longest + max_new_tokens, alone.max_seq_len),
        max_beam_width=1,
        batch_invariant=True,
    )
    answers = []
    for start in range(0, len(prompts), REFERENCE_ROWS):
        batch = prompts[start : start + REFERENCE_ROWS]
        out = rows.generate(batch, max_new_tokens=max_new_tokens, end_id=end_id, return_dict=True)
        for row, prompt in enumerate(batch):
            answer = out["output_ids"][row, 0, len(prompt) : int(out["sequence_lengths"][row, 0])].tolist()
            answers.append(answer + [end_id] if len(answer) < max_new_tokens else answer)
    return answers


def adapter_scored(cfg, engine_dir: Path, hf_dir: Path, name: str, adapter_dir: Path) -> tuple[Model, Model]:
    """(the engine decoding with LoRA adapter `name` from `adapter_dir`, its fp32 reference: PEFT's merge of the
    adapter into the imported transformers model), each loaded on first use and dropped by its `release`."""
    from pipeline.targets.onnxruntime.runtime.model_runner import ENGINE_CONFIG, ModelRunner, special_ids
    from pipeline.torch_models import peft_reference

    def with_adapter():
        runner = ModelRunner.from_dir(
            engine_dir, num_threads=cfg.runtime.cpu_threads, batch_invariant=cfg.runtime.batch_invariant
        )
        runner.lora.register(name, adapter_dir)
        (slot,) = runner.lora.acquire([name])  # held for the gate's passes
        return runner, slot

    engine = Loaded(with_adapter)

    def logits(ids: np.ndarray) -> np.ndarray:
        runner, slot = engine()
        return session_logits_fn(runner.session, partial(runner.lora.slot_feeds, slot))(ids)

    model = Model(
        f"engine with adapter {name}",
        engine_dir,
        logits,
        lambda prompt, max_new_tokens, end: runner_greedy(engine()[0], prompt, max_new_tokens, end, adapter=name),
        special_ids(engine_dir, json.loads((engine_dir / ENGINE_CONFIG).read_text()))[0],
        release=engine.release,
    )
    return model, peft_reference(hf_dir, adapter_dir, name)


def runner_model(name: str, path: Path, runner: Loaded, end_id: int | None, answers_key: str | None = None) -> Model:
    """A ModelRunner, loaded on first use by `runner`, as the gate runs it."""
    return Model(
        name,
        path,
        lambda ids: session_logits_fn(runner().session)(ids),
        lambda prompt, max_new_tokens, end: runner_greedy(runner(), prompt, max_new_tokens, end),
        end_id,
        answers_key=answers_key,
        release=runner.release,
    )


def runner_greedy(runner, prompt: list[int], max_new_tokens: int, end_id: int, adapter: str | None = None) -> list[int]:
    """A ModelRunner's greedy continuation as `torch_models.torch_greedy` reports it (the runner leaves end_id out).
    Batch size 1, so that the answer does not depend on which prompts share the batch."""
    out = runner.generate(
        [prompt], max_new_tokens=max_new_tokens, end_id=end_id, return_dict=True, lora_uids=adapter and [adapter]
    )
    answer = out["output_ids"][0, 0, len(prompt) : int(out["sequence_lengths"][0, 0])].tolist()
    return answer + [end_id] if len(answer) < max_new_tokens else answer


def ort_session(onnx_path: Path, threads: int | None = None):
    """An ONNX Runtime CPU session that does not spin idle threads (spinning starves co-located work)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def empty_past(session, batch: int) -> dict[str, np.ndarray]:
    """Zero-length KV-cache inputs, for a forward pass over a whole prompt (and no LoRA slots: the base model)."""
    feeds = {}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            kv_heads, head_size = spec.shape[1], spec.shape[3]
            feeds[spec.name] = np.zeros((batch, kv_heads, 0, head_size), dtype=np.float32)
        elif spec.name.startswith(
            "lora"
        ):  # pipeline.targets.onnxruntime.runtime.lora_slots: no slot bound, every width 0
            shape = [batch if d == "batch" else 0 if isinstance(d, str) else d for d in spec.shape]
            feeds[spec.name] = np.zeros(shape, dtype=bool if spec.type == "tensor(bool)" else np.float32)
    return feeds


def ort_logits_fn(onnx_path: Path, threads: int | None = None) -> LogitsFn:
    return session_logits_fn(ort_session(onnx_path, threads))


def session_logits_fn(session, lora_feeds=None) -> LogitsFn:
    """Logits of every position of a whole-prompt forward pass (no cache) of an exported decoder; `lora_feeds(rows)`
    gives the LoRA inputs of a fused graph carrying LoRA (default: none bound, the base model)."""
    names = {i.name for i in session.get_inputs()}
    fused = "seqlens_k" in names  # the graph of pipeline/targets/onnxruntime/graph.py

    def logits(ids: np.ndarray) -> np.ndarray:
        batch, length = ids.shape
        if fused:
            feeds = {
                "input_ids": ids,
                "seqlens_k": np.full(batch, length - 1, dtype=np.int32),
                "total_sequence_length": np.array(length, dtype=np.int32),
                "logits_index": np.arange(batch * length),
                **empty_past(session, batch),
                **(lora_feeds(batch) if lora_feeds else {}),
            }
            return session.run(["logits"], feeds)[0].reshape(batch, length, -1)
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((batch, length), dtype=np.int64),
            **empty_past(session, batch),
        }
        if "position_ids" in names:  # optimum's Gemma 2/3 graphs derive positions from the mask
            feeds["position_ids"] = np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy()
        return session.run(["logits"], feeds)[0]

    return logits
