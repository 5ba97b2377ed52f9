"""Tabulate NVIDIA's Triton TensorRT-LLM containers (`tritonserver:<tag>-trtllm-python-py3`) into
`pipeline/upstream/triton_trtllm_images.json` (run by scripts/dev/tabulate_all.py), so that our GPU image is built
for each release's own Python layout. Per TensorRT-LLM release:

- from the Triton release compatibility matrix (triton-inference-server/server docs/introduction/compatibility.md):
  the container tags holding that release, the newest one (`container`) and its TensorRT-LLM, torch and Python
  versions;
- from tensorrtllm_backend's `dockerfile/Dockerfile.triton.trt_llm_backend` on that container's branch (`r<tag>`):
  the interpreter the container's Python environment is based on, the environment itself (a virtualenv placed first
  on PATH, or the system's), the directory torch is copied into (where the container's Python packages live), and
  whether the final image installs the interpreter's `venv` module (Ubuntu's python3.X-venv).

The Dockerfile on a branch is not always what built the container (r25.04's still names the 25.01 base and torch
2.6): the versions come from the matrix, the layout from the Dockerfile, and our image checks both when it is built.
"""

from __future__ import annotations

import io
import re

from dockerfile_parse import DockerfileParser
from upstream_source import UnrecognizedSource, Upstream, cite, stored_releases

TRITON_REPO = "triton-inference-server/server"
MATRIX = "docs/introduction/compatibility.md"
MATRIX_COMMIT = "e1db8a603d863b1317ee859bdeea2be19959462e"  # server main, 2026-08-19
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
DOCKERFILE = "dockerfile/Dockerfile.triton.trt_llm_backend"
# The head of each container's release branch (r<tag>) in tensorrtllm_backend, for the tags `container` picks.
BRANCH_COMMITS = {
    "25.04": "1a9fa204240399f420e65ba9f969d213fbed8b2c",
    "25.05": "c2e65b88d85255be30cf50440a91662abeb497dd",
    "25.07": "d639f78f0e9de6257b2a4cde50af89ac8abc759d",
    "25.08": "0862e6fb577c9fce398b9ef916725e76c86d7211",
    "25.10": "e2e72dc83f7255a36738b080446570f32b466781",
    "26.02": "47c80a359531952f58e74ae8e891c010b7663d76",
    "26.07": "3bc115373ce1fde1d94891964b492449402e3a68",
}
RELEASES = ("0.18", "0.19", "0.20", "0.21", "1.0", "1.1", "1.2")
MATRIX_SECTION = "## Container Name: trtllm-python-py3"
RELEASE_VERSION = re.compile(r"\d+\.\d+\.\d+")  # a release; 25.11's "1.0.3.2510" is a build of its own
VENV_MODULE = re.compile(r"python3(\.\d+)?-venv")


def tabulate(upstream: Upstream) -> dict:
    containers = matrix_rows(upstream.read(TRITON_REPO, MATRIX, MATRIX_COMMIT))
    releases = {}
    for release in RELEASES:
        holding = [row for row in containers if row["tensorrt_llm"].startswith(f"{release}.")]
        newest = max(
            (row for row in holding if RELEASE_VERSION.fullmatch(row["tensorrt_llm"])),
            key=lambda row: tuple(map(int, row["tag"].split("."))),
        )
        tag = newest["tag"]
        if tag not in BRANCH_COMMITS:
            raise UnrecognizedSource(f"{tag} is the newest container of {release}: add the head of r{tag}")
        layout = dockerfile_layout(upstream.read(BACKEND_REPO, DOCKERFILE, BRANCH_COMMITS[tag]))
        if layout.pop("tensorrt_llm") not in (None, newest["tensorrt_llm"]):
            raise UnrecognizedSource(f"r{tag}'s {DOCKERFILE} installs another TensorRT-LLM than the matrix lists")
        if layout["python"] != newest["python"]:
            raise UnrecognizedSource(f"r{tag}'s {DOCKERFILE} uses Python {layout['python']}, the matrix lists another")
        releases[release] = {
            "container": tag,
            "tags": sorted(row["tag"] for row in holding),
            "tensorrt_llm": newest["tensorrt_llm"],
            "torch": newest["torch"],
            **layout,
            "dockerfile": cite(BACKEND_REPO, DOCKERFILE, BRANCH_COMMITS[tag]),
        }
    return {"source": cite(TRITON_REPO, MATRIX, MATRIX_COMMIT), "releases": stored_releases(releases)}


