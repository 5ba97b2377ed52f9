"""Kubernetes manifests for a build config, validated offline before they are written (`trtllm-pipeline deploy`).

A target describes how its output is served in a container (`Serving`, declared per target under the
`trtllm_pipeline.deployments` entry points by `pipeline/targets/*/deployment.py`: modules of their own, so that the
build stages' lock entries, which hash the adapters and what they import, do not change with the deployment);
`manifests` turns that and the config's `deploy` section into objects, and `checks` validates every object against
the Kubernetes OpenAPI schemas of `deploy.kubernetes_version` (kubernetes-validate) or, for LeaderWorkerSet, the
CRD schema tabulated from kubernetes-sigs/lws (`upstream/leaderworkerset.json`), then cross-checks them against each
other and the config: ports, probes, GPUs per group, memory against the plan, and the build config the pods will build.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from pipeline.docker import APP_DIR
from pipeline.errors import PipelineError
from pipeline.plugins import DEPLOYMENTS_GROUP, declared

# Inside the containers. Both images of our Dockerfile install the pipeline in APP_DIR's virtualenv.
CLI = f"{APP_DIR}/.venv/bin/trtllm-pipeline"
CONFIG_DIR = "/etc/trtllm-pipeline"  # the ConfigMap: the build config and the runtime options
VOLUME_DIR = "/artifacts"  # the claim (artifacts: volume): the output directory and the download cache
SHM_DIR = "/dev/shm"
STARTUP_SECONDS = 1800  # loading a 70B engine from network storage takes minutes: the server gets half an hour


@dataclass(frozen=True)
class PodPaths:
    """Where a pod finds what it serves."""

    config: str  # the build config (the image's file, or the ConfigMap's copy)
    output: str  # the output directory (in the image or on the claim)
    cache: str  # TRTLLM_PIPELINE_CACHE
    build_in_server: bool  # the server command builds first (the output is in the image: no build Job)
    config_dir: str = CONFIG_DIR


def group_shape(gpus: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(GPUs per pod, pods per replica) of a replica needing `gpus` GPUs on nodes of `gpus_per_node` (None: one
    node holds them all)."""
    if gpus == 0:
        return 0, 1
    per_pod = min(gpus_per_node or gpus, gpus)
    return per_pod, -(-gpus // per_pod)


@dataclass(frozen=True)
class QueueMetric:
    """The Prometheus series counting one server's requests that wait for a batch slot (what the HPA scales on)."""

    series: str
    source: str  # where the series is defined
    labels: dict[str, str] = field(default_factory=dict)  # fixed label values selecting the waiting requests

    @property
    def name(self) -> str:
        """The custom metric's name in the Prometheus adapter's API."""
        return self.series + "".join(f"_{value}" for value in self.labels.values())


@dataclass(frozen=True)
class Serving:
    """How a target's built output runs in a container."""

    image: str  # default image: our Dockerfile's, for this target and release
    image_build: str  # the command that builds it
    artifacts: str  # default placement of the output: "image" or "volume"
    image_problem: str | None  # why the output cannot be built into the image (None: it can)
    port_flags: dict[str, str]  # deploy.ports name -> the server command's option binding it
    # what any client reaching the server's own ports can do (they carry no authentication): the Service's
    # annotation UNAUTHENTICATED_ANNOTATION, when it exposes them
    unauthenticated: str
    health: tuple[str, str, str]  # (port name, readiness path, liveness path); the startup probe is readiness's
    metrics: tuple[str, str] | None  # (port name, path) of its Prometheus metrics
    queue_metric: QueueMetric | None
    queue_problem: str | None  # why there is no queue metric to autoscale on
    gpus: int  # GPUs of one replica: tp x pp (0 on CPU)
    memory_bytes: int  # host memory of one serving pod (the memory plan)
    memory_lines: list[str]  # how the plan adds up, for `deploy`
    build_memory_bytes: int  # host memory of the build Job (artifacts: volume)
    shm_bytes: int  # /dev/shm the server needs (memory-backed, counted in the pod's memory)
    cpus: int  # CPU cores requested
    command: Callable[[PodPaths], list[str]]  # the single-node server command
    config_files: dict[str, str] = field(default_factory=dict)  # ConfigMap files the command reads, by name
    # the leader's command of a replica spread over pods of `gpus_per_node` GPUs (None: single node only)
    group_command: Callable[[PodPaths, int], list[str]] | None = None
    group_problem: str | None = None  # why it has no multi-node launch


# ---------------------------------------------------------------- served by `trtllm-pipeline serve` (tritonserver)

TRITON_PORT_FLAGS = {"http": "--http-port", "grpc": "--grpc-port", "metrics": "--metrics-port"}
UNAUTHENTICATED_ANNOTATION = "trtllm-pipeline/unauthenticated-ports"


def triton_health() -> tuple[str, str, str]:
    """tritonserver's KServe v2 health routes, as tritonclient (the client `serve` waits with) requests them."""
    import inspect
    import re

    from tritonclient.http import _client

    routes = dict(
        re.findall(r'def (is_server_ready|is_server_live).*?request_uri = "([^"]+)"', inspect.getsource(_client), re.S)
    )
    return "http", "/" + routes["is_server_ready"], "/" + routes["is_server_live"]


def triton_port_flags(cfg) -> dict[str, str]:
    return {**TRITON_PORT_FLAGS, **({"openai": "--openai-port"} if cfg.deploy.openai_gateway else {})}


def triton_serve_command(cfg, paths: PodPaths) -> list[str]:
    """`trtllm-pipeline serve` on every address of the pod, with the ports of deploy.ports."""
    d = cfg.deploy
    command = [CLI, "serve", paths.config, "--output", paths.output, "--host", "0.0.0.0"]
    command += [arg for name, flag in TRITON_PORT_FLAGS.items() for arg in (flag, str(getattr(d.ports, name)))]
    command += ["--ready-timeout", str(STARTUP_SECONDS)]
    if paths.build_in_server:
        command.append("--build")
    if d.openai_gateway:
        command += ["--openai", "--openai-port", str(d.ports.openai)]
        if d.api_key_secret is None:  # a ClusterIP service: `deploy` says so; exposing it without a key is refused
            command.append("--allow-unauthenticated")
    return command


# ---------------------------------------------------------------- the registry


@functools.cache
def _servings() -> dict[str, Callable]:
    return {entry.name: entry.load() for entry in declared(DEPLOYMENTS_GROUP)}


def serving_of(cfg) -> Serving:
    """How the config's target serves its output, from the function its entry point names."""
    try:
        return _servings()[cfg.target.name](cfg)
    except KeyError:
        raise PipelineError(
            f"target {cfg.target.name} has no deployment (registered: {', '.join(_servings())})"
        ) from None
