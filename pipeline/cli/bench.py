"""`trtllm-pipeline bench`: the benchmark sub-commands (offline, family-decode, serve, compare, scale), each writing a
report folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from pipeline.architectures import ARCHITECTURES
from pipeline.architectures import architecture as registered
from pipeline.bench.scale import SIZES as SCALE_SIZES
from pipeline.cli.common import ConfigArg, OutputOpt, console, load, reports_errors
from pipeline.errors import PipelineError

bench_app = typer.Typer(
    help="Benchmarks: peers (build llama.cpp, OpenVINO GenAI and onnxruntime-genai), offline (ours vs them), "
    "family-decode (fused graph per family), serve (load on Triton), compare, scale (every stage's memory and time "
    "at real model sizes).",
    no_args_is_help=True,
)
BenchOut = typer.Option(
    Path("bench_results"),
    "--out",
    help="Reports go to OUT/TIME-KIND/ (results.json, summary.md, plots where the kind has them); "
    "OUT/latest-KIND links the newest.",
)


@bench_app.command("peers")
@reports_errors
def bench_peers(
    config: Path = ConfigArg,
    output: Optional[Path] = OutputOpt,
    peer: Optional[list[str]] = typer.Option(
        None, "--peer", help="Peers to build (repeat): llama.cpp, openvino, onnxruntime-genai; default all."
    ),
):
    """Build the benchmark peers of a build from their own packages, each in its own environment under the cache:
    llama.cpp compiled from the llama-cpp-python sdist (about 10 minutes on 2 cores, once) with GGUFs of the
    imported checkpoint at F16, Q8_0 and Q4_K_M by its converter and quantizer; OpenVINO GenAI with
    `optimum-cli export openvino` int8 and int4 models; onnxruntime-genai's INT4 model by its builder. A peer that
    cannot be built is listed with the reason in OUTPUT/peers/manifest.json, and the others still are.

    Example: trtllm-pipeline bench peers build_configs/smollm2-135m-cpu.yaml --peer llama.cpp
    """
    from pipeline.bench.peers.build import build_peers
    from pipeline.build import cache_dir, default_output

    load(config, [])
    output = output or default_output(config)
    manifest = build_peers(
        output, cache_dir(), peer, log=lambda m: console.print(f"  {m}", highlight=False, markup=False)
    )
    for engine in manifest.engines:
        console.print(f"{engine.name}: {engine.model}", highlight=False, markup=False)
    for name, why in manifest.unavailable.items():
        console.print(f"{name}: not built: {why}", style="yellow", highlight=False, markup=False)
    console.print(f"peers: {manifest.path(output)}")


@bench_app.command("offline")
@reports_errors
def bench_offline(
    config: Path = ConfigArg,
    output: Optional[Path] = OutputOpt,
    batch: Optional[list[int]] = typer.Option(
        None, "--batch", help="Batch sizes to sweep (repeat the flag); default 1 and 8."
    ),
    shape: Optional[list[str]] = typer.Option(
        None, "--shape", help="INPUTxOUTPUT token lengths (repeat); default 128x64."
    ),
    repeats: int = typer.Option(3, help="Rounds per point (every engine once per round); medians are reported."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for every engine (default: all usable cores)."),
    peer: Optional[list[str]] = typer.Option(
        None,
        "--peer",
        help="Peers to measure (repeat): a peer (llama.cpp, openvino, onnxruntime-genai) or one model "
        '("llama.cpp Q8_0"); default every peer `bench peers` built.',
    ),
    quality: bool = typer.Option(
        True, help="Also score every engine's logits and greedy chat answers against the fp32 reference."
    ),
    also: Optional[list[Path]] = typer.Option(
        None,
        "--with",
        help="Another build config of the same model (repeat), e.g. another quantization: its built engine is "
        "measured and scored beside ours, labelled by weights and method.",
    ),
    both_spinning: bool = typer.Option(
        False,
        "--both-spinning",
        help="Measure our engine with sleeping and with spinning ONNX Runtime "
        "threads (default: as runtime.cpu_thread_spinning says; llama.cpp and onnxruntime-genai spin by default).",
    ),
    out: Path = BenchOut,
):
    """Our built engine against transformers and the peers `bench peers` built (llama.cpp, OpenVINO GenAI,
    onnxruntime-genai), each in its own process, on the same token ids and thread count, rounds interleaved: TTFT,
    prefill and decode tokens/s, total tokens/s, peak RSS, model size, our ratio to each peer, and (with
    --quality) each engine's KL divergence, top-1 agreement and chat-answer match against fp32.

    Example: trtllm-pipeline bench offline build_configs/smollm2-135m-cpu.yaml --batch 1 --batch 8 --shape 128x64

    Quantizations side by side: trtllm-pipeline bench offline build_configs/smollm2-135m-cpu-int4.yaml --with
    build_configs/smollm2-135m-cpu-int4-gptq.yaml --peer none
    """
    from pipeline.bench.offline import benchmark

    others = [(path, load(path, [])) for path in also or []]
    table, folder = benchmark(
        config,
        load(config, []),
        output,
        others,
        batches=batch or [1, 8],
        shapes=[tuple(int(x) for x in s.lower().split("x")) for s in (shape or ["128x64"])],
        repeats=repeats,
        threads=threads,
        peers=peer,
        quality=quality,
        both_spinning=both_spinning,
        out=out,
        log=lambda m: console.print(f"  {m}", highlight=False, markup=False),
    )
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("profile")
@reports_errors
def bench_profile(
    config: Path = ConfigArg,
    output: Optional[Path] = OutputOpt,
    batch: Optional[list[int]] = typer.Option(None, "--batch", help="Batch sizes (repeat); default 1 and 8."),
    shape: str = typer.Option("128x64", help="INPUTxOUTPUT token lengths."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all usable cores)."),
    spinning: bool = typer.Option(True, help="Spinning ONNX Runtime threads, as `bench offline` measures them."),
    guided: bool = typer.Option(True, help="Also time decode steps with a JSON schema guiding every row."),
    out: Path = BenchOut,
):
    """Where our engine's time goes and what this machine allows at most: each decode step split into ONNX
    Runtime's kernels (by operator), its work around them and Python; the prefill's time; what guided decoding adds
    to a step (a grammar on every row); the machine's memory bandwidth and matrix-product rate; and from them the
    ceilings a decode token (bytes read) and a prefill token (flops) put on tokens/s.

    Example: trtllm-pipeline bench profile build_configs/smollm2-135m-cpu.yaml --batch 1 --batch 8
    """
    from pipeline.bench import report
    from pipeline.bench.profile import ceilings, guided_cost, machine_rates, step_split, weight_facts
    from pipeline.build import default_output
    from pipeline.targets.onnxruntime.runtime.model_runner import ONNX_FILE, default_threads

    load(config, [])
    output = output or default_output(config)
    engine = output / "engine"
    if not (engine / "config.json").is_file():
        raise PipelineError(f"no engine in {engine}: build it first (trtllm-pipeline build {config})")
    try:
        input_len, output_len = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise typer.BadParameter(f"{shape!r} is not INPUTxOUTPUT, e.g. 128x64", param_hint="--shape") from None
    threads = threads or default_threads()
    console.print("  measuring the machine's memory bandwidth and matrix-product rate", highlight=False)
    rates = machine_rates(threads)
    facts = weight_facts(engine / ONNX_FILE)
    splits, guided_steps = [], []
    for size in batch or [1, 8]:
        console.print(f"  profiling batch {size}", highlight=False)
        splits.append(step_split(engine, threads, size, input_len, output_len, spinning))
        if guided:
            guided_steps.append(guided_cost(engine, threads, size, input_len, output_len, spinning))
    results = {"name": config.stem, "threads": threads, "machine": rates, "weights": facts, "steps": splits}
    results["guided"] = guided_steps
    results["ceilings"] = ceilings(rates, facts, input_len)
    table = report.profile_table(results)
    folder = report.write_report(out, "profile", f"profile: {config}", results, table, lambda path: None, "")
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("family-decode")
@reports_errors
def bench_family_decode(
    architecture: Optional[list[str]] = typer.Option(
        None, "--architecture", help="Families to compare with Llama (repeat); default every registered one."
    ),
    batch: Optional[list[int]] = typer.Option(None, "--batch", help="Batch sizes (repeat); default 1 and 4."),
    shape: str = typer.Option("128x32", help="INPUTxOUTPUT token lengths."),
    repeats: int = typer.Option(12, help="Rounds (every family once per round); medians are reported."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime threads (default: all usable cores)."),
    spinning: bool = typer.Option(
        False, help="Spinning ONNX Runtime threads: faster on idle cores, far slower when other work shares them."
    ),
    weights: str = typer.Option("int8", help="Engine weights: none (fp32), int8 (the default build's) or int4."),
    work: Path = typer.Option(
        Path("bench_results/family-decode-work"), help="Where the random checkpoints and engines are kept."
    ),
    out: Path = BenchOut,
):
    """Decode speed of the fused graph of every registered family as ratios to Llama of the same size:
    random SmolLM2-135M-sized checkpoints with each family's features, engines (int8 by default) driven
    through the ModelRunner, families interleaved in every round.

    Example: trtllm-pipeline bench family-decode --batch 1 --batch 4 --repeats 12
    """
    from pipeline.bench import report
    from pipeline.bench.family_decode import decode_speed_per_family, table
    from pipeline.targets.onnxruntime.runtime.model_runner import default_threads

    for name in architecture or []:
        registered(name)  # names the registered ones when unknown
    try:
        input_len, output_len = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise typer.BadParameter(f"{shape!r} is not INPUTxOUTPUT, e.g. 128x32", param_hint="--shape") from None
    rows = decode_speed_per_family(
        work,
        architecture or list(ARCHITECTURES),
        batch or [1, 4],
        input_len,
        output_len,
        repeats,
        threads or default_threads(),
        spinning,
        weights,
        log=lambda m: console.print(f"  {m}", highlight=False),
    )
    text = table(rows)
    folder = report.write_report(
        out, "family-decode", "fused graph decode speed per family", {"rows": rows}, text, lambda path: None, ""
    )
    console.print(text, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("serve")
@reports_errors
def bench_serve(
    source: Path = typer.Argument(
        ...,
        help="A build config or repository (a server is started on it), unless --grpc/--http points at a running one.",
        show_default=False,
    ),
    output: Optional[Path] = OutputOpt,
    grpc: Optional[str] = typer.Option(
        None, "--grpc", help="Use a running server's gRPC address, e.g. 127.0.0.1:8001."
    ),
    http: Optional[str] = typer.Option(
        None,
        "--http",
        help="Use a running server's HTTP base URL: tritonserver's (protocol http) or an OpenAI server's "
        "(protocol openai), e.g. http://127.0.0.1:9000/v1.",
    ),
    metrics: Optional[str] = typer.Option(
        None,
        "--metrics",
        help="A running server's Prometheus metrics URL, e.g. http://127.0.0.1:8002/metrics, for the server-side "
        "columns (prefix-cache hit rate, reused tokens, draft acceptance); a started server's is read by default.",
    ),
    protocol: str = typer.Option(
        "grpc",
        help="grpc (streaming), http (/generate_stream SSE) or openai (/v1/completions SSE through our OpenAI "
        "gateway, started for the run as `serve --openai` starts it).",
    ),
    model: str = typer.Option("ensemble", help="ensemble or tensorrt_llm_bls (grpc, http; the gateway calls the BLS)."),
    peer: Optional[str] = typer.Option(
        None,
        "--peer",
        help="llama-server: after our server, measure llama.cpp's server on the same prompts and levels over the same "
        "OpenAI API (needs --protocol openai and `trtllm-pipeline bench peers CONFIG`): the Q8_0 GGUF of the same "
        "checkpoint, --parallel = our max_batch_size, our thread count, its prompt cache not reused. A peer that "
        "cannot run is reported with the reason; ours still is.",
    ),
    concurrency: Optional[list[int]] = typer.Option(
        None, "--concurrency", help="Closed-loop client counts to sweep (repeat); default 1, 4, 16."
    ),
    rate: Optional[list[float]] = typer.Option(
        None, "--rate", help="Poisson request rates (req/s) to sweep instead of concurrency (repeat)."
    ),
    workload: Optional[list[str]] = typer.Option(
        None,
        "--workload",
        help="Prompts (repeat for several; default synthetic): synthetic = raw cuts of the eval text; shared-prefix = "
        "chats under one long system prompt with short different questions (prefix caching); grounded = chats "
        "asking to summarise, extract or quote from a given passage (prompt-lookup speculation). Seeded.",
    ),
    requests: int = typer.Option(32, help="Requests per load level."),
    input_len: int = typer.Option(128, help="synthetic: mean prompt length in tokens (cut from the eval text)."),
    input_spread: float = typer.Option(0.25, help="synthetic: prompt lengths vary uniformly by +-this fraction."),
    prefix_len: int = typer.Option(
        900,
        help="shared-prefix: tokens of the shared system prompt (a short policy, then the eval text); with the "
        "question, prompts stay under the default build's max_input_len 1024.",
    ),
    system_prompt_file: Optional[Path] = typer.Option(
        None, help="shared-prefix: a text file to use as the shared system prompt instead."
    ),
    passage_len: int = typer.Option(300, help="grounded: tokens of the eval text in each request's passage."),
    output_len: int = typer.Option(64, help="max_tokens per request."),
    ignore_eos: bool = typer.Option(
        True, help="Generate exactly output_len tokens (end_id -1: never end), so levels compare equal work."
    ),
    prompts_file: Optional[Path] = typer.Option(
        None, help="Prompts instead of a workload's (.txt lines or .jsonl {prompt}); reported as workload 'file'."
    ),
    slo_ttft_ms: float = typer.Option(2000, help="Goodput objective: time to first token."),
    slo_itl_ms: float = typer.Option(250, help="Goodput objective: mean inter-token latency."),
    time_limit: float = typer.Option(300, help="Seconds per level at most."),
    out: Path = BenchOut,
):
    """Load a served repository: per workload, a concurrency sweep (or Poisson rates) of streaming requests, with
    TTFT, inter-token and end-to-end latency percentiles, request and token throughput, errors, goodput, and the
    server's prefix-cache hit rate, reused tokens and draft acceptance over each level (n/a when not exported). A
    server it starts also gets the CPU seconds of each of its processes (tritonserver, every model), of the
    benchmark process (the OpenAI gateway) and of the load generator (a process of its own) per level. With --peer
    llama-server, llama-server then gets the same load and both are reported side by side, with our ratios.

    Example: trtllm-pipeline bench serve build_configs/smollm2-135m-cpu.yaml --protocol openai --peer llama-server
    --concurrency 1 --concurrency 8 --concurrency 16 --requests 16 --output-len 64
    """
    from pipeline.bench import report
    from pipeline.bench.serve import LoadSettings, benchmark_serving

    settings = LoadSettings(
        protocol=protocol,
        model=model,
        requests=requests,
        input_len=input_len,
        input_spread=input_spread,
        prefix_len=prefix_len,
        system_prompt_file=system_prompt_file,
        passage_len=passage_len,
        output_len=output_len,
        ignore_eos=ignore_eos,
    )
    results = benchmark_serving(
        source,
        output,
        settings,
        workloads=workload or [],
        prompts_file=prompts_file,
        loads=rate or concurrency or [1, 4, 16],
        by_rate=bool(rate),
        grpc=grpc,
        http=http,
        metrics=metrics,
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        time_limit_s=time_limit,
        peer=peer,
        log=lambda m: console.print(f"  {m}", highlight=False),
        server_log=lambda m: console.print(f"[dim]{m}[/]"),
    )
    levels, other = results["levels"], results.get("peer", {})
    table = report.serve_table(levels)
    if cpu := report.cpu_table(levels):
        table += (
            "\n\nCPU seconds per process over each level (cores busy: their sum over the level's duration times the "
            f"usable cores):\n\n{cpu}"
        )
    if results.get("versus"):
        table += (
            f"\n\nOurs (through our OpenAI gateway) and {peer}, the same prompts and load, one server after the "
            f"other; {peer} read all {other['prompts_token_identical']} prompts as our token ids:\n\n"
            + report.serve_versus_table(results["versus"], peer)
        )
    if "unavailable" in other:
        table += f"\n\nNot measured:\n\n- {peer}: {other['unavailable']}"
    folder = report.write_report(
        out,
        "serve",
        f"serving benchmark: {source}",
        results,
        table,
        lambda path: report.plot_serve(levels, path, other.get("levels", []), peer or ""),
        "throughput_vs_latency.png",
    )
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("compare")
@reports_errors
def bench_compare(
    a: Path = typer.Argument(..., help="results.json of run A (or its folder)."),
    b: Path = typer.Argument(..., help="results.json of run B (or its folder)."),
):
    """Two benchmark runs side by side (two quantizations, two configs), with B/A ratios.

    Example: trtllm-pipeline bench compare bench_results/int8/results.json bench_results/fp32/results.json
    """
    from pipeline.bench.report import compare

    def read(path: Path) -> dict:
        path = path / "results.json" if path.is_dir() else path
        if not path.is_file():
            raise PipelineError(f"{path} not found: pass a bench results.json or its folder")
        return json.loads(path.read_text())

    first, second = read(a), read(b)
    if first["kind"] != second["kind"]:
        raise PipelineError(f"cannot compare a {first['kind']} run with a {second['kind']} run")
    console.print(compare(first, second), highlight=False, soft_wrap=True)


@bench_app.command("lora")
@reports_errors
def bench_lora(
    config: Path = ConfigArg,
    output: Optional[Path] = OutputOpt,
    base: Path = typer.Option(
        Path("build_configs/smollm2-135m-cpu.yaml"), help="The same model's build without LoRA (built first)."
    ),
    batch: Optional[list[int]] = typer.Option(None, "--batch", help="Batch sizes (repeat); default 1 and 8."),
    shape: str = typer.Option("128x32", help="INPUTxOUTPUT token lengths."),
    rounds: int = typer.Option(5, help="Rounds (every case once per round); medians are reported."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: all usable cores)."),
    spinning: bool = typer.Option(True, help="Spinning ONNX Runtime threads, as `bench offline` measures them."),
    out: Path = BenchOut,
):
    """What multi-LoRA costs a decode step: the engine of CONFIG (built with a lora section) with 0, 1 and 4
    distinct adapters in the batch (random, at its max_lora_rank) against the base build without LoRA, cases
    interleaved every round; and the memory one resident adapter takes.

    Example: trtllm-pipeline bench lora build_configs/smollm2-135m-cpu-lora.yaml --batch 1 --batch 8
    """
    from pipeline.bench import report
    from pipeline.bench.lora_decode import lora_cost, table
    from pipeline.build import default_output
    from pipeline.targets.onnxruntime.runtime.model_runner import default_threads

    engines = []
    for name, path, given in (("CONFIG", config, output), ("--base", base, None)):
        load(path, [])
        engine = (given or default_output(path)) / "engine"
        if not (engine / "config.json").is_file():
            raise PipelineError(f"{name}: no engine in {engine}: build it first (trtllm-pipeline build {path})")
        engines.append(engine)
    try:
        input_len, output_len = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise typer.BadParameter(f"{shape!r} is not INPUTxOUTPUT, e.g. 128x32", param_hint="--shape") from None
    threads = threads or default_threads()
    console.print(f"  timing decode steps: {rounds} rounds", highlight=False)
    results = lora_cost(
        engines[1],
        engines[0],
        threads=threads,
        batches=batch or [1, 8],
        input_len=input_len,
        output_len=output_len,
        spinning=spinning,
        rounds=rounds,
    )
    results |= {"name": config.stem, "threads": threads, "shape": shape}
    summary = table(results)
    folder = report.write_report(out, "lora", f"lora: {config}", results, summary, lambda path: None, "")
    console.print(summary, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("scale")
@reports_errors
def bench_scale(
    sizes: str = typer.Option(
        ",".join(SCALE_SIZES),
        "--sizes",
        help="Comma-separated sizes: 0.5b (~0.48B params), 1.1b (TinyLlama's shape), 3b (Llama-3.2-3B's widths and "
        "depth, ~3.0B with this vocabulary), 8b-2l (Llama-3.1-8B's widths, 2 layers).",
    ),
    targets: str = typer.Option(
        "onnxruntime,trtllm",
        "--targets",
        help="Comma-separated: onnxruntime (build_configs/smollm2-135m-cpu.yaml, every stage) and trtllm "
        "(build_configs/smollm2-135m-fp8.yaml up to export: its engine needs a GPU).",
    ),
    force: bool = typer.Option(False, "--force", help="Measure again the sizes x targets already measured."),
    keep_checkpoints: bool = typer.Option(
        False,
        "--keep-checkpoints",
        help="Keep each random checkpoint under WORK/checkpoints for later runs (the 3B is 6 GB); default: deleted "
        "once its size is measured.",
    ),
    calibration_samples: int = typer.Option(
        16, help="trtllm only: ModelOpt FP8 calibration samples (the config's 64 take ~4x as long on CPU)."
    ),
    tokenizer: Optional[Path] = typer.Option(
        None, help="The checkpoints' tokenizer (its length is the vocabulary); default SmolLM2's (its import in WORK)."
    ),
    overrides: Optional[list[str]] = typer.Option(
        None, "--set", help="Another override of both targets' configs (repeat), e.g. verify.eval_tokens=1024."
    ),
    ignore_memory_check: bool = typer.Option(
        False, "--ignore-memory-check", help="Run the stages the memory plan says will not fit (default: exit 4)."
    ),
    report_only: bool = typer.Option(
        False,
        "--report-only",
        help="Build nothing: rewrite the table and plot from the results kept in OUT (predictions recomputed).",
    ),
    work: Path = typer.Option(
        Path("bench_results/scale-work"), help="Checkpoints and builds while measured (deleted after each size)."
    ),
    out: Path = typer.Option(
        Path("bench_results/scale"),
        "--out",
        help="Results: OUT/SIZE/TARGET.json and OUT/SIZE/logs/, then OUT/summary.md, results.json and "
        "bytes_per_parameter.png.",
    ),
):
    """What every build stage costs at real model sizes, on both targets: random-weight Llama checkpoints of real
    shapes (bfloat16, SmolLM2's tokenizer, seeded), each built from the shipped config with `model.source=hf`, each
    stage in its own process. Per size x target x stage: wall and CPU seconds, peak anonymous RSS of the stage's
    process tree (sampled every 50 ms) and the kernel's ru_maxrss, bytes per parameter, disk written, and the
    memory plan's prediction beside them (`plan` prints the same), and the peak of each phase a stage's log names
    (copying, writing the graph, calibration, the quality gate...) against the bound for what it does. Each CPU
    build is then served (tritonserver and the OpenAI gateway answer a few streamed completions). The quality gate's
    thresholds are relaxed (a random model's answers are noise); what it computes is a user's default.

    How long: 41 minutes for every size on this project's 2-core machine (a clean clone, 2026-11-29; the 3B takes
    half of it). Disk: each build is deleted once measured (a 3B CPU build writes 20.7 GB).

    Resuming: each size x target is written to OUT/SIZE/TARGET.json as it finishes, and a run skips those measured
    there; run the same command again after an interruption (--force measures them again). A stage that fails (e.g.
    killed for memory) is recorded with its log in OUT/SIZE/logs/, the run goes on, and the next run tries it again.

    Example: trtllm-pipeline bench scale --sizes 0.5b,1.1b --targets onnxruntime
    """
    from pipeline.bench.scale import load_results, repredict, run_scale
    from pipeline.bench.scale_report import write_summary

    log = lambda m: console.print(f"  {m}", highlight=False, markup=False)  # noqa: E731
    if report_only:
        results = load_results(out)
        repredict(out, work, results, log)
    else:
        results = run_scale(
            [name.strip() for name in sizes.split(",") if name.strip()],
            [name.strip() for name in targets.split(",") if name.strip()],
            out,
            work,
            tokenizer=tokenizer,
            force=force,
            keep_checkpoints=keep_checkpoints,
            calibration_samples=calibration_samples,
            extra=overrides or [],
            check_memory=not ignore_memory_check,
            log=log,
        )
    summary = write_summary(out, results)
    console.print(summary.read_text(), highlight=False, markup=False, soft_wrap=True)
    console.print(f"report: {summary}")
