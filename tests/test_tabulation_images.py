"""scripts/dev/tabulate_triton_trtllm_images.py on short inputs written here in the syntax of the files it reads (the
compatibility matrix's markdown table, a multi-stage Dockerfile in each of the two Python layouts, release notes about
made-up releases, a requirements file, and ModelOpt's config, conversion and export modules and changelog reduced to
what is read of them)."""

import ast

import pytest

from tests.conftest import dev_script

tab = dev_script("tabulate_triton_trtllm_images")

MATRIX = """
# Release Compatibility Matrix

## Container Name: trtllm-python-py3

| Triton release version | NGC Tag | Python version | Torch version | TensorRT version | TensorRT-LLM version |
| --- | --- | --- | --- | --- | --- |
| 26.02 | nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3 | Python 3.12.3  | 2.9.0a0+abc.nv25.10 | 10.13 | 1.1.0 |
| 25.11 | nvcr.io/nvidia/tritonserver:25.11-trtllm-python-py3 | Python 3.12.3 | 2.9.0a0+abc | 10.13 | 1.0.3.2510 |

## Container Name: vllm-python-py3

| Triton release version | NGC Tag | Python version | vLLM version |
| --- | --- | --- | --- |
| 26.02 | nvcr.io/nvidia/tritonserver:26.02-vllm-python-py3 | Python 3.12.3 | 0.15.1 |
"""

# The system layout: packages copied and pip-installed into /usr/local; python3-dev and -pip only.
SYSTEM = """
ARG BASE_IMAGE=example/base:1
FROM example/torch:1 AS torch_source
FROM ${BASE_IMAGE} AS builder
RUN apt-get install -y python3.12-venv
FROM ${BASE_IMAGE} AS final
COPY --from=torch_source /usr/local/lib/python3.12/dist-packages/torch /usr/local/lib/python3.12/dist-packages/torch
RUN apt-get update && \\
    apt-get install -y --no-install-recommends \\
        python3-dev \\
        # a comment inside the continued command
        python3-pip && \\
    rm -rf /var/lib/apt/lists/*
"""

# The virtualenv layout: a venv first on PATH, made in the stage the final one is built on.
VENV = """
ARG BASE_IMAGE=example/base:2
ARG TENSORRTLLM_VER=1.2.1
FROM example/torch:2 AS torch_source
FROM ${BASE_IMAGE} AS wrapper
COPY --from=torch_source /usr/local/lib/python3.12/dist-packages/torch /opt/env/lib/python3.12/site-packages/torch
ENV PATH="/opt/env/bin:${PATH}"
RUN apt-get update && apt-get install -y --no-install-recommends python3.12-venv git-lfs \\
    && python3.12 -m venv /opt/env
FROM wrapper AS final
ARG TENSORRTLLM_VER
RUN pip3 install tensorrt_llm==${TENSORRTLLM_VER}
"""


def test_matrix_rows_are_read_from_the_trtllm_table_only():
    assert tab.matrix_rows(MATRIX) == [
        {"tag": "26.02", "python": "3.12", "torch": "2.9.0a0+abc.nv25.10", "tensorrt_llm": "1.1.0"},
        {"tag": "25.11", "python": "3.12", "torch": "2.9.0a0+abc", "tensorrt_llm": "1.0.3.2510"},
    ]


def test_a_matrix_of_another_shape_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="no table"):
        tab.matrix_rows(MATRIX.replace("trtllm-python-py3\n", "other\n", 1))


def test_the_system_layout_of_the_final_stage_only():
    """The builder stage's python3.12-venv is not in the final image: the final stage is based on BASE_IMAGE."""
    assert tab.dockerfile_layout(SYSTEM) == {
        "python": "3.12",
        "interpreter": "/usr/bin/python3.12",
        "environment": "/usr",
        "site_packages": "/usr/local/lib/python3.12/dist-packages",
        "venv_module": False,
        "tensorrt_llm": None,
    }


def test_the_virtualenv_layout_through_the_stage_the_final_one_is_built_on():
    assert tab.dockerfile_layout(VENV) == {
        "python": "3.12",
        "interpreter": "/usr/bin/python3.12",
        "environment": "/opt/env",
        "site_packages": "/opt/env/lib/python3.12/site-packages",
        "venv_module": True,
        "tensorrt_llm": "1.2.1",
    }


def test_torch_outside_the_environment_is_refused():
    moved = VENV.replace("/opt/env/lib/python3.12/site-packages/torch", "/usr/local/lib/python3.12/dist-packages/torch")
    with pytest.raises(tab.UnrecognizedSource, match="outside the environment /opt/env"):
        tab.dockerfile_layout(moved)


