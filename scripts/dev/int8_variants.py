"""The int8 engine's variants on the default build, side by side: how docs/targets.md#smoothquant chose its blocks.

Each variant is rounded from the default build's float graph (artifacts/smollm2-135m-cpu/export) as the engine stage
rounds it, then scored as the quality gate scores (KL divergence against the float graph on the gate's 2,048 tokens)
and timed at batch 1 (128-token prompt, 64 greedy tokens, 2 spinning threads), the variants interleaved in one
process, `--rounds` rounds, medians. Run `make build-engine` first; it writes nothing outside a temporary directory.

    .venv/bin/python scripts/dev/int8_variants.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "artifacts" / "smollm2-135m-cpu"
CONFIG = REPO / "build_configs" / "smollm2-135m-cpu.yaml"
COARSE = {"*.gate_up_proj": 128, "*.o_proj": 128}
VARIANTS = {  # name -> quantize_graph arguments (smoothquant: its alpha)
    "rtn, symmetric, blocks of 32 (the default before)": dict(group_size=32),
    "rtn, asymmetric, blocks of 32": dict(group_size=32, symmetric=False),
    "rtn, symmetric, blocks of 64": dict(group_size=64),
    "smoothquant 0.5, symmetric, blocks of 64": dict(group_size=64, smoothquant=0.5, symmetric=True),
    "smoothquant 0.5, symmetric, blocks of 128": dict(group_size=128, smoothquant=0.5, symmetric=True),
    "smoothquant 0.65, asymmetric, blocks of 64": dict(group_size=64, smoothquant=0.65, symmetric=False),
    "smoothquant 0.65, asymmetric, blocks of 128": dict(group_size=128, smoothquant=0.65, symmetric=False),
    "smoothquant 0.65, asymmetric, 64 with 128 for gate_up/o_proj (the default)": dict(
        group_size=64, smoothquant=0.65, symmetric=False, module_group_sizes=COARSE
    ),
    "same, qkv_proj at 128 too": dict(
        group_size=64, smoothquant=0.65, symmetric=False, module_group_sizes={**COARSE, "*.qkv_proj": 128}
    ),
}


def engines(work: Path, calibration_text: str, cfg) -> dict[str, Path]:
    """Each variant's engine directory: the default engine's files around the variant's graph."""
    from pipeline.targets.onnxruntime import ONNX_NAME
    from pipeline.targets.onnxruntime.quantize import quantize_graph
    from pipeline.targets.onnxruntime.smoothquant import measured

    export, import_dir = BUILD / "export", BUILD / "import"
    smoothings = {}
    built = {}
    for number, (name, arguments) in enumerate(VARIANTS.items()):
        arguments = dict(arguments)
        alpha = arguments.pop("smoothquant", None)
        if alpha is not None and alpha not in smoothings:
            smoothings[alpha] = measured(
                export / ONNX_NAME, import_dir, calibration_text, cfg.quantization.calibration, alpha, _quiet, work
            )
        directory = work / str(number)
        shutil.copytree(BUILD / "engine", directory, ignore=shutil.ignore_patterns("model.onnx*"))
        quantize_graph(
            export,
            directory,
            weights="int8",
            method="smoothquant" if alpha is not None else "rtn",
            smoothing=smoothings.get(alpha),
            **arguments,
        )
        built[name] = directory
        print(f"  built: {name}", file=sys.stderr)
    return built


def _quiet(items, description):
    return items


def divergence(engine: Path, windows, reference) -> tuple[float, float]:
    from pipeline.quality import kl_divergence
    from pipeline.targets.onnxruntime import ONNX_NAME
    from pipeline.targets.onnxruntime.scoring import ort_logits_fn

    logits = ort_logits_fn(engine / ONNX_NAME, 2)
    kl = np.concatenate(
        [kl_divergence(ref, logits(ids[None, :])[0, scored]) for (ids, scored), ref in zip(windows, reference)]
    )
    return float(kl.mean()), float(np.percentile(kl, 99))


def decode_speeds(built: dict[str, Path], rounds: int) -> dict[str, float]:
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    prompt = np.random.default_rng(0).integers(100, 40000, size=128).astype(np.int32)
    runners = {name: ModelRunner.from_dir(path, thread_spinning=True, num_threads=2) for name, path in built.items()}
    speeds: dict[str, list[float]] = {name: [] for name in built}
    for runner in runners.values():
        runner.generate([prompt], max_new_tokens=8, end_id=-1)
    for _ in range(rounds):
        for name, runner in runners.items():
            started = time.perf_counter()
            runner.generate([prompt], max_new_tokens=1, end_id=-1)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            runner.generate([prompt], max_new_tokens=65, end_id=-1)
            speeds[name].append(64 / (time.perf_counter() - started - prefill))
    return {name: statistics.median(values) for name, values in speeds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per variant (interleaved)")
    args = parser.parse_args()
    if not (BUILD / "export").is_dir():
        print(f"no build in {BUILD}: run `make build-engine` first", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    from pipeline.build import cache_dir
    from pipeline.fetch import load_text
    from pipeline.quality import WINDOW, special_prefix, text_windows
    from pipeline.targets.onnxruntime import ONNX_NAME
    from pipeline.targets.onnxruntime.scoring import ort_logits_fn
    from pipeline.validation import load_config

    cfg = load_config(CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(BUILD / "import")
    text = load_text(cfg.verify.eval_text, cfg.resolve_path("."), cache_dir(), print)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens], dtype=np.int64)
    windows = list(text_windows(ids, WINDOW, WINDOW, special_prefix(tokenizer)))
    float_logits = ort_logits_fn(BUILD / "export" / ONNX_NAME, 2)
    reference = [float_logits(w[None, :])[0, scored] for w, scored in windows]
    calibration = load_text(cfg.quantization.calibration.text, cfg.resolve_path("."), cache_dir(), print, True)
    with tempfile.TemporaryDirectory(dir=BUILD) as work:
        built = engines(Path(work), calibration, cfg)
        scores = {name: divergence(path, windows, reference) for name, path in built.items()}
        speeds = decode_speeds(built, args.rounds)
    baseline = speeds[next(iter(VARIANTS))]
    print("| int8 engine | KLD mean / p99 | batch-1 decode tok/s | vs the first |")
    print("|---|---|---:|---:|")
    for name in VARIANTS:
        mean, p99 = scores[name]
        print(f"| {name} | {mean:.4f} / {p99:.3f} | {speeds[name]:.1f} | {speeds[name] / baseline:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
