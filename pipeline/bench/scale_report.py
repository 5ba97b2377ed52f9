"""`bench scale`'s report: the table of every stage measured beside the plan's prediction, each phase against the
issue's bound for what it does, the build's CPU time per billion parameters and how linear it is, the served check,
what the plan says of Llama 3.1 8B and 70B, and the plot of peak bytes per parameter (`summary.md`, `results.json`,
`bytes_per_parameter.png`)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.bench.scale import GIB, RELAXED_GATE, REPO, SAMPLE_SECONDS, SERVE_ARGS, SIZES, STARTING, TARGETS

# Llama 3.1's shapes, planned from config.json alone: what the measured table says an 8B and a 70B need. Source:
# meta-llama/llama-models models/sku_list.py @ 5309637ceedec731719b742d9a44176a8e96b494 (`arch_args` of Llama 3.1 8b
# and 70b: dim, n_layers, n_heads, n_kv_heads, vocab_size, rope_theta, norm_eps); the intermediate size follows its
# feed-forward rounding (2/3 of 4 x dim, times ffn_dim_multiplier, up to a multiple_of: tests/test_bench_scale.py).
LLAMA_31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# The shipped configs an 8B and a 70B are built with on trtllm (the FP8 one for SmolLM2 names an L4, too small).
EXTRAPOLATION_CONFIGS = {
    ("8b", "trtllm"): Path("build_configs/llama-3.1-8b-fp8-h100.yaml"),
    ("70b", "trtllm"): Path("build_configs/llama-3.1-70b-fp8-tp4.yaml"),
}
LLAMA_31_SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


CONVERT_LIMIT = (0.5, 1.5 * GIB)  # bytes per parameter, and beyond: the bound on a part that converts
MODEL_LIMIT = (4.0, 1.5 * GIB)  # ... and on a part that runs a (float32) model


COLUMNS = (
    "size|params B|target|stage|wall s|CPU s|peak anon RSS GiB|ru_maxrss GiB|B/param (peak anon)|disk GiB|"
    "predicted GiB|predicted / measured|predicted disk GiB"
)


def table(results: list[dict]) -> str:
    """One row per size x target x stage that ran; the gate's share of its stage below."""
    from pipeline.bench.report import markdown_table

    gib = lambda value: None if value is None else f"{value / GIB:.2f}"  # noqa: E731
    rows, gates = [], []
    for r in results:
        for s in r["stages"]:
            if s["status"] == "skipped":
                continue
            if s["status"] != "ok":
                rows.append([r["size"], f"{r['parameters'] / 1e9:.3g}", r["target"], s["stage"], s["reason"]])
                continue
            guess = s.get("predicted") or {}
            host = guess.get("host_bytes")
            rows.append(
                [
                    r["size"],
                    f"{r['parameters'] / 1e9:.3g}",
                    r["target"],
                    s["stage"],
                    f"{s['wall_s']:.1f}",
                    f"{s['cpu_s']:.1f}",
                    gib(s["peak_anon_bytes"]),
                    gib(s["ru_maxrss_bytes"]),
                    f"{s['peak_anon_bytes'] / r['parameters']:.2f}",
                    gib(s["disk_bytes"]),
                    gib(host) or "-",
                    f"{host / s['peak_anon_bytes']:.2f}" if host and s["peak_anon_bytes"] else "-",
                    gib(guess.get("disk_bytes")) or "-",
                ]
            )
            if s.get("gate_s") is not None:
                share = s["gate_s"] / s["wall_s"] if s["wall_s"] else 0.0
                gates.append(
                    f"- {r['size']} {r['target']}: the quality gate took {s['gate_s']:.0f} s of the "
                    f"{s['stage']} stage's {s['wall_s']:.0f} s ({share:.0%})"
                )
    text = markdown_table(COLUMNS.split("|"), rows)
    return text + (
        "\n\nThe quality gate's share of its stage (wall time from its first log line):\n\n" + "\n".join(gates)
        if gates
        else ""
    )


