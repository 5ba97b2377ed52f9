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

- from TensorRT-LLM's release notes: the ModelOpt line the release depends on (a requirement `~=X.Y.0`, the form
  every readable requirements.txt copy gives it) and the transformers version, where its own X.Y line names one;
- from NVIDIA/Model-Optimizer at the tag of each such line, and at the tags on either side of each change: the
  format of a preset's `quant_cfg` (a dict of pattern -> attributes, or from 0.44 a list of entries), whether
  `modelopt.torch.opt.load_modelopt_state` exists, and whether the unified export takes int4 weights without a
  pre_quant_scale, which pipeline/targets/trtllm/modelopt.py branches on.

The Dockerfile on a branch is not always what built the container (r25.04's still names the 25.01 base and torch
2.6): the versions come from the matrix, the layout from the Dockerfile, and our image checks both when it is built.
`tags` are the containers holding the release's very version; `other_tags` those holding another build of its line
(25.11's 1.0.3.2510, 26.03's 1.2.0), which our stage is not written for.
"""

from __future__ import annotations

import ast
import io
import re

from dockerfile_parse import DockerfileParser
from upstream_source import UnrecognizedSource, Upstream, cite, find_def, stored_releases

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

TRTLLM_REPO = "NVIDIA/TensorRT-LLM"
# The release notes as TensorRT-LLM's documentation site published them with 1.2.0 (its gh-pages branch; no
# release's own commit): per release, the ModelOpt and transformers versions it was updated to.
NOTES = "1.2.0/_sources/release-notes.md.txt"
NOTES_COMMIT = "7e873e54c296912df55b4c961e67079963ae4d34"
# The requirements.txt copies that could be read (main-line commits between releases, none a release's own): the
# form of the ModelOpt requirement, of which the notes name the X.Y.
REQUIREMENTS = "requirements.txt"
REQUIREMENTS_COMMITS = ("10bfbb57a9af872c052e503bbed3494a39b7dae5", "000867d9b1ad62f3de1e54e111c094da492a5626")
NOTES_HEADING = re.compile(r"^## TensorRT-LLM Release (\d+\.\d+(?:\.\d+)?)[ \t]*$", re.M)
MODELOPT_NOTE = re.compile(r"\bModelOpt (?:version is updated to |v)(\d+\.\d+)\b")
TRANSFORMERS_NOTE = re.compile(r"\btransformers`?(?: package)? version is updated to (\d+\.\d+\.\d+)\b")
MODELOPT_REQUIREMENT = re.compile(r"^nvidia-modelopt(?:\[[\w,]+\])?\s*~=\s*(\d+\.\d+)\.0\s*$", re.M)

MODELOPT_REPO = "NVIDIA/Model-Optimizer"
MODELOPT_CONFIG = "modelopt/torch/quantization/config.py"
MODELOPT_CONVERSION = "modelopt/torch/opt/conversion.py"
MODELOPT_QUANT_UTILS = "modelopt/torch/export/quant_utils.py"
MODELOPT_CHANGELOG = "CHANGELOG.rst"
# ModelOpt tags read, with their commits: the X.Y.0 of each line a release depends on, and the tags on either side
# of each change the pipeline branches on (0.42/0.43: load_modelopt_state; 0.43/0.44: the quant_cfg format;
# 0.44/0.45: the unified export of int4 weights without a pre_quant_scale).
MODELOPT_TAGS = {
    "0.25.0": "7eecd11b0fde7a589b5568f17e19fb67c665730d",
    "0.27.0": "54f4e3c64dd94801f3f234fea9b358789e45eaf8",
    "0.29.0": "acecdb5ba659fb0bcd898aad11fd498cb98aeafb",
    "0.31.0": "5a2bf34951d64375da1e76112af5a826e9f7c81c",
    "0.33.0": "7a27f2a59bf714c8c7b9a6ecfee318fca5fe2f02",
    "0.37.0": "df0882a63c39a001a1be384b680166a41259045c",
    "0.42.0": "e2a4a8bf682bf3ddb30a64363a791650b9e4f11f",
    "0.43.0": "ccabb95b731474ddc467bb7180a078f3a9b60c68",
    "0.44.0": "c897fbeaaff66d53d61033f107885b7c5432f235",
    "0.45.0": "ec87a82927d003986d44fb7f4fa8b3d10c31b095",
}
CHANGELOG_HEADING = re.compile(r"^(\d+\.\d+(?:\.\d+)?) \([^)\n]*\)\n\^+$", re.M)


def tabulate(upstream: Upstream) -> dict:
    containers = matrix_rows(upstream.read(TRITON_REPO, MATRIX, MATRIX_COMMIT))
    notes = release_notes(upstream.read(TRTLLM_REPO, NOTES, NOTES_COMMIT))
    modelopt = modelopt_tags(upstream)
    noted_lines = {line for section in notes for line in section["modelopt"]}
    for commit in REQUIREMENTS_COMMITS:
        line = modelopt_requirement_line(upstream.read(TRTLLM_REPO, REQUIREMENTS, commit))
        if line not in noted_lines:
            raise UnrecognizedSource(
                f"{REQUIREMENTS} at {commit} requires ModelOpt {line}, which no release note names"
            )
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
            "tags": sorted(row["tag"] for row in holding if row["tensorrt_llm"] == newest["tensorrt_llm"]),
            "other_tags": {
                row["tag"]: row["tensorrt_llm"]
                for row in sorted(holding, key=lambda row: row["tag"])
                if row["tensorrt_llm"] != newest["tensorrt_llm"]
            },
            "tensorrt_llm": newest["tensorrt_llm"],
            "torch": newest["torch"],
            **layout,
            "dockerfile": cite(BACKEND_REPO, DOCKERFILE, BRANCH_COMMITS[tag]),
            **release_dependencies(notes, newest["tensorrt_llm"], modelopt["tags"]),
        }
    return {
        "source": cite(TRITON_REPO, MATRIX, MATRIX_COMMIT),
        "dependencies": {
            "notes": cite(TRTLLM_REPO, NOTES, NOTES_COMMIT, pinned=False),
            "requirements": [cite(TRTLLM_REPO, REQUIREMENTS, commit, pinned=False) for commit in REQUIREMENTS_COMMITS],
        },
        "modelopt": modelopt,
        "releases": stored_releases(releases),
    }


def numeric(version: str) -> tuple[int, int, int]:
    """X.Y[.Z] as three integers (a missing Z is 0: the notes title 1.2.0 "Release 1.2")."""
    parts = tuple(map(int, version.split(".")))
    return (*parts, 0, 0)[:3]


def release_notes(text: str) -> list[dict]:
    """Each release's section of the notes, newest first: its version, and the ModelOpt lines (X.Y) and transformers
    versions it says the release was updated to (a sorted list, empty where it names none)."""
    heads = list(NOTES_HEADING.finditer(text))
    if not heads:
        raise UnrecognizedSource(f"{NOTES} has no release headings")
    sections = []
    for head, following in zip(heads, [*heads[1:], None]):
        body = text[head.end() : following.start() if following else len(text)]
        sections.append(
            {
                "version": head[1],
                "modelopt": sorted(set(MODELOPT_NOTE.findall(body))),
                "transformers": sorted(set(TRANSFORMERS_NOTE.findall(body))),
            }
        )
    return sections


def named(section: dict, dependency: str) -> str:
    """The one version of `dependency` a section names."""
    if len(section[dependency]) > 1:
        raise UnrecognizedSource(f"{NOTES}: release {section['version']} names several {dependency} versions")
    return section[dependency][0]


def release_dependencies(notes: list[dict], version: str, tags: dict) -> dict:
    """What the notes say the release of TensorRT-LLM `version` depends on. ModelOpt: the line the newest section at or
    before it names (each release line from 0.18 to 1.1 names its own; 1.2 names none, so 1.1's holds, as the
    requirements.txt copies between 1.1 and 1.2 say). transformers: only where a section of the release's own X.Y
    line names it, since the notes leave some updates out (none of 0.19-0.21 names one)."""
    earlier = [section for section in notes if numeric(section["version"]) <= numeric(version)]
    modelopt = next((section for section in earlier if section["modelopt"]), None)
    if modelopt is None:
        raise UnrecognizedSource(f"{NOTES} names no ModelOpt version at or before TensorRT-LLM {version}")
    line = named(modelopt, "modelopt")
    if f"{line}.0" not in tags:
        raise UnrecognizedSource(
            f"TensorRT-LLM {version} depends on ModelOpt {line}: add tag {line}.0 to MODELOPT_TAGS"
        )
    transformers = next(
        (s for s in earlier if s["transformers"] and numeric(s["version"])[:2] == numeric(version)[:2]), None
    )
    return {
        "modelopt": {
            "requirement": f"~={line}.0",
            "noted_in": modelopt["version"],
            "quant_cfg": tags[f"{line}.0"]["quant_cfg"],
        },
        "transformers": {"version": named(transformers, "transformers"), "noted_in": transformers["version"]}
        if transformers
        else None,
    }


def modelopt_requirement_line(text: str) -> str:
    """The X.Y of a requirements.txt's `nvidia-modelopt[...]~=X.Y.0`."""
    found = MODELOPT_REQUIREMENT.findall(text)
    if len(found) != 1:
        raise UnrecognizedSource(f"{REQUIREMENTS}: no single nvidia-modelopt requirement of the form ~=X.Y.0")
    return found[0]


