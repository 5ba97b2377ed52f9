"""Tabulate the keys of prometheus-adapter's discovery config (kubernetes-sigs/prometheus-adapter pkg/config/config.go
at `COMMIT`) into `pipeline/upstream/prometheus_adapter.json` (run by scripts/dev/tabulate_all.py), so the rule
`trtllm-pipeline deploy` writes is checked against them: per struct, each field's YAML key, Go type and whether it
is `omitempty`.
"""

from __future__ import annotations

import re

from upstream_source import Upstream, cite

REPO = "kubernetes-sigs/prometheus-adapter"
CONFIG = "pkg/config/config.go"
COMMIT = "01919d0ef11859bc214e0c8a8bd5368afd9d47f7"  # committed 2025-04-01
STRUCT = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.M | re.S)
FIELD = re.compile(r"^\s+(\w+)\s+(\S+)\s+`[^`]*yaml:\"([^\"]+)\"", re.M)


def tabulate(upstream: Upstream) -> dict:
    return {"source": cite(REPO, CONFIG, COMMIT), "structs": struct_fields(upstream.read(REPO, CONFIG, COMMIT))}


def struct_fields(text: str) -> dict[str, dict]:
    """Every struct of a Go file: its fields with a yaml tag, keyed by that tag's name."""
    structs = {}
    for name, body in STRUCT.findall(text):
        fields = {}
        for go_name, go_type, tag in FIELD.findall(body):
            key, *options = tag.split(",")
            fields[key] = {"field": go_name, "type": go_type, "omitempty": "omitempty" in options}
        structs[name] = fields
    if "DiscoveryRule" not in structs or "MetricsDiscoveryConfig" not in structs:
        raise ValueError(f"{CONFIG} has no DiscoveryRule and MetricsDiscoveryConfig: the layout changed")
    return structs
