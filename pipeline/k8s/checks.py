"""Offline validation of the manifests, before any is written: schemas first, then what schemas cannot see.

Schemas: core objects against the OpenAPI schemas of `deploy.kubernetes_version` that kubernetes-validate ships (its
strict variant refuses unknown fields, as `kubectl apply --validate=strict` does); a LeaderWorkerSet against the CRD
schema from kubernetes-sigs/lws (`upstream/leaderworkerset.json`; unknown fields refused the same way), and its pod
templates, which that table leaves open, against the core PodTemplate schema. Names: every object's name, namespace,
labels, selectors and annotation keys against the API server's rules (the schemas type them as plain strings).
Cross-checks read the objects back as YAML parses them (not the values that made them), so a mis-generated or edited
manifest is caught: the ports the server command binds against the container ports, probes, Service and scrape
annotation; GPUs per replica against tp x pp and the leader's ranks; memory requests against the plans; references
between objects; and the build config the pods will build (or the image holds) against this build's.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

from pipeline.k8s.manifests import LWS_API, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL, Deployment
from pipeline.k8s_names import CONFIGMAP_KEY, DNS1123_LABEL, LABEL_VALUE, label_key_problem, object_name_problem
from pipeline.upstream import facts


def where(obj: dict, path) -> str:
    """`Kind/name: a.b[0].c` for a field of an object."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {text.lstrip('.') or '(object)'}"


# ---------------------------------------------------------------- schemas


def _core_problems(obj: dict, version: str, prefix: tuple = ()) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:  # the jsonschema error (the first one found)
        return [f"{where(obj, (*prefix, *error.absolute_path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{where(obj, ())}: Kubernetes {version} has no {obj.get('apiVersion')} {obj.get('kind')}"]
    return []


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

    return Draft202012Validator(_strict(facts("leaderworkerset")["schema"]))


