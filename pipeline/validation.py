"""A build config checked against its target: the layer above both `pipeline.config` (which knows no target) and
the target registry (`pipeline.targets`, whose protocol types its methods with the config). `load_config` here is the
one every command uses.

The target's rules: every field set must be one the target reads (`unhonoured_problems`), the deploy section's
ports and gateway as the target serves them, the target's own rules (`Target.config_problems`) and whether it
takes the checkpoint's architecture.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.architectures import support_problem
from pipeline.config import BuildConfig
from pipeline.config.loading import read_config
from pipeline.errors import shown
from pipeline.targets import Problem, honoured, target_of, unhonoured_problems


def load_config(path: str | Path, overrides: list[str] | None = None) -> BuildConfig:
    """Parse a YAML build config and validate it fully, its target's rules included.

    Raises:
        ConfigError: listing every problem, each with file, line, field and fix.
    """
    return read_config(path, overrides, target_problems)


def target_problems(cfg: BuildConfig) -> list[Problem]:
    """Every rule over `cfg` that needs its target."""
    target = target_of(cfg)
    out = unhonoured_problems(cfg) + _deploy_problems(cfg) + target.config_problems(cfg)
    facts = cfg.model_facts()
    if facts is not None:
        unsupported = support_problem(facts.architecture, cfg.target.name, target.architecture_support(cfg))
        if unsupported:
            out.append((("model", "path"), unsupported))
    return out


def _deploy_problems(cfg: BuildConfig) -> list[tuple[tuple, str]]:
    """What `validate` refuses in the deploy section: values that contradict each other or the parallelism. Only
    fields the target reads count (a port or gateway its server does not open is not checked)."""
    from kubernetes_validate.utils import all_versions

    d, out = cfg.deploy, []
    versions = sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    if ".".join(d.kubernetes_version.split(".")[:2]) not in versions:
        out.append(
            (
                ("deploy", "kubernetes_version"),
                f"{shown(d.kubernetes_version)}: kubernetes-validate has the schemas of {versions[0]} to "
                f"{versions[-1]} (quote the version: YAML reads an unquoted 1.30 as 1.3)",
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
    fields = target_of(cfg).fields_read(cfg)
    gateway = d.openai_gateway and honoured("deploy.openai_gateway", fields)
    used = {
        name: getattr(d.ports, name) for name in ("http", "grpc", "metrics") if honoured(f"deploy.ports.{name}", fields)
    }
    if gateway:
        used["openai"] = d.ports.openai
    seen: dict[int, str] = {}
    for name, port in used.items():
        if port in seen:
            out.append((("deploy", "ports", name), f"{port} is also deploy.ports.{seen[port]}; give each its own"))
        seen.setdefault(port, name)
    if d.api_key_secret and not d.openai_gateway:
        out.append((("deploy", "api_key_secret"), "there is no gateway to protect: deploy.openai_gateway is false"))
    if d.service_type != "ClusterIP" and gateway and not d.api_key_secret:
        out.append(
            (
                ("deploy", "api_key_secret"),
                f"service_type {d.service_type} exposes the OpenAI gateway outside the cluster without a key: name "
                "a Secret holding `api-key`, or set openai_gateway: false",
            )
        )
    return out
