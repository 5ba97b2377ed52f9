"""Stage `deploy`: Kubernetes manifests for the config, validated offline, in `<output>/deploy/k8s/`.

Run on request (`trtllm-pipeline deploy`, or `build --until deploy`), not by every build. It needs no earlier
stage's output: the manifests are a function of the config (which the pods build, from a ConfigMap, into the image
or a claim), of the target's serving facts and of the schemas they are checked against -- so it runs on a machine
that cannot build a GPU engine, and its lock entry changes only with those.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.config import BuildConfig
from pipeline.errors import BuildStepError
from pipeline.k8s import checks, serving_of
from pipeline.k8s.manifests import adapter_config, plan_deployment, render, requirement_problems
from pipeline.upstream import TABLES

NAME = "deploy"
# The ConfigMap holds the whole config, so every section is an input.
READS = ("model", "target", "quantization", "parallel", "build", "runtime", "triton", "verify", "deploy", "lora")
TOOLS = ("kubernetes-validate", "tritonclient")
SOURCES: tuple[Path, ...] = (TABLES / "leaderworkerset.json", TABLES / "prometheus_adapter.json")
AFTER: tuple[str, ...] = ()  # no earlier stage's output is an input
ON_REQUEST = True
MANIFESTS = "k8s"
ADAPTER_CONFIG = "prometheus-adapter-config.yaml"


class _Dumper(yaml.SafeDumper):
    """Plain YAML for humans and kubectl: no anchors for repeated dicts, multi-line strings as literal blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def dump(obj) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def applies(cfg: BuildConfig) -> str | None:
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    return []


def writes(cfg: BuildConfig) -> str:
    return (
        f"Kubernetes manifests ({MANIFESTS}/, kustomization.yaml), validated against Kubernetes "
        f"{cfg.deploy.kubernetes_version}"
    )


def stem(cfg: BuildConfig) -> str:
    return cfg.source.stem if cfg.source else "config"


def run(cfg: BuildConfig, ctx) -> dict:
    serving = serving_of(cfg)
    dep = plan_deployment(cfg, serving, stem(cfg))
    missing = requirement_problems(cfg, dep)
    if missing:
        raise BuildStepError("; ".join(missing))
    texts = [dump(obj) for obj in render(cfg, dep)]
    objects = [yaml.safe_load(text) for text in texts]  # checked as kubectl will read them
    adapter = adapter_config(cfg, dep)
    problems = checks.manifest_problems(objects, dep, cfg, adapter)
    if problems:
        raise BuildStepError("the manifests would not apply as meant:\n  " + "\n  ".join(problems))
    out = ctx.out_dir / MANIFESTS
    out.mkdir()
    files = [f"{index:02d}-{obj['kind'].lower()}.yaml" for index, obj in enumerate(objects)]
    for name, text in zip(files, texts):
        (out / name).write_text(text)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": files}
    (out / "kustomization.yaml").write_text(dump(kustomization))
    if adapter is not None:
        metric = serving.queue_metric
        (ctx.out_dir / ADAPTER_CONFIG).write_text(
            f"# prometheus-adapter discovery rule: the HPA's custom metric {metric.name} from {metric.series} "
            f"({metric.source})\n" + dump(adapter)
        )
    kinds = [obj["kind"] for obj in objects]
    ctx.log(f"{len(objects)} objects valid for Kubernetes {cfg.deploy.kubernetes_version}: {', '.join(kinds)}")
    return {
        "name": dep.name,
        "namespace": cfg.deploy.namespace,
        "objects": kinds,
        "placement": dep.placement,
        "pods_per_replica": dep.pods,
        "gpus_per_pod": dep.gpus_per_pod,
        "memory_request_bytes": serving.memory_bytes + serving.shm_bytes,
    }
