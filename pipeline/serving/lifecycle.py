"""A served repository's lifecycle, as `serve` runs it: the checks before anything starts, the OpenAI gateway and
tritonserver started in that order, then both stopped together however serving ends (Ctrl-C, SIGTERM, a model
process that died, an error).

A repository a target serves with a server of its own (TensorRT-LLM's PyTorch backend: trtllm-serve) is that
server's: without the gateway this process becomes it; with the gateway (`FrontedServing`) it runs on loopback and the
gateway, with the same routes, API key and readiness as in front of tritonserver, stands in front of it on the public
port.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pipeline.adapter_registry import Registry
from pipeline.errors import ConfigError, PipelineError
from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.app import create_app
from pipeline.serving.openai_upstream import OpenAIUpstream, OwnServer
from pipeline.serving.upstream import triton_upstream
from pipeline.targets import TARGETS, repository_checks
from pipeline.triton.server import STOP_SIGNALS, Ports, TritonServer, dial_address, host_port
from pipeline.triton.validate import RepoReport, validate_repo


@dataclass(frozen=True)
class GatewayOptions:
    """How the OpenAI-compatible gateway in front of tritonserver is served."""

    port: int
    api_key: str | None
    max_body_mb: float
    allowed_lora_dirs: tuple[Path, ...] = ()  # /v1/load_lora_adapter's only sources (serve --allow-lora-dir)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def refuse_open_gateway(gateway: GatewayOptions, host: str, allow_unauthenticated: bool) -> None:
    """A gateway without an API key only on a loopback host, unless allowed explicitly."""
    if not gateway.api_key and not allow_unauthenticated and not _loopback(host):
        raise PipelineError(
            f"--host {host} would let anyone who reaches port {gateway.port} use the OpenAI gateway: set "
            "TRTLLM_PIPELINE_API_KEY (or --api-key), or pass --allow-unauthenticated to serve it without a key"
        )


def checked_repository(repo: Path, source: Path) -> RepoReport:
    """The validation report of the repository to serve (built from `source`); an error when it is missing or
    invalid."""
    if not repo.is_dir():
        raise PipelineError(f"{repo} does not exist: build it first (trtllm-pipeline build {source})")
    report = validate_repo(repo, repository_checks({}))  # a release: the one each build recorded
    if report.problems:
        raise ConfigError(repo, report.problems)
    return report


def serve_without_triton(
    repo: Path, host: str, port: int, gateway: GatewayOptions | None, launcher: tuple[str, ...] = ()
) -> OwnServer | None:
    """Where a target serves such a repository with a server of its own (TensorRT-LLM's PyTorch backend:
    trtllm-serve, after `launcher`): without the gateway this process becomes it on host:port; with the gateway,
    that server as it runs on loopback port `port` behind the gateway (`FrontedServing` runs both). None for any
    other repository."""
    for target in TARGETS.values():
        launch = {"launcher": launcher} if launcher else {}  # a target written before launchers takes none
        own = target.serve_without_triton(repo, host, port, gateway.port if gateway else None, **launch)
        if own is not None:
            return own
    return None


def triton_launch(repo: Path, report: RepoReport):
    """The tritonserver command a target needs for the repository's models (None: the CPU tritonserver)."""
    return next((launch for t in TARGETS.values() if (launch := t.triton_launch(repo, report))), None)


def adapter_admin(report: RepoReport, registry: Path, allowed_dirs=()) -> AdapterAdmin | None:
    """The served LoRA adapters of a repository whose LLM model takes adapters while serving (its target says:
    `Target.served_adapters`; None otherwise): the build's, and those the gateway adds to `registry`, the file the
    LLM model reads."""
    served = next((s for target in TARGETS.values() if (s := target.served_adapters(report))), None)
    if served is None:
        return None
    allowed = [Path(d) for d in allowed_dirs]
    return AdapterAdmin(Registry(registry), served.fit, allowed, served.capacity, served.built, served.evict_idle)


def _start_gateway(
    report: RepoReport, repo: Path, host: str, server: TritonServer, gateway: GatewayOptions, ready: threading.Event
):
    """uvicorn serving the OpenAI gateway on a thread; returns (its Server, the thread). It answers 503 until
    `ready` is set (tritonserver's models loaded).

    Stopping takes two steps around tritonserver's stop: `should_exit` first (no new requests), `join`
    after, so streams cut by the stop still send their error event and [DONE] before the process exits.
    """
    # the BLS is the model naming its preprocessing model; names come from the config (triton.*_name)
    bls = next((name for name, c in report.models.items() if "preprocessing_model_name" in c.parameters), None)
    if bls is None:
        raise PipelineError(f"{repo} has no BLS model (tensorrt_llm_bls), which --openai forwards to; rebuild it")
    lora = adapter_admin(report, server.lora_registry, gateway.allowed_lora_dirs)
    upstream = triton_upstream(report.models, bls, dial_address(host, server.ports.grpc), lora, ready)
    app = create_app(
        upstream,
        upstream.tokenizer_dir,
        served_name=served_name(repo),
        api_key=gateway.api_key,
        max_body_bytes=int(gateway.max_body_mb * 1_000_000),
        lora=lora,
    )
    return start_gateway(app, host, gateway.port)