def test_tags_hold_only_the_containers_of_the_releases_own_version(monkeypatch):
    """Of the containers of a line, `tags` are those holding the version the newest one holds; a build of another
    version of the line (25.11's 1.0.3.2510 here) is listed apart, with its version."""

    def row(tag: str) -> str:
        image = f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3"
        return f"| {tag} | {image} | Python 3.12.3 | 2.8.0a0+abc | 10.11 | 1.0.0 |"

    newer_line = next(line for line in MATRIX.splitlines() if line.startswith("| 26.02 "))
    matrix = MATRIX.replace(newer_line, f"{row('25.10')}\n{row('25.09')}")
    upstream = FakeUpstream({tab.MATRIX: matrix, tab.DOCKERFILE: SYSTEM, **MODELOPT_FILES})
    monkeypatch.setattr(tab, "RELEASES", ("1.0",))
    monkeypatch.setattr(tab, "BRANCH_COMMITS", {"25.10": "a" * 40})
    monkeypatch.setattr(tab, "MODELOPT_TAGS", {"0.38.0": OLD, "0.40.0": NEW})
    table = tab.tabulate(upstream)
    (release,) = table["releases"].values()
    assert (release["container"], release["tags"], release["other_tags"]) == (
        "25.10",
        ["25.09", "25.10"],
        {"25.11": "1.0.3.2510"},
    )
    assert release["modelopt"] == {"requirement": "~=0.38.0", "noted_in": "1.0", "quant_cfg": "dict"}
    assert release["transformers"] == {"version": "4.99.1", "noted_in": "1.0"}
    modelopt = table["modelopt"]
    assert {key: modelopt[key] for key in modelopt if key.endswith("_from")} == {
        "quant_cfg_list_from": "0.40.0",
        "load_modelopt_state_from": "0.40.0",
        "pre_quant_scale_optional_from": "0.40.0",
    }
    assert modelopt["tags"]["0.38.0"]["sources"][0] == tab.cite(tab.MODELOPT_REPO, tab.MODELOPT_CONFIG, OLD)
    assert table["dependencies"]["notes"]["pinned"] is False  # the documentation site's copy, no release's commit


OLD, NEW = "b" * 40, "c" * 40


class FakeUpstream:
    """Files by path (by path and commit where a dict is given), as `Upstream.read` returns them."""

    def __init__(self, files: dict):
        self.files = files

    def read(self, repo: str, path: str, commit: str | None) -> str:
        text = self.files[path]
        return text[commit] if isinstance(text, dict) else text


# Release notes in the syntax the tabulator reads, about made-up releases.
NOTES = """# Notes

## TensorRT-LLM Release 2.1

### Infrastructure Changes
- The dependent transformers version is updated to 5.1.0.

## TensorRT-LLM Release 2.0

### Infrastructure Changes
- The dependent NVIDIA ModelOpt version is updated to 0.40.
- The dependent transformers version is updated to 5.0.1.

## TensorRT-LLM Release 1.9.1

### Infrastructure Changes
  - The dependent `transformers` package version is updated to 4.60.2.

## TensorRT-LLM Release 1.9.0

### Infrastructure Changes
  - Updated to ModelOpt v0.38 for Linux platform.

## TensorRT-LLM Release 1.0

### Infrastructure Changes
- The dependent NVIDIA ModelOpt version is updated to 0.38.
- The dependent transformers version is updated to 4.99.1.
"""
CHANGELOG = """Changelog
=========

0.40 (2031-02-01)
^^^^^^^^^^^^^^^^^

**Backward Breaking Changes**

- ``quant_cfg`` is now a list of entries.
- Something else changed.

0.38 (2031-01-01)
^^^^^^^^^^^^^^^^^

- ``quant_cfg`` keys may name classes.
"""
GUARDED = """
def fuse_prequant_layernorm(norm, modules):
    if not hasattr(modules[0].input_quantizer, "_pre_quant_scale"):
        return
    norm.weight = norm.weight * modules[0].input_quantizer._pre_quant_scale
"""
MODELOPT_FILES = {
    tab.NOTES: NOTES,
    tab.REQUIREMENTS: "numpy\nnvidia-modelopt[torch]~=0.38.0\ntransformers==4.99.1\n",
    tab.MODELOPT_CONFIG: {
        OLD: "A_CFG = {'quant_cfg': {'*': {}}}\n",
        NEW: "A_CFG = {'quant_cfg': [{'quantizer_name': '*'}]}\n",
    },
    tab.MODELOPT_CONVERSION: {OLD: "def restore(model, state): pass\n", NEW: "def load_modelopt_state(path): pass\n"},
    tab.MODELOPT_QUANT_UTILS: {OLD: GUARDED.replace("    if not hasattr", "    if hasattr"), NEW: GUARDED},
    tab.MODELOPT_CHANGELOG: CHANGELOG,
}


