"""A served repository's lifecycle, as `serve` runs it: the checks before anything starts, the OpenAI gateway and
tritonserver started in that order, then both stopped together however serving ends (Ctrl-C, SIGTERM, a model
process that died, an error). A repository of TensorRT-LLM's PyTorch backend is handed to trtllm-serve instead.
"""

from __future__ import annotations

import ipaddress
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pipeline.adapter_registry import Registry
from pipeline.errors import ConfigError, PipelineError
from pipeline.serving.adapter_admin import AdapterAdmin
from pipeline.serving.app import create_app
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


def serve_without_triton(repo: Path, host: str, port: int, gateway: GatewayOptions | None) -> None:
    """Where a target serves such a repository with a server of its own (TensorRT-LLM's PyTorch backend:
    trtllm-serve), this process becomes it; any other repository returns at once."""
    for target in TARGETS.values():
        target.serve_without_triton(repo, host, port, gateway is not None)


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
    import uvicorn

    # the BLS is the model naming its preprocessing model; names come from the config (triton.*_name)
    bls, config = next(
        ((name, c) for name, c in report.models.items() if "preprocessing_model_name" in c.parameters), (None, None)
    )
    if bls is None:
        raise PipelineError(f"{repo} has no BLS model (tensorrt_llm_bls), which --openai forwards to; rebuild it")
    preprocessing = config.parameters["preprocessing_model_name"].string_value
    app = create_app(
        dial_address(host, server.ports.grpc),
        report.models[preprocessing].parameters["tokenizer_dir"].string_value,
        served_name=served_name(repo),
        triton_model=bls,
        api_key=gateway.api_key,
        max_body_bytes=int(gateway.max_body_mb * 1_000_000),
        lora=adapter_admin(report, server.lora_registry, gateway.allowed_lora_dirs),
        ready=ready,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=gateway.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openai-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise PipelineError(
                f"the OpenAI gateway did not start on {host_port(host, gateway.port)} (is the port free?)"
            )
        time.sleep(0.05)
    return server, thread


def served_name(repo: Path) -> str:
    """The model name the gateway serves a repository under: its build's output directory's."""
    return repo.resolve().parent.name


def _interrupt(*_) -> None:
    """SIGTERM (docker stop, systemd) shuts down as cleanly as Ctrl-C."""
    raise KeyboardInterrupt


class Serving:
    """tritonserver on a checked repository and, given GatewayOptions, the OpenAI gateway in front of it. A context
    manager: SIGTERM counts as Ctrl-C from entry on (a stop during start-up must clean up too), and leaving it
    stops the gateway and tritonserver together, ignoring further stop signals meanwhile, then gives the stop signals
    their handlers back (`bench serve` goes on to its peer after serving)."""

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

    def __enter__(self) -> "Serving":
        self._handlers = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
        signal.signal(signal.SIGTERM, _interrupt)
        return self

    @property
    def openai_url(self) -> str:
        """The gateway's base URL for a local client (`.../v1`)."""
        return f"http://{dial_address(self.host, self.gateway.port)}/v1"

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

    def __exit__(self, *exc) -> None:
        for stop_signal in STOP_SIGNALS:  # a second Ctrl-C must not orphan the server mid-stop
            signal.signal(stop_signal, signal.SIG_IGN)
        self._ready.clear()
        try:
            if self._uvicorn:
                self._uvicorn.should_exit = True
            self.server.stop()
            if self._uvicorn_thread:
                self._uvicorn_thread.join(timeout=10)
        finally:
            for stop_signal, handler in self._handlers.items():
                signal.signal(stop_signal, handler)
