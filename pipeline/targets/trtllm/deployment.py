"""How a trtllm build runs in a container (`pipeline.k8s`), per backend: our GPU image of the release, the output
built once on a claim by a Job on the GPUs it serves from, one rank per GPU (a LeaderWorkerSet group over several
pods when tp x pp exceeds deploy.gpus_per_node). How each release serves: `upstream/trtllm_serving.json`
(scripts/dev/tabulate_trtllm_serving.py).

Apart from the adapter and its backends (`adapter.py`, `*_backend.py`) so that the build stages, whose lock entries
hash them and what they import, do not re-run when only the deployment changes.
"""

from __future__ import annotations

import re
import shlex

from pipeline.errors import PipelineError
from pipeline.host_memory import build_peak_bytes
from pipeline.k8s import (
    APP_DIR,
    CLI,
    TRITON_PORT_FLAGS,
    QueueMetric,
    Serving,
    group_shape,
    triton_health,
    triton_port_flags,
    triton_serve_command,
)
from pipeline.memory import GiB
from pipeline.targets.trtllm.backend import BACKENDS, backend_of, multi_node
from pipeline.targets.trtllm.gpu_memory import GPU_RANK_HOST_BYTES, gpu_pod_host_bytes, rank_weight_bytes
from pipeline.targets.trtllm.image import gpu_image_build, image_tag, transformers_conflict
from pipeline.targets.trtllm.llm_api_serving import MODEL_DIR, OPTIONS_FILE, trtllm_serve_command
from pipeline.targets.trtllm.pytorch_backend import options_yaml, release_options
from pipeline.targets.trtllm.triton_launch import tritonserver_ranks
from pipeline.triton.server import Ports, tritonserver_address_args
from pipeline.upstream import release_facts

HEALTH_ROUTE = "/health"  # trtllm-serve's liveness route (200 once the server runs), and the OpenAI gateway's

# /dev/shm cap of a GPU pod: NCCL's shared-memory transport between the pod's ranks and the python backend's regions
# (the `docker run` lines `plan` prints share the host's IPC namespace instead). A memory-backed emptyDir holds only
# what is written, but the pod's memory request and limit count the cap.
GPU_SHM_BYTES = 8 << 30
# mpirun of NVIDIA's -trtllm-python-py3 containers (the LeaderWorkerSet TensorRT-LLM example's launch path).
CONTAINER_MPIRUN = "/opt/hpcx/ompi/bin/mpirun"


def serving_facts(release: str) -> dict:
    """How TensorRT-LLM `release` is served (routes, launcher, metrics), as tabulated from its sources."""
    return release_facts("trtllm_serving", release, "target.trtllm_version: how trtllm-serve serves")


def gpu_serving(cfg, **backend_parts):
    """What both backends' deployments share: our GPU image of the release (NVIDIA's container holding it, plus the
    pipeline), the output built once onto the claim by the build Job, tp x pp GPUs per replica, host memory per pod.
    A release no image of ours holds is refused: its pods and build Job would run an image that cannot be built."""
    conflict = transformers_conflict(cfg.target.trtllm_version)
    if conflict:
        raise PipelineError(f"target.trtllm_version: deploy runs our GPU image of the release, but {conflict}")
    facts = cfg.model_facts()
    gpus = cfg.parallel.tp_size * cfg.parallel.pp_size
    per_pod, _ = group_shape(gpus, cfg.deploy.gpus_per_node)
    host = gpu_pod_host_bytes(cfg, facts, per_pod) if facts else 0
    lines, build_bytes = [], build_peak_bytes(cfg)
    if facts:
        lines.append(
            f"host memory per pod {host / GiB:.1f} GiB: {per_pod} ranks x (weights "
            f"{rank_weight_bytes(cfg, facts) / GiB:.1f} GiB staged while loading + "
            f"{GPU_RANK_HOST_BYTES / GiB:.0f} GiB runtime); the build Job "
            f"{build_bytes / GiB:.1f} GiB (the plan's largest stage)"
        )
        if cfg.target.gpu:
            lines += backend_of(cfg).memory_plan(cfg, facts).lines()
    return Serving(
        image=image_tag(cfg.target.trtllm_version),
        image_build=gpu_image_build(cfg).shown(),
        artifacts="volume",
        image_problem="a TensorRT-LLM output is built on the GPU it serves from (calibration, engines), which "
        "`docker build` has not; use deploy.artifacts: volume",
        gpus=gpus,
        memory_bytes=host,
        memory_lines=lines,
        build_memory_bytes=build_bytes,
        shm_bytes=GPU_SHM_BYTES,
        cpus=cfg.deploy.cpus or 4 * per_pod,
        **backend_parts,
    )


