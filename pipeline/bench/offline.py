"""Offline benchmark: our built engine against its peers (transformers, and the engines `bench peers` built:
llama.cpp, OpenVINO GenAI, onnxruntime-genai) on the same token ids, greedy, fixed lengths (end of sequence
ignored), the same thread count.

Each engine runs in its own worker process (`pipeline.bench.peers`), all loaded at once and all but the one at work
stopped; per point every engine generates once per round in an order that rotates, so the machine's drifting load
falls on all alike, and medians of the rounds are reported, after one warm-up per engine. No engine keeps a prompt
cache across rounds: the prompts repeat, and each worker starts each run from an empty KV cache.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from pipeline.bench.peers import EngineSpec, PeerManifest
from pipeline.bench.peers.client import Worker, WorkerError, alone
from pipeline.bench.peers.native import NativeTimer, NativeToolError
from pipeline.errors import PipelineError


def workload(tokenizer, text: str, batch: int, input_len: int) -> list[list[int]]:
    """Prompts of exactly input_len real tokens, a different window of the text per row."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids * (input_len * (batch + 1) // len(ids) + 1)
    return [ids[row * input_len : (row + 1) * input_len] for row in range(batch)]


def our_engines(output: Path, config: Path, precision: str, spinning: tuple[bool, ...]) -> list[EngineSpec]:
    """Our engine (once per thread-spinning setting) and transformers' fp32 `generate` on the imported checkpoint."""
    ours = [
        EngineSpec(
            f"ours {precision}" + (", spinning threads" if spin else ""),
            "ours",
            precision,
            sys.executable,
            "pipeline.bench.peers.ours",
            str(output / "engine"),
            options={"spinning": "on" if spin else "off", "config": str(config)},
        )
        for spin in spinning
    ]
    reference = EngineSpec(
        "transformers fp32",
        "transformers",
        "fp32",
        sys.executable,
        "pipeline.bench.peers.transformers_fp32",
        str(output / "import"),
    )
    return [reference, *ours]


def peer_engines(output: Path, wanted: list[str] | None) -> tuple[list[EngineSpec], dict[str, str]]:
    """The built peers (those of the engines named in `wanted`, default all) and the ones that are not, with why."""
    manifest = PeerManifest.read(output)
    engines = [e for e in manifest.engines if not wanted or e.engine in wanted or e.name in wanted]
    return engines, dict(manifest.unavailable)


def start_workers(engines: list[EngineSpec], threads: int, log_dir: Path, skipped: dict, log) -> list[Worker]:
    workers = []
    for spec in engines:
        log(f"loading {spec.name} ({spec.model})")
        try:
            workers.append(Worker(spec, threads, log_dir))
        except WorkerError as exc:
            log(f"{spec.name}: not measured: {exc}")
            skipped[spec.name] = str(exc)
    return workers


def native_timers(output: Path, engines: list[EngineSpec], threads: int, log_dir: Path, skipped: dict, log) -> list:
    """llama.cpp's own tools on each of its GGUFs among `engines` (`pipeline.bench.peers.native`)."""
    tools = PeerManifest.read(output).tools
    timers = []
    for spec in (e for e in engines if e.engine == "llama.cpp"):
        try:
            timers.append(NativeTimer(spec, tools, threads, log_dir))
        except NativeToolError as exc:
            log(f"{spec.name} by its tools: not measured: {exc}")
            skipped[f"{spec.name} (its tools)"] = str(exc)
    return timers


def measure(workers: list[Worker], tokenizer, text: str, batches, shapes, repeats: int, log) -> list[dict]:
    rows = []
    for input_len, output_len in shapes:
        for batch in batches:
            prompts = workload(tokenizer, text, batch, input_len)
            log(f"batch {batch}, {input_len} tokens in, {output_len} out: {repeats} rounds of {len(workers)} engines")
            for worker in workers:
                with alone(worker, workers):
                    worker.warm_up(prompts)
                worker.peak_rss_mib = 0.0
            runs: dict[str, list[tuple[float, float]]] = {w.spec.name: [] for w in workers}
            for round_ in range(repeats):
                shift = round_ % len(workers)
                for worker in workers[shift:] + workers[:shift]:
                    with alone(worker, workers):
                        runs[worker.spec.name].append(worker.generate(prompts, output_len))
            for worker in workers:
                rows.append(point(worker, runs[worker.spec.name], batch, input_len, output_len))
    return rows


def decode_rates(row: dict) -> list[float]:
    """A row's decode tokens/s per sequence in each round, in round order."""
    return [(row["output_len"] - 1) / max(1e-9, total - first) for first, total in row["raw_s"]]


def decode_pairs(rows: list[dict]) -> list[dict]:
    """Ours / llama.cpp timed by its own tools, decode per sequence, round by round: the engines of one round ran
    minutes apart at most, so a pair sees the same machine, and a lead is real only when every pair holds it."""
    out = []
    for ours, peer in same_points(rows, lambda row: row["engine"].endswith("(its tools)")):
        pairs = [round(a / b, 3) for a, b in zip(decode_rates(ours), decode_rates(peer))]
        out.append(
            {
                **versus(ours, peer),
                "pairs": pairs,
                "median": round(statistics.median(pairs), 3),
                "min": min(pairs),
                "max": max(pairs),
            }
        )
    return out


def same_points(rows: list[dict], is_peer) -> list[tuple[dict, dict]]:
    """(ours, peer) rows measured at the same point (batch, input and output lengths), for each of ours and each
    row `is_peer` picks."""
    point_of = lambda row: (row["batch"], row["input_len"], row["output_len"])  # noqa: E731
    return [
        (ours, peer)
        for ours in rows
        if ours["kind"] == "ours"
        for peer in rows
        if is_peer(peer) and point_of(peer) == point_of(ours)
    ]