def _lws_problems(obj: dict, version: str) -> list[str]:
    problems = [
        f"{where(obj, error.absolute_path)}: {error.message}"
        for error in sorted(_lws_validator().iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]
    name = obj.get("metadata", {}).get("name")
    # the CRD leaves the pod templates to the core schema, as strict as a Deployment's
    for path in facts("leaderworkerset")["pod_templates"]:
        template = obj
        for key in path.split("."):
            template = template.get(key) if isinstance(template, dict) else None
        if template is not None:
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
            problems += [
                p.replace("PodTemplate/", f"{obj['kind']}/", 1).replace(": template", f": {path}", 1)
                for p in _core_problems(pod, version)
            ]
    return problems


def schema_problems(objects: list[dict], version: str) -> list[str]:
    problems = []
    for obj in objects:
        problems += _lws_problems(obj, version) if obj.get("apiVersion") == LWS_API else _core_problems(obj, version)
    return problems


# ---------------------------------------------------------------- names

# Maps of labels (keys and values checked) and of annotations (keys only), wherever they sit in an object; a
# Service's spec.selector is a map of labels too.
LABEL_MAPS = ("labels", "matchLabels", "nodeSelector")


def _maps(node, path: tuple):
    """(path, map, values_are_labels) of every label or annotation map under `node`."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _maps(item, (*path, index))
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in (*LABEL_MAPS, "annotations") and isinstance(value, dict):
                yield (*path, key), value, key != "annotations"
            else:
                yield from _maps(value, (*path, key))


def name_problems(objects: list[dict]) -> list[str]:
    """Every object's name, namespace, label (and annotation) keys, label values and ConfigMap keys against the API
    server's rules, which the OpenAPI schemas leave out (they type them as plain strings)."""
    problems = []
    for obj in objects:
        meta = obj.get("metadata", {})
        found = [(("metadata", "name"), object_name_problem(obj.get("kind"), meta.get("name")))]
        if "namespace" in meta:
            found.append((("metadata", "namespace"), DNS1123_LABEL.problem(meta["namespace"])))
        maps = list(_maps(obj, ()))
        if obj.get("kind") == "Service":
            maps.append((("spec", "selector"), obj.get("spec", {}).get("selector", {}), True))
        for path, mapping, labels in maps:
            for key, value in mapping.items():
                found.append(((*path, key), label_key_problem(key) or (labels and LABEL_VALUE.problem(value))))
        if obj.get("kind") == "ConfigMap":
            found += [(("data", key), CONFIGMAP_KEY.problem(key)) for key in obj.get("data", {})]
        problems += [f"{where(obj, path)}: {problem}" for path, problem in found if problem]
    return problems


def adapter_problems(config: dict, struct: str = "MetricsDiscoveryConfig", path: str = "") -> list[str]:
    """Keys of the adapter config that its Go structs do not have (it would ignore them)."""
    fields = facts("prometheus_adapter")["structs"][struct]
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
        if go_type in facts("prometheus_adapter")["structs"]:
            for item in items:
                problems += adapter_problems(item, go_type, f"{path}{key}.")
    return problems


# ---------------------------------------------------------------- cross-checks


def _templates(workload: dict) -> list[tuple[tuple, dict]]:
    """(path, pod template) of a workload: a Deployment's or Job's, a LeaderWorkerSet's leader then worker."""
    if workload["kind"] in ("Deployment", "Job"):
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
    """A Kubernetes memory quantity in bytes (ValueError for one this reader does not know)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "": 1}
    match = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(quantity))
    if match is None:
        raise ValueError(f"{quantity!r} is not a memory quantity")
    return float(match.group(1)) * units[match.group(2)]


def _guarded(obj: dict, check) -> list[str]:
    """A check of an edited object that lacks what it reads reports that instead of failing."""
    try:
        return check()
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return [f"{where(obj, ())}: cannot be checked, missing or malformed: {type(exc).__name__} {exc}"]


def _memory_problem(obj: dict, path: tuple, container: dict, needed: int, what: str) -> list[str]:
    requested = container["resources"]["requests"]["memory"]
    if _bytes(requested) >= needed:
        return []
    field = where(obj, (*path, "resources", "requests", "memory"))
    return [f"{field}: {requested} is below {what} ({needed / 2**20:,.0f} MiB)"]


def _server_problems(obj: dict, path: tuple, template: dict, dep: Deployment) -> list[str]:
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
    for probe, expected in (("startupProbe", ready), ("readinessProbe", ready), ("livenessProbe", live)):
        get = server.get(probe, {}).get("httpGet")
        if get is None:
            problems.append(f"{where(obj, (*cpath, probe))}: missing; probe {expected} on port '{health_port}'")
            continue
        if declared.get(get["port"], get["port"]) != declared.get(health_port):
            problems.append(
                f"{where(obj, (*cpath, probe, 'httpGet', 'port'))}: {get['port']} is not the port serving "
                f"{expected} ('{health_port}', {declared.get(health_port)})"
            )
        if get.get("path") != expected:
            problems.append(
                f"{where(obj, (*cpath, probe, 'httpGet', 'path'))}: {get.get('path')} is not the server's health "
                f"route {expected}"
            )
    if s.metrics is not None:
        scraped = template.get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
        if scraped is None or int(scraped) != declared.get(s.metrics[0]):
            problems.append(
                f"{where(obj, (*path, 'metadata', 'annotations', 'prometheus.io/port'))}: {scraped} is not the "
                f"metrics port ({declared.get(s.metrics[0])})"
            )
    return problems + _memory_problem(obj, cpath, server, s.memory_bytes + s.shm_bytes, "the memory plan with /dev/shm")


def _gpu_problems(obj: dict, dep: Deployment) -> list[str]:
    """GPUs of one replica (a pod, or a leader and size - 1 workers) must be the ranks tp x pp."""
    pods = []
    for path, template in _templates(obj):
        count = obj["spec"]["leaderWorkerTemplate"].get("size", 1) - 1 if path[-1] == "workerTemplate" else 1
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
    """The leader's mpirun starts one rank per GPU of the group: its `-n K` application contexts add up to tp x pp
    (mpirun run directly, or handed to `serve` as one quoted --launcher word)."""
    path, leader = _templates(obj)[0]
    words = _tokens(leader["spec"]["containers"][0]["command"])
    tokens = [token for word in words for token in (shlex.split(word) if " " in word else [word])]
    ranks = sum(int(tokens[i + 1]) for i, token in enumerate(tokens[:-1]) if token in ("-n", "-np"))
    if ranks == dep.serving.gpus:
        return []
    return [
        f"{where(obj, (*path, 'spec', 'containers', 0, 'command'))}: mpirun starts {ranks} ranks, not one per GPU of "
        f"the group ({dep.serving.gpus} = tp x pp)"
    ]


def _selects(service: dict, workload: dict) -> bool:
    """Whether the Service's selector picks the workload's serving pods (a LeaderWorkerSet's: its leaders, by the
    labels its controller gives them)."""
    selector = service["spec"]["selector"]
    if workload["kind"] == "LeaderWorkerSet":
        expected = {LWS_NAME_LABEL: workload["metadata"]["name"], LWS_WORKER_INDEX_LABEL: "0"}
        return all(selector.get(k) == v for k, v in expected.items())
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _reference_problems(objects: list[dict], cfg) -> list[str]:
    """Volumes, the Service, the HPA: each names something that exists and matches."""
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    problems = []
    external = {cfg.deploy.storage.models_claim} | (set() if cfg.deploy.storage.create else {cfg.deploy.storage.claim})
    for workload in (o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet", "Job")):
        for path, template in _templates(workload):
            for i, volume in enumerate(template["spec"].get("volumes", [])):
                if "configMap" in volume and volume["configMap"]["name"] not in by_kind.get("ConfigMap", {}):
                    problems.append(f"{where(workload, (*path, 'spec', 'volumes', i))}: no such ConfigMap")
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim not in by_kind.get("PersistentVolumeClaim", {}) and claim not in external:
                    problems.append(f"{where(workload, (*path, 'spec', 'volumes', i))}: no such claim {claim}")
    servers = [o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet")]
    for service in by_kind.get("Service", {}).values():
        if service["metadata"]["name"] in by_kind.get("LeaderWorkerSet", {}):
            problems.append(
                f"{where(service, ('metadata', 'name'))}: the LeaderWorkerSet controller names its group's headless "
                "Service so; it would not create it (the pods' DNS breaks)"
            )
        targets = [w for w in servers if _selects(service, w)]
        if not targets:
            problems.append(f"{where(service, ('spec', 'selector'))}: selects no serving pods")
            continue
        server = _templates(targets[0])[0][1]["spec"]["containers"][0]
        names = {p.get("name") for p in server.get("ports", [])} | {p["containerPort"] for p in server.get("ports", [])}
        for i, port in enumerate(service["spec"]["ports"]):
            if port.get("targetPort") not in names:
                problems.append(
                    f"{where(service, ('spec', 'ports', i, 'targetPort'))}: {port.get('targetPort')} is no port of "
                    "the server container"
                )
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["name"] not in by_kind.get(ref["kind"], {}):
            problems.append(f"{where(hpa, ('spec', 'scaleTargetRef'))}: no {ref['kind']} {ref['name']}")
    return problems


def _config_problems(objects: list[dict], dep: Deployment, cfg) -> list[str]:
    """The pods build (or find built) exactly this config: the ConfigMap's copy, or the file the image was built
    from, must give this build's stage inputs."""
    import tempfile

    from pipeline.errors import ConfigError
    from pipeline.validation import load_config

    name = Path(dep.paths.config).name
    if dep.placement == "image":
        shipped, where_ = load_config(cfg.source), f"{cfg.source}"
    else:
        found = next((o for o in objects if o["kind"] == "ConfigMap" and name in o.get("data", {})), None)
        if found is None:
            return [f"ConfigMap: none holds {name}, the config the pods build"]
        where_ = where(found, ("data", name))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / name).write_text(found["data"][name])
            try:
                shipped = load_config(Path(tmp) / name)
            except ConfigError as exc:
                return [f"{where_}: the pods could not load it: {exc}"]
    differ = [key for key, value in _stage_inputs(cfg).items() if _stage_inputs(shipped).get(key) != value]
    if not differ:
        return []
    fix = "put the overrides in the file (the image is built from it), or use deploy.artifacts: volume"
    return [f"{where_}: the pods would build other {', '.join(differ)} values than this config; {fix}"]