def full_depth(size: str) -> bool:
    return size in SIZES and SIZES[size].full_depth


def limit_bytes(parameters: int, runs_model: bool) -> int:
    """The issue's bound on a part of a stage: 0.5 B/param + 1.5 GiB where it converts, 4 + 1.5 GiB where it runs."""
    per_param, beyond = MODEL_LIMIT if runs_model else CONVERT_LIMIT
    return int(per_param * parameters + beyond)


def phase_table(results: list[dict]) -> str:
    """Each phase's peak against the issue's bound for what it does (converting, or running a model)."""
    from pipeline.bench.report import markdown_table

    rows = []
    for r in results:
        for s in r["stages"]:
            for phase in s.get("phases", []) if s["status"] == "ok" else []:
                if phase["phase"] == STARTING or not phase["peak_anon_bytes"]:
                    continue
                limit = limit_bytes(r["parameters"], phase["runs_model"])
                rows.append(
                    [
                        r["size"],
                        r["target"],
                        s["stage"],
                        phase["phase"],
                        "runs a model" if phase["runs_model"] else "converts",
                        f"{phase['seconds']:.0f}",
                        f"{phase['peak_anon_bytes'] / GIB:.2f}",
                        f"{phase['peak_anon_bytes'] / r['parameters']:.2f}",
                        f"{limit / GIB:.2f}",
                        "yes" if phase["peak_anon_bytes"] <= limit else "**no**",
                    ]
                )
    columns = "size|target|stage|phase|does|wall s|peak anon GiB|B/param|bound GiB|within".split("|")
    return markdown_table(columns, rows)


def build_totals(results: list[dict]) -> tuple[str, list[str]]:
    """Per size x target: the build's CPU-seconds (and per billion parameters), the gate's share of its wall time
    and ModelOpt's calibration; then, per target, how linear CPU-seconds are in parameters over the full-depth
    sizes (the per-billion spread, and the least-squares line through them)."""
    from pipeline.bench.report import markdown_table

    rows, per_target = [], {}
    for r in results:
        ran = [s for s in r["stages"] if s["status"] == "ok" and s["stage"] != "serve"]
        if not ran or r["status"] != "ok":
            continue
        cpu, wall = sum(s["cpu_s"] for s in ran), sum(s["wall_s"] for s in ran)
        gate = sum(s["gate_s"] or 0 for s in ran)
        billions = r["parameters"] / 1e9
        calibration = [
            p["seconds"]
            for s in ran
            if s["stage"] == "quantize"
            for p in s.get("phases", [])
            if p["phase"] == "calibration"
        ]
        quantize_cpu = next((s["cpu_s"] for s in ran if s["stage"] == "quantize"), None)
        rows.append(
            [
                r["size"],
                r["target"],
                f"{cpu:.0f}",
                f"{cpu / billions:.0f}",
                f"{gate:.0f} of {wall:.0f} ({gate / wall:.0%})" if wall else "-",
                f"{sum(calibration):.0f} s wall ({sum(calibration) / billions:.0f} per B), the stage "
                f"{quantize_cpu:.0f} CPU-s ({quantize_cpu / billions:.0f} per B), {r['trtllm_calibration_samples']} x "
                f"{r.get('trtllm_calibration_seq_len') or '?'} tokens"
                if calibration and quantize_cpu
                else "-",
            ]
        )
        if full_depth(r["size"]):
            per_target.setdefault(r["target"], []).append((billions, cpu))
    lines = []
    for target, points in per_target.items():
        if len(points) < 2:
            continue
        per_b = [cpu / b for b, cpu in points]
        mean_b = sum(b for b, _ in points) / len(points)
        mean_cpu = sum(cpu for _, cpu in points) / len(points)
        slope = sum((b - mean_b) * (cpu - mean_cpu) for b, cpu in points) / sum((b - mean_b) ** 2 for b, _ in points)
        fixed = mean_cpu - slope * mean_b
        worst = max(abs(fixed + slope * b - cpu) / cpu for b, cpu in points)
        mean = sum(per_b) / len(per_b)
        within = all(abs(value / mean - 1) <= 0.25 for value in per_b)
        lines.append(
            f"- {target}, full-depth sizes: {', '.join(f'{value:.0f}' for value in per_b)} CPU-s per billion "
            f"parameters, each within {max(abs(value / mean - 1) for value in per_b):.0%} of their mean "
            f"({'within' if within else 'outside'} +-25%); least squares: {fixed:.0f} CPU-s + {slope:.0f} per "
            f"billion, every size within {worst:.0%} of that line"
        )
    columns = "size|target|CPU s|CPU s per B|quality gate, s of the build's wall s|trtllm calibration".split("|")
    return markdown_table(columns, rows), lines


