"""Tabulate the bounds TensorRT-LLM's executor puts on sampling settings into pipeline/upstream/sampling_checks.json
(run by scripts/dev/tabulate_all.py), so the onnxruntime engine rejects the values a TensorRT-LLM deployment rejects.

Reads the `SamplingConfig::check<Setting>` functions of samplingConfig.cpp at `COMMIT`: each `TLLM_CHECK` comparison
of the setting with a bound becomes `[operator, bound]` under `<Setting>`; a bound that is a named constant is kept as
its name, without namespace or cast. `COMMIT` is the one read, not known to be a release's own commit: cited unpinned.
"""

from __future__ import annotations

import re

from upstream_source import Upstream, cite

REPO = "NVIDIA/TensorRT-LLM"
PATH = "cpp/tensorrt_llm/executor/samplingConfig.cpp"
COMMIT = "3585984b32cded5cc002d3087d3da4b0fd9fb8a5"

CHECKER = re.compile(r"SamplingConfig::check(\w+)\((?:[^()]|\([^()]*\))*\)\s*\{(.*?)\n\}", re.S)
CHECK = re.compile(r"TLLM_CHECK\((.*)\);")
COMPARISON = re.compile(r"^\s*\w+(?:\.value\(\))?\s*(<=|>=|<|>|==)\s*(.+?)\s*$")


def tabulate(upstream: Upstream) -> dict:
    return {"source": cite(REPO, PATH, COMMIT, pinned=False), "checks": checks(upstream.read(REPO, PATH, COMMIT))}


def bound(text: str) -> int | float | str:
    """A number as itself (1.0f -> 1), a named constant as its bare name (static_cast<T>(ns::kMax) -> "kMax")."""
    number = re.fullmatch(r"(-?\d+(?:\.\d*)?)f?", text.strip())
    if number:
        value = float(number.group(1))
        return int(value) if value.is_integer() else value
    return re.sub(r".*::", "", text.strip().rstrip(")"))


def checks(source: str) -> dict[str, list]:
    """{setting: [[operator, bound], ...]} of the checker functions in `source`; a comparison with another
    setting (not a bound) is left out, and so is a checker with no bound."""
    found = {}
    for name, body in CHECKER.findall(source):
        rules = []
        for condition in CHECK.findall(body):
            for part in condition.split("&&"):
                match = COMPARISON.match(part)
                if match:
                    rules.append([match.group(1), bound(match.group(2))])
        if rules:
            found[name] = rules
    return found