def parse_series(selector: str) -> tuple[str, dict[str, str]]:
    """'name{label="value",...}' -> (name, labels)."""
    name, _, rest = selector.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', rest))


def engine_serving(cfg) -> Serving:
    """`trtllm-pipeline serve` (tritonserver under mpirun) in our GPU image; a group's leader starts every rank
    over its pods, the others without ports of their own (the LeaderWorkerSet TensorRT-LLM example's layout)."""
    engine = serving_facts(cfg.target.trtllm_version)["triton_engine"]
    series, labels = parse_series(engine["queue_metric"]["queued"])
    ports = cfg.deploy.ports
    gpus = cfg.parallel.tp_size * cfg.parallel.pp_size

    def group(paths, per_node: int) -> list[str]:
        address = tritonserver_address_args("0.0.0.0", Ports(ports.http, ports.grpc, ports.metrics))
        quiet = ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
        ranks = tritonserver_ranks(f"{paths.output}/triton_repo", address, gpus, cfg.triton.llm_model_name, quiet)
        return mpi_group_command(CONTAINER_MPIRUN, ranks, per_node)

    return gpu_serving(
        cfg,
        # a group's leader runs mpirun, not `serve`: no OpenAI gateway beside it
        port_flags=TRITON_PORT_FLAGS if multi_node(cfg) else triton_port_flags(cfg),
        unauthenticated="Triton HTTP and gRPC: run the served models; TensorRT-LLM's tensorrt_llm model takes "
        "lora_weights and lora_config in a request and caches them under its lora_task_id for every later request "
        "(its design), so a client there can change what an adapter id serves for all",
        health=triton_health(),
        metrics=("metrics", "/metrics"),
        queue_metric=QueueMetric(series, engine["queue_metric"]["from"], labels),
        queue_problem=None,
        command=lambda paths: triton_serve_command(cfg, paths),
        group_command=group,
    )


def gateway_command(cfg, paths) -> list[str]:
    """`trtllm-pipeline serve --openai`: trtllm-serve on the pod's loopback (deploy.ports.http), the OpenAI gateway in
    front of it on every address (deploy.ports.openai), with the key of deploy.api_key_secret (the env var the
    manifest sets) or, without one, for a ClusterIP Service only (`deploy` says so)."""
    d = cfg.deploy
    command = [CLI, "serve", paths.config, "--output", paths.output, "--host", "0.0.0.0"]
    command += ["--http-port", str(d.ports.http), "--openai", "--openai-port", str(d.ports.openai)]
    if d.api_key_secret is None:
        command.append("--allow-unauthenticated")
    return command + (["--build"] if paths.build_in_server else [])


def llm_api_serving(cfg) -> Serving:
    """The OpenAI gateway in front of trtllm-serve, which reads the build's options, both run by
    `trtllm-pipeline serve --openai` in our GPU image (deploy.openai_gateway; trtllm-serve alone without it). A
    group's leader runs that `serve` with mpirun as its --launcher: trtllm-serve on every rank of the group under
    trtllm-llmapi-launch (rank 0, on the leader, the one the others work for), the gateway beside rank 0. Without
    the gateway the leader's mpirun runs trtllm-serve alone, reading the options from the ConfigMap."""
    release, gpus = cfg.target.trtllm_version, cfg.parallel.tp_size * cfg.parallel.pp_size
    routes = {route.get("path") for route in serving_facts(release)["trtllm_serve"]["routes"]["register_routes"]}
    if HEALTH_ROUTE not in routes:  # the gateway's readiness, and the probes, would fail forever
        raise PipelineError(f"trtllm-serve of TensorRT-LLM {release} registers no {HEALTH_ROUTE} route")
    options, _ = release_options(cfg)
    gateway = cfg.deploy.openai_gateway

    def command(paths) -> list[str]:
        model, options_file = f"{paths.output}/engine/{MODEL_DIR}", f"{paths.config_dir}/{OPTIONS_FILE}"
        return trtllm_serve_command(release, model, options_file, "0.0.0.0", cfg.deploy.ports.http)

    def group(paths, per_node: int) -> list[str]:
        if gateway:
            return gateway_group_command(gateway_command(cfg, paths), CONTAINER_MPIRUN, gpus, per_node)
        return mpi_group_command(CONTAINER_MPIRUN, [["trtllm-llmapi-launch", *command(paths)]] * gpus, per_node)

    bare = "trtllm-serve's OpenAI API, which has no API key: generate, and name a LoRA adapter directory of the "
    bare += "server's in a request's lora_request (TensorRT-LLM loads it)"
    return gpu_serving(
        cfg,
        port_flags={"openai": "--openai-port"} if gateway else {"http": "--port"},
        unauthenticated="the OpenAI gateway only (trtllm-serve listens on the pod's loopback)" if gateway else bare,
        health=("openai" if gateway else "http", HEALTH_ROUTE, HEALTH_ROUTE),
        metrics=None,
        queue_metric=None,
        queue_problem=f"trtllm-serve (TensorRT-LLM {release}) exports no Prometheus gauge of waiting requests "
        "(its /metrics are JSON iteration stats; /prometheus/metrics, with return_perf_metrics, holds latencies): "
        "set deploy.replicas, or use target.trtllm_backend: tensorrt, whose queue the autoscaler reads",
        command=(lambda paths: gateway_command(cfg, paths)) if gateway else command,
        config_files={} if gateway else {OPTIONS_FILE: options_yaml(cfg, options)},
        group_command=group,
    )


