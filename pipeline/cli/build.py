"""The build verbs: validate a config, plan and run its stages, verify the result's quality, write its Kubernetes
manifests."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pipeline.cli.common import ConfigArg, OutputOpt, OverridesArg, console, load, reports_errors
from pipeline.errors import PipelineError, StageError


@reports_errors
def validate(config: Path = ConfigArg, overrides: Optional[list[str]] = OverridesArg):
    """Check a build config and print it fully resolved (defaults marked). Lists every problem at once.

    Example: trtllm-pipeline validate build_configs/smollm2-135m-cpu.yaml quantization.weights=int4
    """
    from pipeline import prequantized
    from pipeline.config import resolved_yaml

    cfg = load(config, overrides)
    console.print(f"# {config}: valid", style="green", highlight=False)
    detected = prequantized.of_config(cfg)
    if detected is not None:
        use = {
            "keep": "the engine keeps its weights as they are",
            "dequantize": "imported as the float weights its codes stand for",
        }
        console.print(
            f"# the checkpoint is {detected.describe()}: {use[cfg.quantization.checkpoint_quantization]}",
            highlight=False,
            markup=False,
        )
    console.print(resolved_yaml(cfg), highlight=False, markup=False)


def _decision_table(decisions, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("stage", "status", "why", "writes"):
        table.add_column(column)
    colours = {"up to date": "green", "will run": "cyan", "skipped": "dim"}
    for d in decisions:
        table.add_row(d.stage, f"[{colours[d.status]}]{d.status}[/]", "; ".join(d.reasons), d.writes)
    return table


def _print_predictions(decisions, predictions: dict) -> None:
    """One line per stage that will run: its predicted peak host memory and disk, flagged where it exceeds what this
    machine has available (the build would stop there)."""
    from pipeline.host_memory import available_memory, prediction_line, shown_bytes
    from pipeline.plan import WILL_RUN

    running = [d.stage for d in decisions if d.status == WILL_RUN and d.stage in predictions]
    if not running:
        return
    available = available_memory()
    console.print(
        f"predicted per stage (pipeline/host_memory.py; {shown_bytes(available)} of host memory available here):",
        highlight=False,
        soft_wrap=True,
    )
    for name in running:
        prediction = predictions[name]
        line = f"  {prediction_line(name, prediction)}"
        if prediction.host_bytes > available:
            lower = f"; {prediction.lowered_by} lowers it" if prediction.lowered_by else ""
            line += f"; [red]more than is available: the build would stop here (exit 4){lower}[/]"
        console.print(line, highlight=False, soft_wrap=True)


def _check_until(until: Optional[str]) -> None:
    from pipeline.stages import STAGES

    if until is not None and until not in STAGES:
        raise PipelineError(f"--until {until}: unknown stage; choose one of {', '.join(STAGES)}")


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
    version or source file that changed), what each writes, and each running stage's predicted peak host memory
    and disk. Runs nothing.

    Example: trtllm-pipeline plan build_configs/smollm2-135m-cpu.yaml runtime.max_queue_delay_microseconds=500
    """
    from pipeline.build import default_output
    from pipeline.host_memory import predict
    from pipeline.lock import read_lock
    from pipeline.plan import WILL_RUN
    from pipeline.plan import plan as make_plan
    from pipeline.targets import target_of

    _check_until(until)
    cfg = load(config, overrides)
    output = output or default_output(config)
    decisions = make_plan(cfg, output, read_lock(output), until=until, force=force)
    if check:
        raise typer.Exit(int(any(d.status == WILL_RUN for d in decisions)))
    predictions = predict(cfg)
    if as_json:
        rows = []
        for d in decisions:
            predicted = predictions.get(d.stage)
            rows.append(
                {"stage": d.stage, "status": d.status, "reasons": d.reasons, "writes": d.writes}
                | ({"predicted": dataclasses.asdict(predicted)} if predicted and d.status == WILL_RUN else {})
            )
        print(json.dumps(rows, indent=2))
        return
    console.print(_decision_table(decisions, f"plan for {config} → {output}"))
    _print_predictions(decisions, predictions)
    target = target_of(cfg)
    unavailable = target.unavailable()
    if unavailable:
        console.print(
            f"[yellow]target {target.name} on this machine:[/] {unavailable}", highlight=False, soft_wrap=True
        )
    for note in target.plan_notes(cfg, output):
        console.print(note, highlight=False, soft_wrap=True)


def _publish_repo(repo: Path, name: str) -> Path:
    """Point triton_model_repo/<config name> at the built repository (symlink swapped atomically)."""
    link = Path("triton_model_repo") / name
    link.parent.mkdir(exist_ok=True)
    tmp = link.with_name(f".{name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(repo.resolve(), link.parent.resolve()))
    os.replace(tmp, link)
    return link


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
    ignore_memory_check: bool = typer.Option(
        False,
        "--ignore-memory-check",
        help="Run a stage even when its predicted peak host memory exceeds what this machine has available "
        "(`plan` prints the predictions).",
    ),
):
    """Run the pipeline. Up-to-date stages are skipped (checked against build.lock.json); each stage's
    output appears only when complete. A stage whose predicted peak host memory exceeds what this machine has
    available is not started (exit 4, naming the setting that lowers it; --ignore-memory-check runs it anyway).

    Example: trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml --until import
    """
    from pipeline.build import build as run_build
    from pipeline.build import default_output
    from pipeline.plan import UP_TO_DATE, WILL_RUN

    _check_until(until)
    cfg = load(config, overrides)
    published = output is None
    output = output or default_output(config)
    decisions = run_build(
        cfg, output, console, until=until, force=force, wait=wait, check_memory=not ignore_memory_check
    )
    if published and (output / "triton_repo").is_dir():
        link = _publish_repo(output / "triton_repo", config.stem)
        console.print(f"Triton repository: {link} -> {output / 'triton_repo'}")
    ran = [d.stage for d in decisions if d.status == WILL_RUN]
    if not ran and all(d.status != WILL_RUN for d in decisions):
        fresh = [d.stage for d in decisions if d.status == UP_TO_DATE]
        console.print(f"[green]nothing to do:[/] {', '.join(fresh) or 'no stage'} up to date in {output}")
    else:
        console.print(f"[green]built[/] {', '.join(ran)} in {output} (manifest: {output / 'build.lock.json'})")


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
    from pipeline.build import default_output, verify_output
    from pipeline.quality import THRESHOLDS, gate_problem

    cfg = load(config, overrides)
    output = output or default_output(config)
    subject, report = verify_output(cfg, output, lambda m: console.print(f"  {m}", highlight=False))
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

    cfg = load(config, overrides)
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
    held = "holds the build" if dep.placement == "image" else f"job/{dep.name}-build builds the config onto the claim"
    console.print(
        f"image: {cfg.deploy.image or serving.image} ({held}), built by:\n  {serving.image_build}",
        highlight=False,
        soft_wrap=True,  # a command wrapped by the terminal's width would not paste as one
    )
    if cfg.deploy.openai_gateway and "openai" in serving.port_flags and not cfg.deploy.api_key_secret:
        console.print("[yellow]note:[/] the OpenAI gateway takes no API key (set deploy.api_key_secret)")
    console.print(f"apply: kubectl apply -k {out / stage.MANIFESTS}", highlight=False)