def extrapolated(out: Path, results: list[dict]) -> str:
    """What Llama 3.1 8B and 70B need at each target's largest stage: the plan's prediction on their config.json
    (float32 and bfloat16 references), beside a straight line through the measured full-depth peaks."""
    from pipeline.bench.report import markdown_table
    from pipeline.host_memory import checkpoint_shape, predict
    from pipeline.validation import load_config

    rows = []
    for name, shape in LLAMA_31_SHAPES.items():
        folder = out / "llama-3.1" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**LLAMA_31, **shape}))
        for target, build in TARGETS.items():
            measured = sorted(
                (r["parameters"], max(s["peak_anon_bytes"] for s in r["stages"] if s["status"] == "ok"))
                for r in results
                if r["target"] == target and r["status"] == "ok" and full_depth(r["size"])
            )
            peaks = {}
            for reference in ("float32", "bfloat16"):
                overrides = ["model.source=hf", f"model.path={folder.resolve()}", f"verify.reference_dtype={reference}"]
                cfg = load_config(REPO / EXTRAPOLATION_CONFIGS.get((name, target), build.config), overrides)
                stages = predict(cfg)
                peak_stage = max(stages, key=lambda n: stages[n].host_bytes)
                peaks[reference] = (peak_stage, stages[peak_stage].host_bytes)
            parameters = checkpoint_shape(cfg).parameters
            line = "-"
            if len(measured) >= 2:
                (p0, m0), (p1, m1) = measured[-2], measured[-1]
                line = f"{(m0 + (m1 - m0) / (p1 - p0) * (parameters - p0)) / GIB:.1f}"
            rows.append(
                [
                    f"Llama 3.1 {name.upper()} ({parameters / 1e9:.2f}B)",
                    target,
                    f"{peaks['float32'][1] / GIB:.1f} ({peaks['float32'][0]})",
                    f"{peaks['bfloat16'][1] / GIB:.1f} ({peaks['bfloat16'][0]})",
                    line,
                ]
            )
    columns = [
        "model",
        "target",
        "plan, float32 reference: GiB (stage)",
        "plan, bfloat16 reference: GiB (stage)",
        "line through the two largest measured peaks, GiB",
    ]
    return markdown_table(columns, rows)


