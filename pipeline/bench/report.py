"""Bench reports: results.json (machine, config, engine build info, every raw sample), summary.md, PNG plots,
and `bench compare` of two results side by side with ratios."""

from __future__ import annotations

import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path


def machine_info() -> dict:
    import psutil

    packages = {}
    for name in ("onnxruntime", "torch", "transformers", "tritonclient", "nvidia-modelopt"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "packages": packages,
    }


def build_info(output: Path) -> dict:
    """The build's manifest entries (config values read, tool versions, output hashes) for the engine and repository."""
    lock = output / "build.lock.json"
    if not lock.is_file():
        return {}
    stages = json.loads(lock.read_text()).get("stages", {})
    return {
        name: {k: v for k, v in entry.items() if k in ("input_hash", "tools", "metrics", "params")}
        for name, entry in stages.items()
        if name in ("engine", "triton_repo")
    }


def results_dir(root: Path, kind: str) -> Path:
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"
    path.mkdir(parents=True, exist_ok=True)
    latest = root / f"latest-{kind}"
    tmp = root / f".latest-{kind}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    os.replace(tmp, latest)
    return path


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def serve_table(levels: list[dict]) -> str:
    """One row per workload and load level; throughput ratios are to the workload's first level, and the server-side
    columns read n/a where the server does not export the counters."""
    firsts: dict[str, float] = {}
    rows = []
    for lv in levels:
        s, workload = lv["summary"], lv.get("workload", "synthetic")
        base = firsts.setdefault(workload, s["output_token_throughput"] or 1.0)
        server = lv.get("server", {})
        na = lambda key: "n/a" if server.get(key) is None else server[key]  # noqa: E731
        rows.append(
            [
                workload,
                lv["label"],
                s["requests"],
                s["errors"],
                s["request_throughput"],
                s["output_token_throughput"],
                f"{s['output_token_throughput'] / base:.2f}x",
                s["ttft_ms"]["p50"],
                s["ttft_ms"]["p99"],
                s["itl_ms"]["p50"],
                s["itl_ms"]["p99"],
                s["e2e_ms"]["p50"],
                s["e2e_ms"]["p90"],
                s["goodput"],
                na("prefix_cache_hit_rate"),
                na("prefix_reused_tokens"),
                na("draft_acceptance"),
            ]
        )
    return markdown_table(
        [
            "workload",
            "load",
            "requests",
            "errors",
            "req/s",
            "output tok/s",
            "vs first load",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "E2E p50 ms",
            "E2E p90 ms",
            "goodput req/s",
            "prefix-cache hit rate",
            "reused tokens",
            "draft acceptance",
        ],
        rows,
    )


def cpu_table(levels: list[dict]) -> str:
    """Seconds of CPU per process over each level of a server `bench serve` started, busiest process first, and how
    busy they kept the cores; empty when no level was measured (a running server named by --grpc/--http)."""
    measured = [lv for lv in levels if lv.get("cpu")]
    totals: dict[str, float] = {}
    for lv in measured:
        for label, seconds in lv["cpu"]["seconds"].items():
            totals[label] = totals.get(label, 0.0) + seconds
    labels = sorted(totals, key=lambda label: -totals[label])
    rows = [
        [
            lv.get("workload", "synthetic"),
            lv["label"],
            *(lv["cpu"]["seconds"].get(label, 0.0) for label in labels),
            f"{lv['cpu']['busy']:.0%}",
        ]
        for lv in measured
    ]
    return (
        markdown_table(["workload", "load", *(f"{label} CPU s" for label in labels), "cores busy"], rows)
        if rows
        else ""
    )