def modelopt_tags(upstream: Upstream) -> dict:
    """Per ModelOpt tag read: its presets' quant_cfg format and whether load_modelopt_state exists; the first tag of
    each change, the quant_cfg one confirmed by that release's changelog section."""
    tags = {}
    for tag, commit in MODELOPT_TAGS.items():
        config = upstream.read(MODELOPT_REPO, MODELOPT_CONFIG, commit)
        conversion = ast.parse(upstream.read(MODELOPT_REPO, MODELOPT_CONVERSION, commit)).body
        quant_utils = ast.parse(upstream.read(MODELOPT_REPO, MODELOPT_QUANT_UTILS, commit)).body
        paths = (MODELOPT_CONFIG, MODELOPT_CONVERSION, MODELOPT_QUANT_UTILS)
        tags[tag] = {
            "quant_cfg": quant_cfg_format(config),
            "load_modelopt_state": find_def(conversion, "load_modelopt_state") is not None,
            "pre_quant_scale_optional": fusion_skips_missing_scale(quant_utils),
            "sources": [cite(MODELOPT_REPO, path, commit) for path in paths],
        }
    list_from = first_change(tags, "quant_cfg", "list")
    changelog = upstream.read(MODELOPT_REPO, MODELOPT_CHANGELOG, MODELOPT_TAGS[list_from])
    if not changelog_says_quant_cfg_is_a_list(changelog, list_from):
        raise UnrecognizedSource(f"{MODELOPT_CHANGELOG} at {list_from} does not say quant_cfg became a list")
    return {
        "quant_cfg_list_from": list_from,
        "load_modelopt_state_from": first_change(tags, "load_modelopt_state", True),
        "pre_quant_scale_optional_from": first_change(tags, "pre_quant_scale_optional", True),
        "changelog": cite(MODELOPT_REPO, MODELOPT_CHANGELOG, MODELOPT_TAGS[list_from]),
        "tags": tags,
    }