def start_gateway(app, host: str, port: int):
    """uvicorn serving the gateway `app` on a thread, once it listens; returns (its Server, the thread)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", loop="uvloop", http="httptools")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="openai-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise PipelineError(f"the OpenAI gateway did not start on {host_port(host, port)} (is the port free?)")
        time.sleep(0.05)
    return server, thread


def served_name(repo: Path) -> str:
    """The model name the gateway serves a repository under: its build's output directory's."""
    return repo.resolve().parent.name


def _interrupt(*_) -> None:
    """SIGTERM (docker stop, systemd) shuts down as cleanly as Ctrl-C."""
    raise KeyboardInterrupt


class _GatewayInFront:
    """What both ways of serving share as context managers: SIGTERM counts as Ctrl-C from entry on (a stop during
    start-up must clean up too); leaving tells the gateway to exit, stops the server behind it (`_stop_server`) and
    joins the gateway, ignoring further stop signals meanwhile, then gives the stop signals their handlers back."""

    host: str
    gateway: GatewayOptions | None

    def __enter__(self):
        self._handlers = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
        signal.signal(signal.SIGTERM, _interrupt)
        return self

    @property
    def openai_url(self) -> str:
        """The gateway's base URL for a local client (`.../v1`)."""
        return f"http://{dial_address(self.host, self.gateway.port)}/v1"

    def _stop_server(self) -> None:
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        for stop_signal in STOP_SIGNALS:  # a second Ctrl-C must not orphan the server mid-stop
            signal.signal(stop_signal, signal.SIG_IGN)
        try:
            if self._uvicorn:
                self._uvicorn.should_exit = True
            self._stop_server()
            if self._uvicorn_thread:
                self._uvicorn_thread.join(timeout=10)
        finally:
            for stop_signal, handler in self._handlers.items():
                signal.signal(stop_signal, handler)


class Serving(_GatewayInFront):
    """tritonserver on a checked repository and, given GatewayOptions, the OpenAI gateway in front of it (`bench
    serve` goes on to its peer after serving, so leaving gives the stop signals their handlers back)."""

    def __init__(
        self,
        repo: Path,
        report: RepoReport,
        cache: Path,
        *,
        ports: Ports,
        host: str,
        log_file: Path | None,
        gateway: GatewayOptions | None,
        log=print,
    ):
        self.repo, self.report, self.host, self.gateway = repo, report, host, gateway
        self.server = TritonServer(
            repo,
            cache,
            ports=ports,
            host=host,
            launch=triton_launch(repo.resolve(), report),
            log_file=log_file or repo.parent / "tritonserver.log",
            log=log,
        )
        self._uvicorn = self._uvicorn_thread = None
        self._ready = threading.Event()  # the gateway answers 503 until tritonserver is ready
        self._handlers: dict = {}

    def start(self, timeout: float) -> None:
        """The gateway first, listening before tritonserver is ready, so a readiness probe on tritonserver covers it
        too; then tritonserver, waiting up to `timeout` seconds for its models to load."""
        if self.gateway:
            self._uvicorn, self._uvicorn_thread = _start_gateway(
                self.report, self.repo, self.host, self.server, self.gateway, self._ready
            )
        self.server.start(timeout=timeout)
        self._ready.set()

    def wait(self) -> NoReturn:
        """Until tritonserver exits, which is a failure: serving ends on Ctrl-C or SIGTERM only."""
        self.server.process.wait()
        raise PipelineError(
            f"{self.server.exit_reason()}\nserve exits so that its supervisor (e.g. Kubernetes) restarts it"
        )

    def _stop_server(self) -> None:
        self.server.stop()

    def __exit__(self, *exc) -> None:
        self._ready.clear()
        super().__exit__(*exc)


class FrontedServing(_GatewayInFront):
    """A target's own server (`OwnServer`: trtllm-serve) on loopback with the OpenAI gateway in front of it on
    `host`, as `serve --openai` runs them; a context manager like `Serving`. The gateway listens first and answers
    503 until the server's /health answers 200, so a readiness probe on the gateway covers the server's start too.
    The server's LoRA adapters (`OwnServer.adapters`, from the build) are models of the gateway's own, each request
    on one sent with the fields that pick it."""

    STOP_GRACE_S = 30  # the server's own shutdown before it is killed

    def __init__(self, repo: Path, own: OwnServer, host: str, gateway: GatewayOptions, log=print):
        self.repo, self.own, self.host, self.gateway, self.log = repo, own, host, gateway, log
        self.process: subprocess.Popen | None = None
        self._uvicorn = self._uvicorn_thread = None
        self._handlers: dict = {}

    def start(self) -> None:
        """The gateway, then the server (in a process group of its own, which its stop takes along)."""
        own = self.own
        app = create_app(
            OpenAIUpstream(own.url, own.model, own.dialect, adapters=own.adapters),
            own.tokenizer_dir,
            served_name=served_name(self.repo),
            api_key=self.gateway.api_key,
            max_body_bytes=int(self.gateway.max_body_mb * 1_000_000),
            limits_dir=own.limits_dir,
        )
        self._uvicorn, self._uvicorn_thread = start_gateway(app, self.host, self.gateway.port)
        if own.adapters:
            self.log(f"LoRA adapters served as models: {', '.join(own.adapters)}")
        self.log(f"starting {own.description}: {' '.join(own.command)}")
        self.process = subprocess.Popen(own.command, start_new_session=True)

    def wait(self) -> NoReturn:
        """Until the server exits, which is a failure: serving ends on Ctrl-C or SIGTERM only."""
        code = self.process.wait()
        raise PipelineError(
            f"{self.own.description} exited with status {code}\n"
            "serve exits so that its supervisor (e.g. Kubernetes) restarts it"
        )

    def _stop_server(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for stop_signal, grace in ((signal.SIGINT, self.STOP_GRACE_S), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, stop_signal)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
