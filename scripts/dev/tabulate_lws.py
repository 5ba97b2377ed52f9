"""Tabulate the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) facts the Kubernetes manifests rely on, from
kubernetes-sigs/lws at `COMMIT`, into `pipeline/upstream/leaderworkerset.json` (run by scripts/dev/tabulate_all.py).

- group / version / kind / plural / scope ...: from the generated CRD.
- `schema`: the v1 `openAPIV3Schema` without its prose (`description`), each pod template in it reduced to
  `POD_TEMPLATE` and listed in `pod_templates`: the checks validate those with the core PodTemplateSpec schema
  that kubernetes-validate ships, so the table does not repeat it. `schema_keywords` counts the OpenAPI-only
  keys a JSON-schema validator meets in it.
- `env`: the variables the pod webhook gives every container, each as the parts its value is joined from.
- `labels`: the `leaderworkerset.sigs.k8s.io/*` keys, each a label, an annotation or both.
- `worker_pods`: the workers of a group are a StatefulSet named after the leader pod, numbered from `first_ordinal`.
"""

from __future__ import annotations

import re
from collections import Counter

import yaml
from upstream_source import Upstream, cite

REPO = "kubernetes-sigs/lws"
COMMIT = "060ab4da17eea1f0865fcbd3236bb1075e2cea32"  # main of 2026-08-21
CRD = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
TYPES = "api/leaderworkerset/v1/leaderworkerset_types.go"
POD_UTILS = "pkg/utils/pod/pod_utils.go"
LWS_CONTROLLER = "pkg/controllers/leaderworkerset_controller.go"
POD_CONTROLLER = "pkg/controllers/pod_controller.go"
LABEL_PREFIX = "leaderworkerset.sigs.k8s.io/"
# Keys of a structural schema that are not JSON-schema keywords, or that a JSON-schema validator treats differently.
OPENAPI_ONLY = ("x-kubernetes-", "nullable", "format")
# What a pod template's schema becomes: any object, validated elsewhere against the core PodTemplateSpec schema.
POD_TEMPLATE = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def tabulate(upstream: Upstream) -> dict:
    def read(path: str) -> str:
        return upstream.read(REPO, path, COMMIT)

    consts = go_string_constants(read(TYPES))
    pod_utils, pod_controller = read(POD_UTILS), read(POD_CONTROLLER)
    return {
        "sources": [cite(REPO, path, COMMIT) for path in (CRD, TYPES, POD_UTILS, LWS_CONTROLLER, POD_CONTROLLER)],
        **crd_facts(read(CRD)),
        "env": env_facts(pod_utils, consts),
        "labels": label_kinds(consts, [read(LWS_CONTROLLER), pod_controller, pod_utils]),
        "worker_pods": worker_pod_facts(pod_controller),
    }


def crd_facts(text: str) -> dict:
    """The v1 version of a CRD: its names, and its schema without prose and with pod templates reduced."""
    crd = yaml.safe_load(text)
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v["name"] == "v1"]
    templates: list[str] = []
    schema = reduced(version["schema"]["openAPIV3Schema"], (), templates)
    keywords = count_keywords(schema, Counter())
    return {
        "group": spec["group"],
        "version": version["name"],
        "kind": spec["names"]["kind"],
        "plural": spec["names"]["plural"],
        "short_names": spec["names"].get("shortNames", []),
        "scope": spec["scope"],
        "served": version["served"],
        "storage": version["storage"],
        "subresources": sorted(version.get("subresources", {})),
        "controller_gen": crd["metadata"].get("annotations", {}).get("controller-gen.kubebuilder.io/version"),
        "pod_templates": templates,
        "schema_keywords": {k: n for k, n in sorted(keywords.items()) if k.startswith(OPENAPI_ONLY)},
        "schema": schema,
    }


def is_pod_template(node: dict) -> bool:
    """A PodTemplateSpec: an object of exactly `metadata` and a `spec` that has containers."""
    properties = node.get("properties", {})
    return set(properties) == {"metadata", "spec"} and "containers" in properties["spec"].get("properties", {})


def reduced(node, path: tuple[str, ...], templates: list[str]):
    """`node` without `description` at any schema position (children of `properties` are names, not keywords,
    so a property called `description` stays) and with each pod template replaced by POD_TEMPLATE, its dotted
    path appended to `templates`."""
    if isinstance(node, list):
        return [reduced(item, path, templates) for item in node]
    if not isinstance(node, dict):
        return node
    if path and is_pod_template(node):
        templates.append(".".join(path))
        return dict(POD_TEMPLATE)
    out = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: reduced(sub, (*path, name), templates) for name, sub in value.items()}
        else:
            out[key] = reduced(value, path, templates)
    return out


