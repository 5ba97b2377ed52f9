"""Offline benchmark: the built engine through its ModelRunner against Hugging Face transformers
`generate` (and, when given, an onnxruntime-genai model) on the same workload, in the same run.
Greedy, fixed lengths (end of sequence ignored), medians of `repeats`. Each engine is loaded alone
and its peak RSS sampled while it runs.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

# Recorded in results.json as skipped: no llama.cpp peer is driven, whether or not llama-cpp-python is installed.
PEERS_NOT_MEASURED = {"llama.cpp": "not measured yet: bench offline has no llama.cpp peer"}


@contextmanager
def peak_rss():
    """Yields a dict whose 'mib' holds the process's peak resident memory while the block ran."""
    import psutil

    process, result, stop = psutil.Process(), {"mib": 0.0}, threading.Event()

    def sample():
        while not stop.is_set():
            result["mib"] = max(result["mib"], process.memory_info().rss / 2**20)
            stop.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()


def workload(tokenizer, text: str, batch: int, input_len: int) -> list[torch.Tensor]:
    """Prompts of exactly input_len real tokens, a different window of the text per row."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids * (input_len * (batch + 1) // len(ids) + 1)
    return [torch.tensor(ids[row * input_len : (row + 1) * input_len]) for row in range(batch)]


def time_runner(runner, prompts: list[torch.Tensor], output_len: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for everything) with the ModelRunner interface (ours or ModelRunnerCpp)."""
    started, first = time.perf_counter(), None
    for _ in runner.generate(prompts, max_new_tokens=output_len, end_id=-1, streaming=True):
        first = first or time.perf_counter() - started
    return first, time.perf_counter() - started


def time_transformers(model, prompts: list[torch.Tensor], output_len: int) -> tuple[float, float]:
    ids = torch.stack(prompts)  # equal lengths: no padding
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        first = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, **kwargs)
    return first, time.perf_counter() - started


def time_genai(model, prompts: list[torch.Tensor], output_len: int) -> tuple[float, float]:
    """onnxruntime-genai's own generator loop (static batch), fed the same token ids."""
    import numpy as np
    import onnxruntime_genai as og

    ids = np.stack([p.numpy() for p in prompts]).astype(np.int32)
    params = og.GeneratorParams(model)
    length = ids.shape[1] + output_len
    params.set_search_options(max_length=length, min_length=length, batch_size=len(prompts), do_sample=False)
    started = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()
    first = time.perf_counter() - started
    while not generator.is_done():
        generator.generate_next_token()
    return first, time.perf_counter() - started


def measure(
    name: str, timer, tokenizer, text: str, batches: list[int], shapes: list[tuple[int, int]], repeats: int
) -> list[dict]:
    rows = []
    for input_len, output_len in shapes:
        for batch in batches:
            prompts = workload(tokenizer, text, batch, input_len)
            timer(prompts, 2)  # warm-up: first-call allocations and kernel selection
            with peak_rss() as rss:
                runs = [timer(prompts, output_len) for _ in range(repeats)]
            ttft = statistics.median(first for first, _ in runs)
            total = statistics.median(t for _, t in runs)
            rows.append(
                {
                    "engine": name,
                    "batch": batch,
                    "input_len": input_len,
                    "output_len": output_len,
                    "ttft_ms": round(ttft * 1000, 1),
                    "decode_tok_s_per_seq": round((output_len - 1) / max(1e-9, total - ttft), 1),
                    "total_tok_s": round(batch * output_len / total, 1),
                    "peak_rss_mib": round(rss["mib"]),
                    "raw_s": [[round(f, 4), round(t, 4)] for f, t in runs],
                }
            )
    return rows


def run_offline(
    engine_dir: Path,
    hf_dir: Path,
    text: str,
    batches: list[int],
    shapes: list[tuple[int, int]],
    repeats: int,
    threads: int,
    genai_dir: Path | None = None,
    thread_spinning: tuple[bool, ...] = (False,),
    log=print,
    runtime=None,
) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.targets import load_runner

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    log(f"transformers fp32 ({hf_dir})")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    peers = measure(
        "transformers fp32", lambda p, n: time_transformers(model, p, n), tokenizer, text, batches, shapes, repeats
    )
    model = None  # free it (a lambda above holds the name)
    gc.collect()
    genai = []
    if genai_dir is not None:
        import onnxruntime_genai as og

        log(f"onnxruntime-genai ({genai_dir})")
        genai_model = og.Model(str(genai_dir))
        genai = measure(
            f"onnxruntime-genai ({genai_dir.name})",
            lambda p, n: time_genai(genai_model, p, n),
            tokenizer,
            text,
            batches,
            shapes,
            repeats,
        )
        del genai_model
        gc.collect()
    ours = []
    for spinning in thread_spinning:
        runner = load_runner(engine_dir, threads, runtime=runtime, thread_spinning=spinning)
        notes = (", spinning threads" if spinning else "") + (", ngram speculation" if runner.speculative else "")
        name = f"ours ({engine_dir.parent.name}{notes})"
        log(name)
        ours += measure(name, lambda p, n: time_runner(runner, p, n), tokenizer, text, batches, shapes, repeats)
        runner = None  # free it before the next load
        gc.collect()
    for peer_rows, key in ((peers, "ratio_vs_transformers"), (genai, "ratio_vs_genai")):
        by_point = {(r["batch"], r["input_len"], r["output_len"]): r for r in peer_rows}
        for row in ours if by_point else []:
            peer = by_point[(row["batch"], row["input_len"], row["output_len"])]
            row[key] = round(row["total_tok_s"] / peer["total_tok_s"], 2)
            row[key.replace("ratio", "decode_ratio")] = round(
                row["decode_tok_s_per_seq"] / peer["decode_tok_s_per_seq"], 2
            )
    return peers + genai + ours
