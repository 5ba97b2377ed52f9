"""The verbs that use a build: generate with its engine (`run`), check its Triton repository (`validate-repo`) and
serve it (`serve`)."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Optional

import typer

from pipeline.batch_generation import read_prompts, run_batches, write_jsonl
from pipeline.cli.common import OutputOpt, console, load, reports_errors
from pipeline.errors import ConfigError, PipelineError


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
    from pipeline.targets import load_runner

    engine_dir = source if source.is_dir() else (output or default_output(source)) / "engine"
    prompts = read_prompts(input_file, prompt or [], max_tokens)
    runner = load_runner(engine_dir, threads, None if source.is_dir() else load(source, []).runtime)
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
        help="Require 'Authorization: Bearer KEY' on every route of the gateway, /docs and /openapi.json included, "
        "but the readiness probe /health (401 otherwise); surrounding whitespace is stripped, an empty key means "
        "none; default: no key. "
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
    allow_lora_dir: list[Path] = typer.Option(
        [],
        "--allow-lora-dir",
        help="A directory whose PEFT adapters the gateway's POST /v1/load_lora_adapter may load (repeatable; "
        "symbolic links are resolved first). Without it the route loads nothing: adapters come from the build's "
        "lora.adapters. Example: --allow-lora-dir /models/adapters.",
    ),
    launcher: Optional[str] = typer.Option(
        None,
        "--launcher",
        show_default=False,
        help="PyTorch-backend builds: a command put before the trtllm-serve command, which starts it where it runs: "
        "mpirun over several nodes (the first host must be this machine, where rank 0 serves and the gateway of "
        "--openai reaches it on loopback --http-port; the output must sit at the same path on every host), or "
        "`docker run --network=host` of NVIDIA's container. This machine then needs no TensorRT-LLM. Example: "
        "--launcher 'mpirun --host node0:4,node1:4 -n 8 trtllm-llmapi-launch'.",
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
    PyTorch backend: trtllm-serve (OpenAI-compatible) on a GPU machine with TensorRT-LLM, on --http-port; with
    --openai, trtllm-serve on loopback --http-port and the gateway in front of it on --openai-port (the same routes,
    API key and structured outputs as in front of tritonserver), over several nodes with --launcher; else exit 4
    with the exact commands for a GPU machine (the gateway in front of trtllm-serve in our image, or in front of
    NVIDIA's container for a release no image of ours holds, or trtllm-serve alone, or tritonserver with the llmapi
    model). trtllm engine builds: the tritonserver of NVIDIA's TensorRT-LLM container,
    under mpirun with one rank per GPU when tp x pp > 1. Validates the repository first, then runs until Ctrl-C or
    SIGTERM. Clients call the `ensemble` (or `tensorrt_llm_bls`) model exactly as they would a TensorRT-LLM
    deployment. Should a model process die, serve stops tritonserver at once (in-flight requests fail) and exits 1
    naming the model, for its supervisor to restart; killed itself, it takes tritonserver along.

    Example: trtllm-pipeline serve build_configs/smollm2-135m-cpu.yaml, then
    curl -s localhost:8000/v2/models/ensemble/generate -d '{"text_input": "The capital of France is", "max_tokens": 16}'
    """
    from pipeline.build import build as run_build
    from pipeline.build import default_output
    from pipeline.serving.lifecycle import checked_repository, serve_without_triton
    from pipeline.triton.server import Ports

    gateway = _gateway_options(openai, openai_port, api_key, openai_max_body_mb, allow_lora_dir)
    if gateway:
        from pipeline.serving.lifecycle import refuse_open_gateway

        refuse_open_gateway(gateway, host, allow_unauthenticated)
    if build_first:
        if source.is_dir():
            raise PipelineError(f"--build needs a build config, not the repository {source}")
        run_build(load(source, None), output or default_output(source), console, until="triton_repo", wait=True)
    repo = source if source.is_dir() else (output or default_output(source)) / "triton_repo"
    report = checked_repository(repo, source)
    try:
        launch = tuple(shlex.split(launcher or ""))
    except ValueError as error:  # an unbalanced quote
        raise PipelineError(f"--launcher {launcher!r}: {error}; quote it as a shell would") from None
    own = serve_without_triton(repo, host, http_port, gateway, launch)
    if own is None and launch:
        raise PipelineError(
            f"--launcher: {repo} is served by tritonserver, which `serve` starts itself (under mpirun for an engine "
            "of several GPUs); only a PyTorch-backend build's trtllm-serve takes a launcher"
        )
    if own is not None:  # the gateway in front of the target's own server (without it, this process became that)
        _serve_fronted(repo, own, host, gateway)
    else:
        _serve_tritonserver(
            repo, report, host, Ports(http_port, grpc_port, metrics_port), gateway, log_file, ready_timeout
        )