def plot(results: list[dict], path: Path) -> None:
    """Peak anonymous bytes per parameter against parameters, a line per target and stage (predictions dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    lines: dict[tuple[str, str], list] = {}
    for r in results:
        for s in r["stages"]:
            if s["status"] == "ok":
                guess = (s.get("predicted") or {}).get("host_bytes")
                lines.setdefault((r["target"], s["stage"]), []).append(
                    (r["parameters"] / 1e9, s["peak_anon_bytes"] / r["parameters"], guess and guess / r["parameters"])
                )
    for (target, stage), points in lines.items():
        points.sort()
        drawn = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{target} {stage}")
        guessed = [(p[0], p[2]) for p in points if p[2]]
        if guessed:
            ax.plot(*zip(*guessed), "--", color=drawn[0].get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak anonymous RSS / parameter (bytes)")
    ax.set_title("peak host memory per parameter by stage (dashed: the plan's prediction)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(out: Path, results: list[dict]) -> Path:
    """summary.md, results.json (every result) and bytes_per_parameter.png in `out`; returns summary.md."""
    from pipeline.bench.report import machine_info, write_json

    out.mkdir(parents=True, exist_ok=True)
    samples = sorted({r["trtllm_calibration_samples"] for r in results if r.get("trtllm_calibration_samples")})
    tokenizers = " or ".join(sorted({r.get("tokenizer", "SmolLM2's") for r in results}))
    method = (
        "Each stage ran in its own process (`python -m pipeline.bench.scale STAGE CONFIG OUTPUT OVERRIDES`). Peak "
        "anon RSS: the RssAnon of that process and its children (/proc/PID/status), summed, sampled every "
        f"{SAMPLE_SECONDS * 1000:.0f} ms, the maximum kept; it includes the interpreter and its imports (torch, "
        "transformers). ru_maxrss: the kernel's VmHWM of the largest process of the stage, mapped files included. "
        "CPU s: user + system seconds from wait4. Disk: the bytes of OUTPUT/STAGE. Checkpoints: random bfloat16 "
        f"Llama weights with {tokenizers} tokenizer. "
        "The quality gate's thresholds were relaxed "
        f"({', '.join(f'{k} {v}' for k, v in RELAXED_GATE.items())}, where the config sets them): a random model's "
        "answers are noise. eval_tokens and the chat set are the configs' defaults."
    )
    if samples:
        method += f" trtllm calibration: {', '.join(map(str, samples))} samples of the config's sequence length."
    commits = sorted({r.get("commit", "unknown") for r in results})
    method += f" Measured at commit {', '.join(commits)}."
    totals, linearity = build_totals(results)
    served = [
        f"- {r['size']} {r['target']}: {s['answered']}; the server's process tree peaked at "
        f"{s['peak_anon_bytes'] / GIB:.2f} GiB anonymous RSS"
        for r in results
        for s in r["stages"]
        if s["stage"] == "serve" and s["status"] == "ok"
    ]
    sections = [
        f"# bench scale\n\n{method}\n\n{table(results)}",
        "## Each phase against its bound\n\nA phase starts at the log line that names it (`PHASES` in "
        "pipeline/bench/scale.py); its peak is the highest sample while it ran. The bound (issue #46): 0.5 B/param "
        "+ 1.5 GiB for a part that only converts and writes weights, 4 B/param (one float32 copy) + 1.5 GiB for a "
        f"part that runs a model.\n\n{phase_table(results)}",
        "## The build's CPU time\n\n" + totals + ("\n\n" + "\n".join(linearity) if linearity else ""),
    ]
    if served:
        sections.append(
            "## Served\n\nEach built repository, served by tritonserver with our OpenAI gateway "
            f"(`bench serve {' '.join(SERVE_ARGS)}`):\n\n" + "\n".join(served)
        )
    if results:
        sections.append(
            "## An 8B and a 70B\n\nThe memory plan (`pipeline/host_memory.py`) on Llama 3.1's config.json, at "
            "each build's largest stage (onnxruntime: the default config; trtllm: "
            f"{' and '.join(str(c) for c in EXTRAPOLATION_CONFIGS.values())}), and a straight line through the two "
            "largest measured full-depth peaks (49,152-token vocabulary: it misses a 128K vocabulary's logits).\n\n"
            f"{extrapolated(out, results)}"
        )
    summary = out / "summary.md"
    summary.write_text("\n\n".join(sections) + "\n")
    write_json(out / "results.json", {"kind": "scale", "machine": machine_info(), "results": results})
    if results:
        plot(results, out / "bytes_per_parameter.png")
    return summary