def _stage_inputs(cfg) -> dict:
    """The config values the stages read, by section, with file paths absolute (where the pod resolves them)."""
    from pipeline.k8s.manifests import with_absolute_paths

    return with_absolute_paths(cfg.model_dump(mode="json", exclude={"deploy"}), cfg)


def manifest_problems(objects: list[dict], dep: Deployment, cfg, adapter: dict | None) -> list[str]:
    """Everything wrong with the manifests, each naming the object and field (empty: they may be applied)."""
    problems = schema_problems(objects, cfg.deploy.kubernetes_version) + name_problems(objects)
    if problems:  # cross-checks read fields the schema vouches for
        return problems
    s = dep.serving
    for obj in objects:
        if obj["kind"] in ("Deployment", "LeaderWorkerSet"):
            path, template = _templates(obj)[0]
            problems += _guarded(obj, lambda: _server_problems(obj, path, template, dep))
            problems += _guarded(obj, lambda: _gpu_problems(obj, dep))
            if obj["kind"] == "LeaderWorkerSet":
                problems += _guarded(obj, lambda: _rank_problems(obj, dep))
        if obj["kind"] == "Job":
            path = ("spec", "template", "spec", "containers", 0)
            container = obj["spec"]["template"]["spec"]["containers"][0]
            problems += _guarded(
                obj, lambda: _memory_problem(obj, path, container, s.build_memory_bytes, "the build's memory plan")
            )
    problems += _guarded({"kind": "objects", "metadata": {}}, lambda: _reference_problems(objects, cfg))
    problems += _config_problems(objects, dep, cfg)
    if adapter is not None:
        problems += adapter_problems(adapter)
    return problems
