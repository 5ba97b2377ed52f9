"""What multi-LoRA costs the CPU engine: decode steps of the base engine (built without LoRA) against the LoRA engine
with 0, 1 and 4 distinct adapters in the batch, and the memory one resident adapter takes.

Adapters are random, at the engine's max_lora_rank on every module it carries LoRA on: a step's cost depends on the
slots bound and their width (every slot is max_lora_rank wide per part), not on what the weights hold. Rows take the
adapters in turn (row i: adapter i mod k). Engines and adapter counts alternate within every round, so drift on a
shared machine hits all alike; the report gives each case's median step and its median per-round ratio to the base.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError

ADAPTER_COUNTS = (0, 1, 4)


def random_adapter(slots, seed: int):
    """An Adapter at the engine's max_lora_rank on each module it carries LoRA on, small random weights."""
    from pipeline.peft_adapters import Adapter, module_shapes

    rng, rank = np.random.default_rng(seed), slots.spec.max_lora_rank
    weights = {
        (layer, module): (
            rng.normal(0, 0.01, (rank, fan_in)).astype(np.float32),
            rng.normal(0, 0.01, (fan_out, rank)).astype(np.float32),
        )
        for layer in range(slots.facts.num_hidden_layers)
        for module, (fan_in, fan_out) in module_shapes(slots.facts).items()
        if module in slots.spec.target_modules
    }
    return Adapter(Path(f"random-{seed}"), {"r": rank}, weights)


def lora_cost(
    base_engine: Path,
    lora_engine: Path,
    *,
    threads: int,
    batches: list[int],
    input_len: int,
    output_len: int,
    spinning: bool,
    rounds: int,
) -> dict:
    """Median decode step (ms) and tok/s per case, with each LoRA case's median per-round ratio to the base engine."""
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
    from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams

    base = ModelRunner.from_dir(base_engine, num_threads=threads, thread_spinning=spinning)
    lora = ModelRunner.from_dir(lora_engine, num_threads=threads, thread_spinning=spinning)
    if lora.lora is None:
        raise PipelineError(f"{lora_engine} was built without LoRA: give a config with a lora section")
    if base.lora is not None:
        raise PipelineError(f"{base_engine} was built with LoRA: the base must be the same model without it")
    if lora.lora.spec.max_loras < max(ADAPTER_COUNTS):
        raise PipelineError(f"the LoRA engine's max_loras is {lora.lora.spec.max_loras}; the benchmark binds 4")
    for seed in range(max(ADAPTER_COUNTS)):
        lora.lora.register(f"bench-{seed}", random_adapter(lora.lora, seed))

    def steps(runner: ModelRunner, batch: int, adapters: int) -> list[float]:
        prompts = [[(7 * row + i) % 1000 + 100 for i in range(input_len)] for row in range(batch)]
        requests = [Request(p, SamplingParams(max_new_tokens=output_len, end_id=-1)) for p in prompts]
        for row, request in enumerate(requests):
            request.adapter = f"bench-{row % adapters}" if adapters else None
        if runner.lora is not None:
            runner.lora.hold(requests)
        walls, last = [], time.perf_counter()
        try:
            for _ in runner.run(requests):
                now = time.perf_counter()
                walls.append(now - last)
                last = now
        finally:
            if runner.lora is not None:
                runner.lora.release(requests)
        return walls[1:]  # the first is the prefill

    cases = [(b, k) for b in batches for k in ("base", *ADAPTER_COUNTS) if k == "base" or k <= b]
    samples: dict = {case: [] for case in cases}
    ratios: dict = {case: [] for case in cases}
    for case in cases:  # warm-up: sessions, allocations, adapters copied into their slots
        steps(base if case[1] == "base" else lora, *(case[0], 0 if case[1] == "base" else case[1]))
    for _ in range(rounds):
        medians = {}
        for batch, k in cases:
            walls = steps(base, batch, 0) if k == "base" else steps(lora, batch, k)
            samples[batch, k] += walls
            medians[batch, k] = statistics.median(walls)
        for batch, k in cases:
            ratios[batch, k].append(medians[batch, k] / medians[batch, "base"])
    spec = lora.lora.spec
    return {
        "max_lora_rank": spec.max_lora_rank,
        "target_modules": spec.target_modules,
        "slot_bytes": lora.lora.slot_bytes(),
        "adapter_bytes": lora.lora.adapters["bench-0"].nbytes(),
        "cases": [
            {
                "batch": batch,
                "adapters": k,
                "step_ms": round(statistics.median(samples[batch, k]) * 1000, 3),
                "tok_s": round(batch / statistics.median(samples[batch, k]), 1),
                "vs_base": round(statistics.median(ratios[batch, k]), 3),
            }
            for batch, k in cases
        ],
    }


def table(results: dict) -> str:
    rows = [
        "| batch | adapters in the batch | decode step (ms) | tok/s | step vs base engine |",
        "|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        k = "none (base engine, no LoRA graph)" if case["adapters"] == "base" else case["adapters"]
        rows.append(f"| {case['batch']} | {k} | {case['step_ms']} | {case['tok_s']} | {case['vs_base']:.3f}x |")
    mib = 1 << 20
    rows.append("")
    modules = ", ".join(results["target_modules"])
    rows.append(
        f"Memory per resident adapter (a slot: rank {results['max_lora_rank']} on {modules}, float32): "
        f"{results['slot_bytes'] / mib:.1f} MiB; an adapter's own weights at that rank, kept on the host: "
        f"{results['adapter_bytes'] / mib:.1f} MiB."
    )
    return "\n".join(rows)