def test_what_the_notes_say_each_release_depends_on():
    """ModelOpt: the line the newest section at or before the release names; transformers: only from a section of
    the release's own X.Y line (1.10 sorts after 1.9 by number)."""
    notes = tab.release_notes(NOTES)
    assert [s["version"] for s in notes] == ["2.1", "2.0", "1.9.1", "1.9.0", "1.0"]
    tags = {"0.38.0": {"quant_cfg": "dict"}, "0.40.0": {"quant_cfg": "list"}}

    def depends(version):
        found = tab.release_dependencies(notes, version, tags)
        transformers = found["transformers"] and (found["transformers"]["version"], found["transformers"]["noted_in"])
        return (
            found["modelopt"]["requirement"],
            found["modelopt"]["noted_in"],
            found["modelopt"]["quant_cfg"],
            transformers,
        )

    assert depends("2.1.3") == ("~=0.40.0", "2.0", "list", ("5.1.0", "2.1"))
    assert depends("2.0.0") == ("~=0.40.0", "2.0", "list", ("5.0.1", "2.0"))
    assert depends("1.9.2") == ("~=0.38.0", "1.9.0", "dict", ("4.60.2", "1.9.1"))
    assert depends("1.10.0") == ("~=0.38.0", "1.9.0", "dict", None)
    with pytest.raises(tab.UnrecognizedSource, match="add tag 0.38.0"):
        tab.release_dependencies(notes, "1.9.0", {})
    twice = tab.release_notes(NOTES.replace("updated to 0.40.", "updated to 0.40.\n- Updated to ModelOpt v0.41."))
    assert tab.release_dependencies(twice, "1.9.0", tags)["modelopt"]["requirement"] == "~=0.38.0"  # not read
    with pytest.raises(tab.UnrecognizedSource, match="release 2.0 names several modelopt versions"):
        tab.release_dependencies(twice, "2.0.0", tags)


def test_the_modelopt_requirement_form_is_read_from_a_requirements_file():
    assert tab.modelopt_requirement_line("numpy\nnvidia-modelopt[torch]~=0.40.0\n") == "0.40"
    with pytest.raises(tab.UnrecognizedSource, match="~=X.Y.0"):
        tab.modelopt_requirement_line("nvidia-modelopt[torch]>=0.40\n")


def test_the_quant_cfg_format_of_literal_presets():
    assert tab.quant_cfg_format("A = {'quant_cfg': {'*': {}}}\nB = {'algorithm': 'max', 'quant_cfg': {}}") == "dict"
    assert tab.quant_cfg_format("A = {'quant_cfg': [{'quantizer_name': '*'}]}") == "list"
    assert tab.quant_cfg_format("A = load('a.yaml')") is None  # presets not in the file
    with pytest.raises(tab.UnrecognizedSource, match="'dict', 'list'"):
        tab.quant_cfg_format("A = {'quant_cfg': {}}\nB = {'quant_cfg': []}")


def test_whether_the_layernorm_fusion_skips_a_missing_pre_quant_scale():
    parse = lambda text: ast.parse(text).body  # noqa: E731
    assert tab.fusion_skips_missing_scale(parse(GUARDED)) is True
    assert tab.fusion_skips_missing_scale(parse(GUARDED.replace("    if not hasattr", "    if hasattr"))) is False
    with pytest.raises(tab.UnrecognizedSource, match="defines no fuse_prequant_layernorm"):
        tab.fusion_skips_missing_scale(parse("def other(): pass"))


def test_a_change_is_the_first_tag_after_which_every_tag_agrees():
    tags = {"0.9.0": {"k": False}, "0.10.0": {"k": True}, "0.11.0": {"k": None}, "0.12.0": {"k": True}}
    assert tab.first_change(tags, "k", True) == "0.10.0"  # by number, 0.11's unread value left out
    with pytest.raises(tab.UnrecognizedSource, match="does not change once"):
        tab.first_change({**tags, "0.13.0": {"k": False}}, "k", True)


def test_the_changelog_section_of_the_release_must_say_quant_cfg_became_a_list():
    assert tab.changelog_says_quant_cfg_is_a_list(CHANGELOG, "0.40.0") is True
    assert tab.changelog_says_quant_cfg_is_a_list(CHANGELOG, "0.38.0") is False
    assert tab.changelog_says_quant_cfg_is_a_list(CHANGELOG, "0.39.0") is False