# Every registered backend has its deployment (checked at import: a new backend without one fails here, not in deploy).
BACKEND_SERVING = {"tensorrt": engine_serving, "pytorch": llm_api_serving}
if set(BACKEND_SERVING) != set(BACKENDS):
    raise TypeError(f"trtllm backends without a deployment: {set(BACKENDS) ^ set(BACKEND_SERVING)}")


def serving(cfg) -> Serving:
    return BACKEND_SERVING[cfg.target.trtllm_backend](cfg)


# ---------------------------------------------------------------- multi-node groups (LeaderWorkerSet)

# mpirun's remote shell in a group: `kubectl exec` into the worker pod (the LeaderWorkerSet TensorRT-LLM example's
# `-mca plm_rsh_agent kubessh` launch; our script ships in both images' scripts/).
KUBESSH = f"{APP_DIR}/scripts/kubessh"
MPIRUN_GROUP_OPTIONS = f"--allow-run-as-root -mca plm_rsh_agent {KUBESSH}"  # as root; remote shell: kubessh


def mpi_group_command(mpirun: str, ranks: list[list[str]], gpus_per_node: int) -> list[str]:
    """The leader's command: wait until its workers run, then start one rank per GPU of the group with mpirun, one
    `-n 1` application context per rank (MPMD), in rank order."""
    launch = " : ".join(shlex.join(["-n", "1", *rank]) for rank in ranks)
    return _group_script(gpus_per_node, f'exec {mpirun} {MPIRUN_GROUP_OPTIONS} --host "$hosts" {launch}')


def gateway_group_command(serve: list[str], mpirun: str, gpus: int, gpus_per_node: int) -> list[str]:
    """The leader's command in front of trtllm-serve: wait until its workers run, then `serve` (the gateway, with
    trtllm-serve behind it on the leader's loopback) given as --launcher the mpirun that starts trtllm-serve's
    `gpus` ranks over the group under trtllm-llmapi-launch, rank 0 on the leader."""
    launcher = f"{mpirun} {MPIRUN_GROUP_OPTIONS} --host $hosts -n {gpus} trtllm-llmapi-launch"
    return _group_script(gpus_per_node, f'exec {shlex.join(serve)} --launcher "{launcher}"')


def _group_script(gpus_per_node: int, last_line: str) -> list[str]:
    """A leader's `sh -c` script: the group's hosts (leader first, `gpus_per_node` slots each) in $hosts once every
    worker is Ready, then `last_line`.

    The leader's pod name is the first label of LWS_LEADER_ADDRESS; its workers are that name -1 .. -(size - 1),
    the names the LeaderWorkerSet controller gives them."""
    script = f"""set -e
leader="${{LWS_LEADER_ADDRESS%%.*}}"
hosts="$leader:{gpus_per_node}"
i=1
while [ "$i" -lt "$LWS_GROUP_SIZE" ]; do
  until kubectl wait --for=condition=Ready --timeout=60s "pod/$leader-$i" >/dev/null 2>&1; do sleep 5; done
  hosts="$hosts,$leader-$i:{gpus_per_node}"
  i=$((i + 1))
done
{last_line}
"""
    return ["/bin/sh", "-c", script]
