"""Offline validation of the manifests, before any is written: schemas first, then what schemas cannot see.

Schemas: core objects against the OpenAPI schemas of `deploy.kubernetes_version` that kubernetes-validate ships (its
strict variant refuses unknown fields, as `kubectl apply --validate=strict` does); a LeaderWorkerSet against the CRD
schema tabulated from kubernetes-sigs/lws (`leaderworkerset.json`, unknown fields refused the same way), and its pod
templates against the core PodTemplate schema. Cross-checks read the objects back (not the values that made them),
so an edited or mis-generated manifest is caught: the ports the server command binds against the container ports,
probes, Service and scrape annotation; GPUs per replica against tp x pp; memory requests against the plan;
references between objects; and the build config the pods will build against this build's.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from pathlib import Path

from pipeline.k8s.manifests import LWS_API, Deployment

HERE = Path(__file__).parent


def where(obj: dict, path) -> str:
    """`Kind/name: a.b[0].c` for a field of an object."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {text.lstrip('.') or '(object)'}"


# ---------------------------------------------------------------- schemas


def supported_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions

    return sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))


def _core_problems(obj: dict, version: str, prefix: tuple = ()) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:  # the jsonschema error (the first one found)
        return [f"{where(obj, (*prefix, *error.absolute_path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{where(obj, ())}: Kubernetes {version} has no {obj.get('apiVersion')} {obj.get('kind')}"]
    return []


@functools.cache
def lws_facts() -> dict:
    return json.loads((HERE / "leaderworkerset.json").read_text())


def _strict(schema: dict) -> dict:
    """The CRD schema refusing unknown fields where it lists properties (the API server would prune them silently)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def _lws_validator():
    from jsonschema import Draft202012Validator

    return Draft202012Validator(_strict(lws_facts()["schema"]))


def _lws_problems(obj: dict, version: str) -> list[str]:
    problems = [
        f"{where(obj, error.absolute_path)}: {error.message}"
        for error in sorted(_lws_validator().iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
    meta = obj.get("metadata", {})
    for role in ("leaderTemplate", "workerTemplate"):
        template = obj.get("spec", {}).get("leaderWorkerTemplate", {}).get(role)
        if template is not None:  # the core schema of the pods, as strict as a Deployment's
            pod = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": meta.get("name")},
                "template": template,
            }
            problems += [
                p.replace("PodTemplate/", f"{obj['kind']}/", 1).replace(
                    ": template", f": spec.leaderWorkerTemplate.{role}"
                )
                for p in _core_problems(pod, version)
            ]
    return problems


def schema_problems(objects: list[dict], version: str) -> list[str]:
    problems = []
    for obj in objects:
        problems += _lws_problems(obj, version) if obj.get("apiVersion") == LWS_API else _core_problems(obj, version)
    return list(dict.fromkeys(problems))  # the CRD and the core schema may both refuse a pod template's field


@functools.cache
def _adapter_structs() -> dict:
    return json.loads((HERE / "prometheus_adapter.json").read_text())["structs"]


def adapter_problems(config: dict, struct: str = "MetricsDiscoveryConfig", path: str = "") -> list[str]:
    """Keys of the adapter config that its Go structs do not have (it would ignore them)."""
    fields = _adapter_structs()[struct]
    problems = []
    for key, value in config.items():
        if key not in fields:
            problems.append(f"prometheus-adapter config: {path}{key}: unknown key; known: {', '.join(fields)}")
            continue
        go_type = fields[key]["type"].lstrip("*[]")
        if go_type.startswith("map[string]"):
            go_type, items = go_type.removeprefix("map[string]"), list(value.values())
        else:
            items = value if isinstance(value, list) else [value]
        if go_type in _adapter_structs():
            for item in items:
                problems += adapter_problems(item, go_type, f"{path}{key}.")
    return problems


# ---------------------------------------------------------------- cross-checks


def _templates(workload: dict) -> list[tuple[tuple, dict]]:
    """(path, pod template) of a workload; a LeaderWorkerSet's leader first."""
    if workload["kind"] == "Deployment":
        return [(("spec", "template"), workload["spec"]["template"])]
    group = workload["spec"]["leaderWorkerTemplate"]
    return [
        (("spec", "leaderWorkerTemplate", "leaderTemplate"), group["leaderTemplate"]),
        (("spec", "leaderWorkerTemplate", "workerTemplate"), group["workerTemplate"]),
    ]