def _gateway_options(openai: bool, port: int, api_key, max_body_mb: float, allow_lora_dir: list[Path]):
    """serve's --openai options checked (a blank key, a LoRA directory that is not one), or None without --openai."""
    from pipeline.serving.app import configured_key
    from pipeline.serving.lifecycle import GatewayOptions

    api_key = configured_key(api_key)  # a key of whitespace only fails here, before anything starts
    missing = [str(d) for d in allow_lora_dir if not d.is_dir()]
    if missing:
        raise PipelineError(f"--allow-lora-dir {missing[0]}: not a directory; name a directory holding adapters")
    if not openai:
        return None
    if not api_key and os.environ.get("TRTLLM_PIPELINE_API_KEY") == "":
        console.print(
            f"[yellow]warning:[/] TRTLLM_PIPELINE_API_KEY is set but empty: the OpenAI gateway on port {port} "
            "takes no API key, so anyone who can reach it can use it; set a key "
            "(TRTLLM_PIPELINE_API_KEY=$(openssl rand -hex 16)) or unset the variable if none is intended"
        )
    return GatewayOptions(port, api_key, max_body_mb, tuple(allow_lora_dir))


def _serve_fronted(repo: Path, own, host: str, gateway) -> None:
    """The OpenAI gateway in front of the target's own server (trtllm-serve), until Ctrl-C."""
    from pipeline.serving.lifecycle import FrontedServing, served_name
    from pipeline.triton.server import host_port

    with FrontedServing(repo, own, host, gateway, log=lambda m: console.print(f"[dim]{m}[/]")) as fronted:
        try:
            fronted.start()
            console.print(
                f"[green]serving[/] {repo} with {own.description} on {own.url} (loopback)\n"
                f"  OpenAI  http://{host_port(host, gateway.port)}/v1 (model '{served_name(repo)}'"
                f"{', API key required' if gateway.api_key else ''}; 503 until {own.description} is ready)\n"
                "Ctrl-C stops the server.",
                highlight=False,
            )
            fronted.wait()
        except KeyboardInterrupt:
            console.print(f"stopping the gateway and {own.description}")


def _serve_tritonserver(repo: Path, report, host: str, ports, gateway, log_file, ready_timeout: float) -> None:
    """tritonserver on the checked repository (and the gateway, with --openai), until Ctrl-C or a model dies."""
    from pipeline.build import cache_dir
    from pipeline.serving.lifecycle import Serving, served_name
    from pipeline.triton.server import host_port

    serving = Serving(
        repo,
        report,
        cache_dir(),
        ports=ports,
        host=host,
        log_file=log_file,
        gateway=gateway,
        log=lambda m: console.print(f"[dim]{m}[/]"),
    )
    with serving:
        try:
            with console.status(f"starting tritonserver on {repo} ..."):
                serving.start(ready_timeout)
            console.print(
                f"[green]serving[/] {repo} ({', '.join(sorted(report.models))})\n"
                f"  HTTP    http://{host_port(host, ports.http)}   e.g. POST /v2/models/ensemble/generate_stream\n"
                f"  gRPC    {host_port(host, ports.grpc)}\n  metrics http://{host_port(host, ports.metrics)}/metrics\n"
                f"  log     {serving.server.log_file}"
                + (
                    f"\n  OpenAI  http://{host_port(host, gateway.port)}/v1 (model '{served_name(repo)}'"
                    f"{', API key required' if gateway.api_key else ''})"
                    if gateway
                    else ""
                )
                + "\nCtrl-C stops the server.",
                highlight=False,
            )
            serving.wait()
        except KeyboardInterrupt:
            console.print("stopping tritonserver (models unload, python stubs and shared memory are released)")


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
    from pipeline.targets import repository_checks
    from pipeline.triton.validate import validate_repo as check

    if trtllm_version is not None:
        from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES
        from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS

        known = sorted(set(SUPPORTED_VERSIONS) | set(LLM_API_RELEASES), key=lambda v: tuple(map(int, v.split("."))))
        if trtllm_version not in known:
            raise typer.BadParameter(f"'{trtllm_version}' is not one of {', '.join(known)}")
    report = check(repo, repository_checks({"trtllm_version": trtllm_version} if trtllm_version else {}))
    if report.problems:
        raise ConfigError(repo, report.problems)
    console.print(f"[green]valid[/]: {repo} ({', '.join(sorted(report.models))})")