def headline(summary: dict) -> dict:
    """The figures a serving comparison shows."""
    return {
        "output_tok_s": summary["output_token_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "itl_p99_ms": summary["itl_ms"]["p99"],
        "requests": summary["requests"],
        "errors": summary["errors"],
    }


def serve_versus(ours: list[dict], peer: list[dict]) -> list[dict]:
    """Per workload and load level both servers ran: their headline figures, and ours / the peer's output tokens/s
    (above 1: ours is faster) and TTFT p50 (below 1: ours answers first)."""
    theirs = {(lv.get("workload", "synthetic"), lv["label"]): lv["summary"] for lv in peer}
    ratio = lambda a, b: None if a is None or not b else round(a / b, 3)  # noqa: E731
    rows = []
    for lv in ours:
        key = (lv.get("workload", "synthetic"), lv["label"])
        if key not in theirs:
            continue
        mine, other = headline(lv["summary"]), headline(theirs[key])
        rows.append(
            {
                "workload": key[0],
                "load": key[1],
                "ours": mine,
                "peer": other,
                "output_tok_s_ratio": ratio(mine["output_tok_s"], other["output_tok_s"]),
                "ttft_p50_ratio": ratio(mine["ttft_p50_ms"], other["ttft_p50_ms"]),
            }
        )
    return rows


def serve_versus_table(rows: list[dict], peer: str) -> str:
    """Ours and the peer side by side per workload and load level, with our ratios; the requests each side sent
    (fewer where a level ran into its time limit) and how many failed."""
    x = lambda value: None if value is None else f"{value:.2f}x"  # noqa: E731
    return markdown_table(
        [
            "workload",
            "load",
            "output tok/s ours",
            peer,
            f"ours/{peer}",
            "TTFT p50 ms ours",
            peer,
            f"ours/{peer}",
            "TTFT p99 ms ours",
            peer,
            "ITL p50 ms ours",
            peer,
            "ITL p99 ms ours",
            peer,
            "requests (errors) ours",
            peer,
        ],
        [
            [
                r["workload"],
                r["load"],
                r["ours"]["output_tok_s"],
                r["peer"]["output_tok_s"],
                x(r["output_tok_s_ratio"]),
                r["ours"]["ttft_p50_ms"],
                r["peer"]["ttft_p50_ms"],
                x(r["ttft_p50_ratio"]),
                r["ours"]["ttft_p99_ms"],
                r["peer"]["ttft_p99_ms"],
                r["ours"]["itl_p50_ms"],
                r["peer"]["itl_p50_ms"],
                r["ours"]["itl_p99_ms"],
                r["peer"]["itl_p99_ms"],
                f"{r['ours']['requests']} ({r['ours']['errors']})",
                f"{r['peer']['requests']} ({r['peer']['errors']})",
            ]
            for r in rows
        ],
    )


def offline_table(
    rows: list[dict], ratios: list[dict], quality: list[dict], skipped: dict[str, str], pairs: list[dict] = ()
) -> str:
    """The engines' speed, our ratios to each peer, our decode against llama.cpp's own tools round by round, their
    quality side by side and the peers that did not run."""
    speed = markdown_table(
        [
            "engine",
            "batch",
            "in/out",
            "TTFT ms",
            "prefill tok/s",
            "decode tok/s/seq",
            "decode tok/s (all rows)",
            "total tok/s",
            "peak RSS MiB",
            "model MiB",
        ],
        [
            [
                r["engine"],
                r["batch"],
                f"{r['input_len']}/{r['output_len']}",
                r["ttft_ms"],
                r["prefill_tok_s"],
                r["decode_tok_s_per_seq"],
                r["decode_tok_s_total"],
                r["total_tok_s"],
                r["peak_rss_mib"],
                r["model_mib"],
            ]
            for r in rows
        ],
    )
    versus = markdown_table(
        ["ours", "vs peer", "batch", "prefill", "decode per seq", "total"],
        [
            [
                r["ours"],
                r["peer"],
                r["batch"],
                f"{r['prefill_tok_s']}x",
                f"{r['decode_tok_s_per_seq']}x",
                f"{r['total_tok_s']}x",
            ]
            for r in ratios
        ],
    )
    parts = [speed, "Ours / peer, same points (above 1: ours is faster):\n\n" + versus]
    if pairs:
        parts.append(
            "Decode per sequence, ours / llama.cpp timed by its own tools, each round a pair run back to back:\n\n"
            + markdown_table(
                ["ours", "vs", "batch", "in/out", "median", "min", "max", "pairs"],
                [
                    [
                        r["ours"],
                        r["peer"],
                        r["batch"],
                        f"{r['input_len']}/{r['output_len']}",
                        f"{r['median']}x",
                        f"{r['min']}x",
                        f"{r['max']}x",
                        " ".join(f"{x:.2f}" for x in r["pairs"]),
                    ]
                    for r in pairs
                ],
            )
        )
    if quality:
        parts.append(
            "Quality against the same fp32 reference (the quality gate's eval windows and chat set):\n\n"
            + markdown_table(
                [
                    "engine",
                    "KLD mean",
                    "KLD p99",
                    "top-1",
                    "perplexity",
                    "chat KLD",
                    "chat top-1",
                    "chat answer = fp32",
                ],
                [
                    [
                        q["engine"],
                        f"{q['kl_divergence']:.4f}",
                        f"{q['kl_divergence_p99']:.4f}",
                        f"{q['top1_agreement']:.1%}",
                        f"{q['perplexity_increase']:+.1%}",
                        None if q.get("chat_kl_divergence") is None else f"{q['chat_kl_divergence']:.4f}",
                        percent(q.get("chat_top1_agreement")),
                        percent(q.get("chat_answer_match")),
                    ]
                    for q in quality
                ],
            )
        )
    if skipped:
        parts.append("Not measured:\n\n" + "\n".join(f"- {name}: {why}" for name, why in skipped.items()))
    return "\n\n".join(parts)


def percent(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"


def profile_table(results: dict) -> str:
    """The step split per batch size, guided decoding's step, then the machine's rates and the ceilings they put on
    tokens/s."""
    steps = markdown_table(
        [
            "batch",
            "prefill ms",
            "decode step ms",
            "kernels ms",
            "ONNX Runtime around them ms",
            "Python ms",
            "top kernels (ms per step)",
        ],
        [
            [
                s["batch"],
                s["prefill_ms"],
                s["decode_step_ms"],
                s["decode_kernels_ms"],
                s["decode_ort_around_kernels_ms"],
                s["decode_python_ms"],
                ", ".join(f"{op} {ms}" for op, ms in list(s["decode_kernels_by_op_ms"].items())[:3]),
            ]
            for s in results["steps"]
        ],
    )
    guided = markdown_table(
        ["batch", "decode step ms", "with a JSON schema on every row ms", "slower"],
        [[g["batch"], g["plain_step_ms"], g["guided_step_ms"], f"{g['slower']:.1%}"] for g in results["guided"]],
    )
    rates, facts, ceiling = results["machine"], results["weights"], results["ceilings"]
    lines = [
        f"- memory read bandwidth {rates['read_gb_s']} GB/s, fp32 matrix products {rates['sgemm_gflop_s']} GFLOP/s "
        f"({results['threads']} threads)",
        f"- a decode token reads {facts['decode_bytes_per_token'] / 1e6:.1f} MB of weights: at most "
        f"{ceiling['decode_batch1_tok_s']} tok/s at batch 1",
        f"- a prefill token costs {facts['prefill_flops_per_token'] / 1e6:.0f} MFLOP in matrix products: at most "
        f"{ceiling['prefill_tok_s_at_sgemm_rate']} tok/s at the fp32 rate",
    ]
    guided = (
        f"\n\nGuided decoding (`pipeline.targets.onnxruntime.runtime.guided`):\n\n{guided}" if results["guided"] else ""
    )
    return steps + guided + "\n\n" + "\n".join(lines)


def plot_serve(levels: list[dict], path: Path, peer_levels: list[dict] = (), peer: str = "") -> None:
    """TTFT p50 and ITL p50 against output tokens/s, a line per workload through its load levels; with a peer's
    levels, its lines dashed beside ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sides = [("ours, " if peer_levels else "", levels, "-")] + (
        [(f"{peer}, ", peer_levels, "--")] if peer_levels else []
    )
    for prefix, side, style in sides:
        for workload in dict.fromkeys(lv.get("workload", "synthetic") for lv in side):
            for ax, key in ((axes[0], "ttft_ms"), (axes[1], "itl_ms")):
                points = [
                    (lv["label"], lv["summary"]["output_token_throughput"], lv["summary"][key]["p50"])
                    for lv in side
                    if lv.get("workload", "synthetic") == workload and lv["summary"][key]["p50"] is not None
                ]  # a level whose requests all failed has no latency
                xs, ys = [x for _, x, _ in points], [y for _, _, y in points]
                ax.plot(xs, ys, style, marker="o", label=prefix + workload)
                for label, x, y in points:
                    ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for ax, name in ((axes[0], "TTFT p50 (ms)"), (axes[1], "ITL p50 (ms)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    versus = f" (ours and {peer})" if peer_levels else ""
    fig.suptitle(f"serving: throughput vs latency per workload and load level{versus}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offline(rows: list[dict], quality: list[dict], path: Path) -> None:
    """Left: total tokens/s per batch size for every engine. Right, when quality was scored: KL divergence vs fp32
    against batch-1 decode speed, one point per engine and precision (down and right is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if quality else 1, figsize=(13 if quality else 7, 5), squeeze=False)
    ax = axes[0][0]
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        ax.plot([r["batch"] for r in mine], [r["total_tok_s"] for r in mine], marker="o", label=engine)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("tokens/s per batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if quality:
        ax = axes[0][1]
        kld = {q["engine"]: q["kl_divergence"] for q in quality}
        batch1 = [r for r in rows if r["batch"] == min(x["batch"] for x in rows)]
        for r in batch1:
            value = kld.get(r["engine"]) or next((v for k, v in kld.items() if r["engine"].startswith(k)), None)
            if value is None or value <= 0:
                continue
            ax.scatter(r["decode_tok_s_per_seq"], value)
            ax.annotate(
                r["engine"], (r["decode_tok_s_per_seq"], value), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
        ax.set_yscale("log")
        ax.set_xlabel(f"decode tokens/s per sequence, batch {batch1[0]['batch']}")
        ax.set_ylabel("KL divergence vs fp32 (nats, mean)")
        ax.set_title("quality against decode speed")
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(a: dict, b: dict) -> str:
    """Two results side by side: for every metric both have, A, B and B/A."""

    def flat(results: dict) -> dict[str, float]:
        out = {}
        if results["kind"] == "serve":
            for lv in results["levels"]:
                s = lv["summary"]
                workload = lv.get("workload", "synthetic")
                key = lv["label"] if workload == "synthetic" else f"{workload} {lv['label']}"
                out |= {
                    f"{key} output tok/s": s["output_token_throughput"],
                    f"{key} req/s": s["request_throughput"],
                    f"{key} TTFT p50 ms": s["ttft_ms"]["p50"],
                    f"{key} ITL p50 ms": s["itl_ms"]["p50"],
                    f"{key} ITL p99 ms": s["itl_ms"]["p99"],
                    f"{key} goodput": s["goodput"],
                } | {f"{key} {name}": value for name, value in lv.get("server", {}).items() if value is not None}
        else:
            for r in results["rows"]:
                role = (
                    "ours" if r["engine"].startswith("ours") else r["engine"]
                )  # our engine vs our engine across builds
                key = f"{role} b{r['batch']} {r['input_len']}/{r['output_len']}"
                out |= {
                    f"{key} total tok/s": r["total_tok_s"],
                    f"{key} TTFT ms": r["ttft_ms"],
                    f"{key} peak RSS MiB": r["peak_rss_mib"],
                }
        return out

    fa, fb = flat(a), flat(b)
    rows = [[k, fa[k], fb[k], None if not fa[k] or fb[k] is None else f"{fb[k] / fa[k]:.2f}x"] for k in fa if k in fb]
    return markdown_table(["metric", f"A ({a.get('name', 'A')})", f"B ({b.get('name', 'B')})", "B/A"], rows)


def write_report(root: Path, kind: str, title: str, results: dict, table: str, plot, plot_name: str) -> Path:
    """One run's folder: results.json (machine, build, raw samples), summary.md and a plot; returns the folder."""
    folder = results_dir(root, kind)
    write_json(folder / "results.json", {"kind": kind, "machine": machine_info(), **results})
    (folder / "summary.md").write_text(f"# {title}\n\n{table}\n")
    plot(folder / plot_name)
    return folder