def _tokens(command: list[str]) -> list[str]:
    """A container command's words, looking inside `sh -c SCRIPT`."""
    if len(command) >= 3 and command[0].endswith("sh") and command[1] == "-c":
        return shlex.split(command[2].replace(";", " ; "))
    return command


def _option(tokens: list[str], flag: str) -> str | None:
    for i, token in enumerate(tokens):
        if token == flag and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * units.get(unit, 1)


def _server_problems(obj: dict, path: tuple, template: dict, dep: Deployment, cfg) -> list[str]:
    """The server container: its command's ports against its declared ports, probes and the scrape annotation."""
    s = dep.serving
    containers = template["spec"]["containers"]
    index = next((i for i, c in enumerate(containers) if c["name"] == "server"), None)
    if index is None:
        return [f"{where(obj, (*path, 'spec', 'containers'))}: no container named server"]
    server, cpath = containers[index], (*path, "spec", "containers", index)
    declared = {p.get("name"): p["containerPort"] for p in server.get("ports", [])}
    problems = []
    tokens = _tokens(server["command"])
    for name, flag in s.port_flags.items():
        bound = _option(tokens, flag)
        if name not in declared:
            problems.append(f"{where(obj, (*cpath, 'ports'))}: declares no port '{name}' (the command binds {flag})")
        elif bound is None or int(bound) != declared[name]:
            problems.append(
                f"{where(obj, (*cpath, 'ports'))}: port '{name}' is {declared[name]} but the command binds "
                f"{flag} {bound}; make them equal (deploy.ports.{name})"
            )
    health_port, ready, live = s.health
    for probe, path_expected in (("startupProbe", ready), ("readinessProbe", ready), ("livenessProbe", live)):
        get = server.get(probe, {}).get("httpGet")
        if get is None:
            problems.append(f"{where(obj, (*cpath, probe))}: missing; probe {path_expected} on port '{health_port}'")
            continue
        port = declared.get(get["port"], get["port"])
        if port != declared.get(health_port):
            problems.append(
                f"{where(obj, (*cpath, probe, 'httpGet', 'port'))}: {get['port']} is not the port serving "
                f"{path_expected} ('{health_port}', {declared.get(health_port)})"
            )
        if get.get("path") != path_expected:
            problems.append(
                f"{where(obj, (*cpath, probe, 'httpGet', 'path'))}: {get.get('path')} is not the server's health "
                f"route {path_expected}"
            )
    if s.metrics is not None:
        scraped = template["metadata"].get("annotations", {}).get("prometheus.io/port")
        if scraped is None or int(scraped) != declared.get(s.metrics[0]):
            problems.append(
                f"{where(obj, (*path, 'metadata', 'annotations', 'prometheus.io/port'))}: {scraped} is not the "
                f"metrics port ({declared.get(s.metrics[0])})"
            )
    memory = _bytes(server["resources"]["requests"]["memory"])
    if memory < s.memory_bytes + s.shm_bytes:
        problems.append(
            f"{where(obj, (*cpath, 'resources', 'requests', 'memory'))}: {server['resources']['requests']['memory']} "
            f"is below the memory plan ({(s.memory_bytes + s.shm_bytes) / 2**20:,.0f} MiB with /dev/shm)"
        )
    for i, init in enumerate(template["spec"].get("initContainers", [])):
        requested = _bytes(init["resources"]["requests"]["memory"])
        if requested < s.build_memory_bytes:
            problems.append(
                f"{where(obj, (*path, 'spec', 'initContainers', i, 'resources', 'requests', 'memory'))}: "
                f"{init['resources']['requests']['memory']} is below the build's plan "
                f"({s.build_memory_bytes / 2**20:,.0f} MiB)"
            )
    return problems


def _gpu_problems(obj: dict, dep: Deployment) -> list[str]:
    """GPUs of one replica (a pod, or a leader and size - 1 workers) must be the ranks tp x pp."""
    pods = []
    for path, template in _templates(obj):
        count = 1
        if path[-1] == "workerTemplate":
            count = obj["spec"]["leaderWorkerTemplate"].get("size", 1) - 1
        for i, container in enumerate(template["spec"]["containers"]):
            gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            pods.append((count * gpus, (*path, "spec", "containers", i, "resources", "limits", "nvidia.com/gpu")))
    total = sum(g for g, _ in pods)
    if total == dep.serving.gpus:
        return []
    field = next((p for g, p in pods if g), pods[0][1])
    return [
        f"{where(obj, field)}: one replica gets {total} GPUs but tp x pp is {dep.serving.gpus} ranks; use "
        "deploy.gpus_per_node dividing tp x pp"
    ]