def versus(ours: dict, peer: dict) -> dict:
    """The names and the point of a comparison row."""
    return {"ours": ours["engine"], "peer": peer["engine"]} | {
        key: ours[key] for key in ("batch", "input_len", "output_len")
    }


def point(worker: Worker, runs: list[tuple[float, float]], batch: int, input_len: int, output_len: int) -> dict:
    ttft = statistics.median(first for first, _ in runs)
    total = statistics.median(t for _, t in runs)
    decode = (output_len - 1) / max(1e-9, total - ttft)
    return {
        "engine": worker.spec.name,
        "kind": worker.spec.engine,
        "precision": worker.spec.precision,
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": round(ttft * 1000, 1),
        "prefill_tok_s": round(batch * input_len / ttft, 1),
        "decode_tok_s_per_seq": round(decode, 1),
        "decode_tok_s_total": round(decode * batch, 1),
        "total_tok_s": round(batch * output_len / total, 1),
        "peak_rss_mib": round(worker.peak_rss_mib),
        "model_mib": round(worker.spec.model_bytes / 2**20, 1),
        "raw_s": [[round(f, 4), round(t, 4)] for f, t in runs],
    }


def ratios(rows: list[dict]) -> list[dict]:
    """Ours / each peer at every point: prefill tok/s, decode tok/s per sequence, total tok/s."""
    keys = ("prefill_tok_s", "decode_tok_s_per_seq", "total_tok_s")
    return [
        {**versus(ours, peer), **{key: round(ours[key] / peer[key], 2) for key in keys}}
        for ours, peer in same_points(rows, lambda row: row["kind"] != "ours")
    ]


def precision_label(cfg, with_method: bool) -> str:
    """'fp32', or the weights ('int8'), with how they were made ('int4 gptq') for engines of one model side by side."""
    q = cfg.quantization
    return "fp32" if q.weights == "none" else f"{q.weights} {q.method}" if with_method else str(q.weights)


def benchmark(
    config: Path,
    cfg,
    output: Path | None,
    others: list[tuple],
    *,
    batches: list[int],
    shapes: list[tuple[int, int]],
    repeats: int,
    threads: int | None,
    peers: list[str] | None,
    quality: bool,
    both_spinning: bool,
    out: Path,
    log,
) -> tuple[str, Path]:
    """`bench offline`: every engine measured, llama.cpp's GGUFs also by llama.cpp's tools, the engines scored
    (`quality`), and the report written; returns its table and folder. `others`: (config path, config) of builds of
    the same model measured beside ours."""
    from transformers import AutoTokenizer

    from pipeline.bench import report
    from pipeline.bench.engine_quality import score_engines
    from pipeline.build import cache_dir, default_output
    from pipeline.fetch import load_text
    from pipeline.targets.onnxruntime.runtime.model_runner import default_threads

    output = output or default_output(config)
    if not (output / "engine" / "config.json").is_file():
        raise PipelineError(f"no engine in {output / 'engine'}: build it first (trtllm-pipeline build {config})")
    text = load_text(cfg.verify.eval_text, cfg.resolve_path("."), cache_dir())
    spinning = (False, True) if both_spinning else (cfg.runtime.cpu_thread_spinning != "off",)
    peer_specs, skipped = peer_engines(output, peers)
    others = [(path, c, default_output(path)) for path, c in others]
    for path, _, other_output in others:
        if not (other_output / "engine" / "config.json").is_file():
            raise PipelineError(f"--with {path}: no engine in {other_output / 'engine'}: build it first")
    precision = precision_label(cfg, bool(others))
    labels = [precision]  # another build of the same weights and method is told apart by its config's name
    for path, c, _ in others:
        label = precision_label(c, True)
        labels.append(f"{label} ({path.stem})" if label in labels else label)
    engines = our_engines(output, config, precision, spinning) + peer_specs
    engines += [our_engines(o, path, label, spinning)[1] for (path, _, o), label in zip(others, labels[1:])]
    threads = threads or default_threads()
    log_dir = output / "peers" / "logs"
    workers = start_workers(engines, threads, log_dir, skipped, log)
    timers = native_timers(output, peer_specs, threads, log_dir, skipped, log)
    try:
        tokenizer = AutoTokenizer.from_pretrained(output / "import")
        rows = measure(workers + timers, tokenizer, text, batches, shapes, repeats, log)
        extra = [(f"ours {label}", c, o) for (_, c, o), label in zip(others, labels[1:])]
        scores = score_engines(cfg, output, f"ours {precision}", workers, cache_dir(), log, extra) if quality else []
    finally:
        for worker in workers:
            worker.close()
    versus, pairs = ratios(rows), decode_pairs(rows)
    table = report.offline_table(rows, versus, scores, skipped, pairs)
    results = {
        "name": config.stem,
        "build": report.build_info(output),
        "threads": threads,
        "engines": {w.spec.name: {"model": w.spec.model, "facts": w.facts} for w in workers + timers},
        "rows": rows,
        "ratios": versus,
        "decode_pairs": pairs,
        "quality": scores,
        "peers_skipped": skipped,
    }
    folder = report.write_report(
        out,
        "offline",
        f"offline benchmark: {config}",
        results,
        table,
        lambda path: report.plot_offline(rows, scores, path),
        "speed_and_quality.png",
    )
    return table, folder