def matrix_rows(text: str) -> list[dict]:
    """The rows of the trtllm-python-py3 table: tag, Python major.minor, torch and TensorRT-LLM versions."""
    section = text.partition(MATRIX_SECTION)[2].partition("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise UnrecognizedSource(f"{MATRIX} has no table under '{MATRIX_SECTION}'")
    header = [cell.strip().lower() for cell in lines[0].strip("|").split("|")]
    columns = {name: header.index(name) for name in ("ngc tag", "python version", "torch version")}
    columns["tensorrt-llm version"] = header.index("tensorrt-llm version")
    rows = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        tag = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d+\.\d+)-trtllm-python-py3", cells[columns["ngc tag"]])
        python = re.fullmatch(r"Python (\d+\.\d+)\.\d+", cells[columns["python version"]])
        if not tag or not python:
            raise UnrecognizedSource(f"{MATRIX}: a row of another shape: {line[:80]}")
        rows.append(
            {
                "tag": tag[1],
                "python": python[1],
                "torch": cells[columns["torch version"]],
                "tensorrt_llm": cells[columns["tensorrt-llm version"]],
            }
        )
    return rows


def dockerfile_layout(text: str) -> dict:
    """The Python layout of the Dockerfile's final stage (with the stages it is built on)."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    stages = final_chain(parser.structure)
    args = global_args(parser.structure)
    instructions = [(instruction, resolve(value, args)) for stage in stages for instruction, value in stage]
    runs = " ".join(value for instruction, value in instructions if instruction == "RUN")
    torch_dirs = {
        match[1]
        for instruction, value in instructions
        if instruction == "COPY"
        for match in [re.search(r"\s(/\S+)/torch$", value)]
        if match
    }
    if len(torch_dirs) != 1:
        raise UnrecognizedSource(f"{DOCKERFILE}: torch is copied into {sorted(torch_dirs) or 'no directory'}")
    site_packages = torch_dirs.pop()
    python = re.search(r"/python(\d+\.\d+)/", site_packages)
    venvs = re.findall(r"python3(?:\.\d+)? -m venv (\S+)", runs)
    on_path = [
        value.split("=", 1)[1].strip('"').split(":")[0]
        for instruction, value in instructions
        if instruction == "ENV" and value.startswith("PATH=")
    ]
    environment = next((venv for venv in venvs if f"{venv}/bin" in on_path), "/usr")
    if not python or not site_packages.startswith(environment if environment != "/usr" else "/usr/"):
        raise UnrecognizedSource(f"{DOCKERFILE}: torch in {site_packages} is outside the environment {environment}")
    return {
        "python": python[1],
        "interpreter": f"/usr/bin/python{python[1]}",
        "environment": environment,
        "site_packages": site_packages,
        "venv_module": bool(VENV_MODULE.search(" ".join(apt_installs(runs)))),
        "tensorrt_llm": args.get("TENSORRTLLM_VER"),
    }


def final_chain(structure: list[dict]) -> list[list[tuple[str, str]]]:
    """The instructions of the last stage and of every stage it is built FROM, oldest first."""
    stages, order = {}, []
    for item in structure:
        if item["instruction"] == "FROM":
            base, name = re.fullmatch(r"(\S+)(?:\s+as\s+(\S+))?", item["value"].strip(), re.I).groups()
            order.append(name or f"#{len(order)}")
            stages[order[-1]] = {"base": base, "instructions": []}
        elif order:
            stages[order[-1]]["instructions"].append((item["instruction"], item["value"]))
    chain, name = [], order[-1]
    while name in stages:
        chain.insert(0, stages[name]["instructions"])
        name = stages[name]["base"]
    return chain


def global_args(structure: list[dict]) -> dict[str, str]:
    """The ARG defaults declared before the first FROM (what a stage's `ARG NAME` brings in)."""
    args = {}
    for item in structure:
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG" and "=" in item["value"]:
            name, _, default = item["value"].partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), value)


def apt_installs(runs: str) -> list[str]:
    """The packages every `apt-get install` in `runs` names (options and the next command left out)."""
    packages = []
    for command in re.findall(r"apt-get install ([^&;|]*)", runs):
        packages += [word for word in command.split() if not word.startswith("-")]
    return packages