def _rank_problems(obj: dict, dep: Deployment) -> list[str]:
    """The leader's mpirun starts one rank per GPU of the group."""
    path, leader = _templates(obj)[0]
    np = _option(_tokens(leader["spec"]["containers"][0]["command"]), "-np")
    if np is not None and int(np) == dep.serving.gpus:
        return []
    return [
        f"{where(obj, (*path, 'spec', 'containers', 0, 'command'))}: mpirun -np {np} does not start one rank per "
        f"GPU of the group ({dep.serving.gpus} = tp x pp)"
    ]


def _reference_problems(objects: list[dict], cfg) -> list[str]:
    """Volumes, the Service, the HPA: each names something that exists and matches."""
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    problems = []
    workloads = [o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet")]
    for workload in workloads:
        for path, template in _templates(workload):
            for i, volume in enumerate(template["spec"].get("volumes", [])):
                if "configMap" in volume and volume["configMap"]["name"] not in by_kind.get("ConfigMap", {}):
                    problems.append(f"{where(workload, (*path, 'spec', 'volumes', i))}: no such ConfigMap")
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                external = {cfg.deploy.storage.models_claim} | (set() if cfg.deploy.storage.create else {claim})
                if claim and claim not in by_kind.get("PersistentVolumeClaim", {}) and claim not in external:
                    problems.append(f"{where(workload, (*path, 'spec', 'volumes', i))}: no such claim {claim}")
    for service in by_kind.get("Service", {}).values():
        selector = service["spec"]["selector"]
        targets = [
            (w, t)
            for w in workloads
            for _, t in _templates(w)[:1]
            if all(
                t["metadata"].get("labels", {}).get(k) == v for k, v in selector.items() if "leaderworkerset" not in k
            )
        ]
        if not targets:
            problems.append(f"{where(service, ('spec', 'selector'))}: selects no serving pod template")
            continue
        server = targets[0][1]["spec"]["containers"][0]
        names = {p.get("name") for p in server.get("ports", [])} | {p["containerPort"] for p in server.get("ports", [])}
        for i, port in enumerate(service["spec"]["ports"]):
            if port["targetPort"] not in names:
                problems.append(
                    f"{where(service, ('spec', 'ports', i, 'targetPort'))}: {port['targetPort']} is no port of the "
                    "server container"
                )
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["name"] not in by_kind.get(ref["kind"], {}):
            problems.append(f"{where(hpa, ('spec', 'scaleTargetRef'))}: no {ref['kind']} {ref['name']}")
    return problems


def _config_problems(objects: list[dict], dep: Deployment, cfg) -> list[str]:
    """The pods build the ConfigMap's config: it must load and give the same stage inputs as this build's."""
    import tempfile

    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    config_maps = [o for o in objects if o["kind"] == "ConfigMap"]
    name = Path(dep.paths.config).name
    found = next((o for o in config_maps if name in o.get("data", {})), None)
    if found is None:
        return [f"ConfigMap: none holds {name}, the config the pods build"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(found["data"][name])
        try:
            shipped = load_config(Path(tmp) / name)
        except ConfigError as exc:
            return [f"{where(found, ('data', name))}: the pods could not load it: {exc}"]
    if _stage_inputs(shipped) != _stage_inputs(cfg):
        return [f"{where(found, ('data', name))}: builds something else than this config (its stage inputs differ)"]
    return []


def _stage_inputs(cfg) -> dict:
    """The config values every stage reads, paths resolved (the lock's params, where the config file is moot)."""
    data = cfg.model_dump(mode="json", exclude={"deploy"})
    if cfg.model.path:
        data["model"]["path"] = str(cfg.resolve_path(cfg.model.path))
    return data


def manifest_problems(objects: list[dict], dep: Deployment, cfg, adapter: dict | None) -> list[str]:
    """Everything wrong with the manifests, each naming the object and field (empty: they may be applied)."""
    problems = schema_problems(objects, cfg.deploy.kubernetes_version)
    if problems:  # cross-checks read fields the schema vouches for
        return problems
    for obj in objects:
        if obj["kind"] in ("Deployment", "LeaderWorkerSet"):
            path, template = _templates(obj)[0]
            problems += _server_problems(obj, path, template, dep, cfg)
            problems += _gpu_problems(obj, dep)
            if obj["kind"] == "LeaderWorkerSet":
                problems += _rank_problems(obj, dep)
    problems += _reference_problems(objects, cfg)
    problems += _config_problems(objects, dep, cfg)
    if adapter is not None:
        problems += adapter_problems(adapter)
    return problems