def count_keywords(node, counts: Counter) -> Counter:
    """Count schema keywords (and `format` values) so the validator knows what it must handle."""
    if isinstance(node, list):
        for item in node:
            count_keywords(item, counts)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "properties":
                for sub in value.values():
                    count_keywords(sub, counts)
                continue
            counts[f"format: {value}" if key == "format" else key] += 1
            if key not in ("enum", "default", "required", "x-kubernetes-list-map-keys"):
                count_keywords(value, counts)
    return counts


_CONST = re.compile(r"^\s*([A-Z]\w*)\s+(?:[\w.]+\s+)?=\s*\"([^\"]*)\"", re.M)


def go_string_constants(text: str) -> dict[str, str]:
    """String constants (`Name [type] = "value"`) of the `const (...)` blocks of a Go file."""
    consts = {}
    for block in re.findall(r"^const \((.*?)^\)", text, re.M | re.S):
        consts.update(_CONST.findall(block))
    return consts


_ENV_VAR = re.compile(r"EnvVar\{\s*Name:\s*(?:\w+\.)?(\w+),\s*Value:\s*(.+?),?\s*\}", re.S)
_FROM_MAP = re.compile(r"(\w+), found := \w+\.(Labels|Annotations)\[(?:\w+\.)?(\w+)\]")
_FORMAT = re.compile(r"fmt\.Sprintf\(\"([^\"]*)\",\s*(.+)\)", re.S)
_POD_FIELD = re.compile(r"\w+\.(Spec|ObjectMeta)\.(\w+)")


def env_facts(text: str, consts: dict[str, str]) -> dict[str, dict]:
    """Each `EnvVar{Name: <constant>, Value: ...}` of a Go file: its name and the parts its value is joined from,
    each a literal string or where the value comes from ({"label": key}, {"annotation": key}, {"field": path})."""
    origins = {
        var: {"label" if where == "Labels" else "annotation": consts[const]}
        for var, where, const in _FROM_MAP.findall(text)
    }

    def origin(argument: str) -> dict:
        argument = argument.strip()
        if argument in origins:
            return origins[argument]
        field = _POD_FIELD.fullmatch(argument)
        if field is None:
            raise ValueError(f"env value from {argument!r}: no label, annotation or pod field; the layout changed")
        section = "spec" if field.group(1) == "Spec" else "metadata"
        return {"field": f"{section}.{field.group(2)[0].lower()}{field.group(2)[1:]}"}

    env = {}
    for const, value in _ENV_VAR.findall(text):
        if const not in consts:
            continue
        formatted = _FORMAT.fullmatch(value.strip())
        if formatted is None:
            parts = [origin(value)]
        else:
            literals = formatted.group(1).split("%s")
            arguments = iter(formatted.group(2).split(","))
            parts = [literals[0]]
            for literal in literals[1:]:
                parts += [origin(next(arguments)), *([literal] if literal else [])]
            parts = [part for part in parts if part != ""]
        env[consts[const]] = {"const": const, "value": parts}
    return env


def label_kinds(consts: dict[str, str], texts: list[str], prefix: str = LABEL_PREFIX) -> dict[str, dict]:
    """Each constant key under `prefix`: its constant, and whether it is a label or an annotation (by its name, or
    by a map it indexes in `texts`)."""
    labels = {}
    for name, key in sorted(consts.items(), key=lambda item: item[1]):
        if not key.startswith(prefix):
            continue
        kinds = set()
        for kind, map_name in (("label", "Labels"), ("annotation", "Annotations")):
            used = rf"{map_name}\[(?:\w+\.)?{name}\]"
            if kind.capitalize() in name or any(re.search(used, text) for text in texts):
                kinds.add(kind)
        labels[key] = {"const": name, "kind": sorted(kinds)}
    return labels


_WORKER_SET = re.compile(
    r"StatefulSet\((\w+)\.Name,.*?WithOrdinals\(\w+\.StatefulSetOrdinals\(\)\.WithStart\((\d+)\)", re.S
)


def worker_pod_facts(text: str) -> dict:
    """The workers' StatefulSet (of the pod controller): named after the leader pod, its first ordinal."""
    found = _WORKER_SET.search(text)
    if found is None or "leader" not in found.group(1).lower():
        raise ValueError("no worker StatefulSet named after the leader pod with set ordinals: the layout changed")
    return {"statefulset_named_after": "leader pod", "first_ordinal": int(found.group(2))}
