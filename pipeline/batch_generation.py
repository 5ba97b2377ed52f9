"""Batch generation over a prompt file: the body of `trtllm-pipeline run` and `scripts/run_batch.py`.

One interface, two backends: an `onnxruntime` engine runs on our ModelRunner, a TensorRT-LLM engine
on `tensorrt_llm.runtime.ModelRunnerCpp`; both are driven through `generate(..., streaming=True)`,
so time to first token and per-request latency are measured the same way.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path

from pipeline.errors import PipelineError


@dataclass
class Prompt:
    text: str
    max_tokens: int


@dataclass
class Result:
    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (end_id or a stop word) or "length"
    ttft_s: float
    latency_s: float


def read_prompts(path: Path | None, inline: list[str], default_max_tokens: int) -> list[Prompt]:
    """Prompts from the command line, a text file (one per line) or JSONL ({"prompt": ..., "max_tokens": ...})."""
    prompts = [Prompt(text, default_max_tokens) for text in inline]
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise PipelineError(f"cannot read prompts from {path}: {exc.strerror}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                    prompts.append(Prompt(record["prompt"], int(record.get("max_tokens", default_max_tokens))))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise PipelineError(
                        f'{path}:{number}: expected {{"prompt": str, "max_tokens": int}}: {exc}'
                    ) from None
            else:
                prompts.append(Prompt(line, default_max_tokens))
    if not prompts:
        raise PipelineError("no prompts: pass --prompt TEXT or --input-file FILE")
    return prompts


def run_batches(
    runner,
    tokenizer,
    prompts: list[Prompt],
    *,
    batch_size: int,
    chat: bool,
    end_id: int,
    pad_id: int,
    sampling: dict,
    stop_words: list[str],
    on_result=None,
) -> list[Result]:
    """Generate for every prompt, in batches of prompts sharing max_tokens; results keep input order."""
    import torch

    from pipeline.quality import special_prefix

    prefix = special_prefix(tokenizer)

    def encode(text: str) -> list[int]:
        if chat:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
        return prefix + tokenizer(text, add_special_tokens=False)["input_ids"]

    stop_ids = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in stop_words]
    results: dict[int, Result] = {}
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].max_tokens)
    for max_tokens, group in groupby(order, key=lambda i: prompts[i].max_tokens):
        group = list(group)
        for start in range(0, len(group), batch_size):
            rows = group[start : start + batch_size]
            ids = [torch.tensor(encode(prompts[i].text), dtype=torch.int32) for i in rows]
            started = time.perf_counter()
            ttft, done_at, previous = None, {}, None
            for step in runner.generate(
                ids,
                max_new_tokens=max_tokens,
                end_id=end_id,
                pad_id=pad_id,
                streaming=True,
                return_dict=True,
                stop_words_list=[[list(w) for w in stop_ids]] * len(rows) if stop_ids else None,
                **sampling,
            ):
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - started
                lengths = step["sequence_lengths"][:, 0].tolist()
                for row, length in enumerate(lengths):
                    if previous is None or length != previous[row]:
                        done_at[row] = now  # last time the row grew
                previous, final = lengths, step
            for row, index in enumerate(rows):
                length = int(final["sequence_lengths"][row, 0])
                generated = final["output_ids"][row, 0, len(ids[row]) : length].tolist()
                # end_id is not part of the output (as in ModelRunnerCpp): a short output means it was hit
                stopped = len(generated) < max_tokens or any(generated[-len(w) :] == w for w in stop_ids if w)
                results[index] = Result(
                    prompt=prompts[index].text,
                    text=tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                    prompt_tokens=len(ids[row]),
                    completion_tokens=len(generated),
                    finish_reason="stop" if stopped else "length",
                    ttft_s=round(ttft, 4),
                    latency_s=round(done_at.get(row, started) - started, 4),
                )
                if on_result:
                    on_result(results[index])
    return [results[i] for i in range(len(prompts))]


def write_jsonl(path: Path, results: list[Result]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    tmp.replace(path)
