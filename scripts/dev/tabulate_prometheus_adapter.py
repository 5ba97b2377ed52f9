"""Tabulate the keys of prometheus-adapter's discovery config (kubernetes-sigs/prometheus-adapter pkg/config/config.go)
into `pipeline/k8s/prometheus_adapter.json`, so the rule `trtllm-pipeline deploy` writes is checked against them.

Maintainer tool, not run by the pipeline. Reads the Go structs with `git show` (no code is copied): per struct, each
field's YAML key, Go type and whether it is `omitempty`.

    python scripts/dev/tabulate_prometheus_adapter.py --git <prometheus-adapter mirror> \\
        --out pipeline/k8s/prometheus_adapter.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

REPO = "kubernetes-sigs/prometheus-adapter"
CONFIG = "pkg/config/config.go"
STRUCT = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.M | re.S)
FIELD = re.compile(r"^\s+(\w+)\s+(\S+)\s+`[^`]*yaml:\"([^\"]+)\"", re.M)


def git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(mirror), *args], check=True, capture_output=True, text=True).stdout


def tabulate(mirror: Path, rev: str) -> dict:
    commit, date = git(mirror, "log", "-1", "--format=%H %cs", rev).split()
    source = git(mirror, "show", f"{commit}:{CONFIG}")
    structs = {}
    for name, body in STRUCT.findall(source):
        fields = {}
        for go_name, go_type, tag in FIELD.findall(body):
            key, *options = tag.split(",")
            fields[key] = {"field": go_name, "type": go_type, "omitempty": "omitempty" in options}
        structs[name] = fields
    if "DiscoveryRule" not in structs or "MetricsDiscoveryConfig" not in structs:
        raise SystemExit(f"{CONFIG} at {commit} has no DiscoveryRule/MetricsDiscoveryConfig: the layout changed")
    return {"source": {"repo": REPO, "path": CONFIG, "commit": commit, "date": date}, "structs": structs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", type=Path, required=True, help="clone or bare mirror of " + REPO)
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(tabulate(args.git, args.rev), indent=1) + "\n")
    print(f"{args.out}: {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