def first_change(tags: dict, key: str, value) -> str:
    """The first tag (in version order) whose `key` is `value`, every earlier one having another, every later one
    this one (tags where it was not read left out)."""
    order = [tag for tag in sorted(tags, key=numeric) if tags[tag][key] is not None]  # None: not read at that tag
    first = next((tag for tag in order if tags[tag][key] == value), None)
    if first is None or order.index(first) == 0 or any(tags[t][key] != value for t in order[order.index(first) :]):
        raise UnrecognizedSource(f"ModelOpt's {key} does not change once to {value!r} over the tags read")
    return first


def fusion_skips_missing_scale(statements: list[ast.stmt]) -> bool:
    """Whether `fuse_prequant_layernorm` (the unified export's folding of an AWQ-format group's pre_quant_scale into
    the layernorm before it) returns early when the input quantizer has no `_pre_quant_scale`, rather than reading it:
    int4 round-to-nearest is exported in that format with no scale."""
    function = find_def(statements, "fuse_prequant_layernorm")
    if function is None:
        raise UnrecognizedSource(f"{MODELOPT_QUANT_UTILS} defines no fuse_prequant_layernorm")
    for node in function.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
            call = node.test.operand
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "hasattr"
                and any(isinstance(a, ast.Constant) and a.value == "_pre_quant_scale" for a in call.args)
                and isinstance(node.body[0], ast.Return)
            ):
                return True
    return False


def quant_cfg_format(text: str) -> str | None:
    """'dict' or 'list': what the `quant_cfg` of config.py's literal presets (`NAME = {"quant_cfg": ...}`) is; None
    where it has none (from 0.45 the presets are loaded from files of its own, not read here)."""
    formats = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and key.value == "quant_cfg":
                    formats.add({ast.Dict: "dict", ast.List: "list"}.get(type(value), "other"))
    if len(formats) > 1 or formats == {"other"}:
        raise UnrecognizedSource(f"{MODELOPT_CONFIG}: presets' quant_cfg are {sorted(formats)}")
    return formats.pop() if formats else None


def changelog_says_quant_cfg_is_a_list(text: str, tag: str) -> bool:
    """Whether the changelog's section of `tag`'s X.Y has a bullet saying quant_cfg is now a list."""
    heads = list(CHANGELOG_HEADING.finditer(text))
    line = ".".join(tag.split(".")[:2])
    for head, following in zip(heads, [*heads[1:], None]):
        if head[1] == line:
            body = text[head.end() : following.start() if following else len(text)]
            bullets = re.split(r"\n- ", body)
            return any("``quant_cfg``" in bullet and re.search(r"\blist\b", bullet) for bullet in bullets)
    return False


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
