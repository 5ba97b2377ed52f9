"""The GPU image's check of its own Python environment, run while `docker build` makes it (see image.py).

Standard library only: `record` runs first, in the container's own python3, before anything of ours is installed.

    python3 -I image_check.py record --tensorrt-llm 1.2.1 DIR   # the container's python3
    .venv/bin/python -I image_check.py compare DIR               # our virtualenv, once the pipeline is installed

(-I keeps this file's directory off sys.path: its modelopt.py would shadow ModelOpt.)

`record` stops unless the container holds the TensorRT-LLM the stage was written for, then writes DIR/container.json
(version and file of each module below) and DIR/constraints.txt (pip constraints pinning their distributions to the
container's versions, so installing the pipeline cannot replace them). `compare` stops unless our virtualenv resolves
each module to the very same file and version, and imports them (ModelOpt's quantization and export included); an
import failing only for want of the CUDA driver, which `docker build` does not mount, is reported and left to the
container's first start.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

# module -> the distribution that installs it
MODULES = {"tensorrt_llm": "tensorrt_llm", "torch": "torch", "modelopt": "nvidia-modelopt"}
IMPORTED = ("tensorrt_llm", "torch", "modelopt.torch.quantization", "modelopt.torch.export")
NO_DRIVER = ("libcuda", "driver")  # what an import failing for want of a GPU driver names
RECORD, CONSTRAINTS = "container.json", "constraints.txt"


def resolved() -> dict[str, dict]:
    """Where this interpreter finds each module and the version of the distribution that installed it."""
    found = {}
    for module, distribution in MODULES.items():
        spec = importlib.util.find_spec(module)
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found[module] = {"file": spec.origin if spec else None, "version": version, "distribution": distribution}
    return found


def record(tensorrt_llm: str, directory: Path) -> str | None:
    found = resolved()
    missing = [module for module, where in found.items() if not where["file"] or not where["version"]]
    if missing:
        return f"the container's python3 ({sys.executable}) has no {', '.join(missing)}: is this NVIDIA's trtllm image?"
    if found["tensorrt_llm"]["version"] != tensorrt_llm:
        return (
            f"this container holds TensorRT-LLM {found['tensorrt_llm']['version']}, the stage was written for "
            f"{tensorrt_llm}: build the stage `trtllm-pipeline plan CONFIG` names, or re-tabulate "
            "pipeline/upstream/triton_trtllm_images.json"
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RECORD).write_text(json.dumps(found, indent=1))
    (directory / CONSTRAINTS).write_text("".join(f"{w['distribution']}=={w['version']}\n" for w in found.values()))
    for module, where in found.items():
        print(f"container: {module} {where['version']} at {where['file']}")
    return None


def compare(directory: Path) -> str | None:
    container, ours = json.loads((directory / RECORD).read_text()), resolved()
    differing = [module for module in MODULES if ours[module] != container[module]]
    for module in MODULES:
        where = ours[module]
        print(f"{'differs' if module in differing else 'same'}: {module} {where['version']} at {where['file']}")
    if differing:
        return (
            f"{sys.executable} does not use the container's {', '.join(differing)}: the virtualenv must see the "
            "container's site-packages after its own and install nothing over them"
        )
    for module in IMPORTED:
        if container[module.split(".")[0]]["file"] is None:
            print(f"absent: {module} (the record has none)")
            continue
        try:
            importlib.import_module(module)
        except Exception as error:  # any import failure is reported; only a missing driver is not one
            if not any(word in str(error) for word in NO_DRIVER):
                return f"{module} does not import in {sys.executable}: {type(error).__name__}: {error}"
            print(
                f"resolved, not imported: {module} needs the CUDA driver, which `docker build` does not mount ({error})"
            )
            continue
        print(f"imported: {module}")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    record_step = steps.add_parser("record", help="in the container's python3: record its modules")
    record_step.add_argument("--tensorrt-llm", required=True, help="the TensorRT-LLM version the container must hold")
    record_step.add_argument("directory", type=Path)
    compare_step = steps.add_parser("compare", help="in our virtualenv: check it uses the recorded modules")
    compare_step.add_argument("directory", type=Path)
    args = parser.parse_args()
    problem = record(args.tensorrt_llm, args.directory) if args.step == "record" else compare(args.directory)
    if problem:
        print(f"image check failed: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
