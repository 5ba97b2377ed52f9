"""Tabulate the bounds TensorRT-LLM's executor puts on sampling settings, as JSON facts.

Maintainer tool, not run by the pipeline: it reads the `SamplingConfig::check*` functions of one release's
`cpp/tensorrt_llm/executor/samplingConfig.cpp` and writes `pipeline/runtime/sampling_checks.json`, from which the
onnxruntime engine rejects the same values a TensorRT-LLM deployment rejects (each `TLLM_CHECK(x OP bound)`
becomes `[OP, bound]`; a bound that is a named constant stays a string). Usage:
    git -C TensorRT-LLM show <commit>:cpp/tensorrt_llm/executor/samplingConfig.cpp > samplingConfig.cpp
    python scripts/dev/tabulate_sampling_checks.py samplingConfig.cpp <commit> pipeline/runtime/sampling_checks.json
"""

import json
import re
import sys
from pathlib import Path

CHECKER = re.compile(r"SamplingConfig::check(\w+)\((?:[^()]|\([^()]*\))*\)\s*\{(.*?)\n\}", re.S)
CHECK = re.compile(r"TLLM_CHECK\((.*)\);")
COMPARISON = re.compile(r"^\s*\w+(?:\.value\(\))?\s*(<=|>=|<|>|==)\s*(.+?)\s*$")


def bound(text: str):
    number = re.fullmatch(r"(-?\d+(?:\.\d*)?)f?", text.strip())
    if number:
        value = float(number.group(1))
        return int(value) if value.is_integer() else value
    return re.sub(r".*::", "", text.strip().rstrip(")"))  # e.g. static_cast<...>(kernels::kMaxBeamWidth)


def tabulate(source: str) -> dict[str, list]:
    checks = {}
    for name, body in CHECKER.findall(source):
        rules = []
        for condition in CHECK.findall(body):
            for part in condition.split("&&"):
                match = COMPARISON.match(part)
                if match:  # comparisons against other settings (e.g. numReturnSequences vs beamWidth) are skipped
                    rules.append([match.group(1), bound(match.group(2))])
        if rules:
            checks[name] = rules
    return checks


if __name__ == "__main__":
    source_file, commit, output = sys.argv[1:4]
    facts = {
        "source": f"NVIDIA/TensorRT-LLM@{commit}:cpp/tensorrt_llm/executor/samplingConfig.cpp",
        "checks": tabulate(Path(source_file).read_text()),
    }
    Path(output).write_text(json.dumps(facts, indent=2) + "\n")
