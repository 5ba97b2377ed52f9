"""scripts/dev/tabulate_trtllm_dtype.py on short inputs written here in the syntax of the files it reads (a
convert_utils.py `infer_dtype`, _utils.py's torch dtype names, a Llama converter's from_hugging_face, the PyTorch
backend's ModelConfig, the LLM API's dtype validator, requirements.txt), and the committed trtllm_dtype table that
pipeline/targets/trtllm/dtypes.py is tested against (tests/targets/test_trtllm_dtypes.py)."""

import re

import pytest

from pipeline.upstream import facts, releases, resolved_releases
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_dtype")
UnrecognizedSource = tab.UnrecognizedSource

# An infer_dtype that decides otherwise than any release, so that what is tabulated is read, not assumed.
INFER = """import os
from .._utils import torch_dtype_to_str
from ..logger import logger


def unrelated(dtype):
    return dtype == "int4"


def infer_dtype(dtype, source_dtype=None):
    if dtype == "auto":
        if source_dtype is None:
            logger.warning("none")
            return "float32"
        name = torch_dtype_to_str(source_dtype)
        return "bfloat16" if name == "float32" else name
    if dtype in ("half", "float16"):
        return "float16"
    raise KeyError(dtype)
"""
UTILS = """_unrelated = {1: 2}
_str_to_torch_dtype_dict = dict(half=torch.float16, float16=torch.float16, bfloat16=torch.bfloat16,
                                float32=torch.float32)
_torch_dtype_to_str_dict = {v: k for k, v in _str_to_torch_dtype_dict.items()}


def torch_dtype_to_str(d):
    return _torch_dtype_to_str_dict[d]
"""
# a slice of a config class: the method alone, indented as in its class
LLAMA = """    @classmethod
    def from_hugging_face(cls,
                          config_or_dir,
                          dtype: str = "auto",
                          mapping=None,
                          **kwargs):
        hf_config = load(config_or_dir)
        if hf_config.model_type == "other":
            hf_config = hf_config.text_config
        dtype = infer_dtype(dtype, getattr(hf_config, "dtype", None))
        return cls(architecture="X", dtype=dtype, mapping=mapping, **kwargs)
"""
MODEL_CONFIG = """class ModelConfig:
    pretrained_config: object = None

    @property
    def other(self):
        return 1

    @property
    def torch_dtype(self):
        return self.pretrained_config.dtype or torch.float16
"""
VALIDATOR = """class KvCache:
    @field_validator("dtype")
    @classmethod
    def validate_dtype(cls, v):
        return v.lower()


class Args:
    @field_validator("dtype")
    @classmethod
    def validate_dtype(cls, v, info):
        if torch.cuda.get_device_properties(0).major < 9:
            if v == "bfloat16":
                v = "float16"
            if v == "float32":
                raise ValueError(v)
        return v
"""
REQUIREMENTS = "torch==2.9.0\n# transformers==1.0 (a comment)\ntransformers==4.57.1\nxgrammar==0.1.25\n"


def test_infer_dtype_is_run_for_auto_with_each_hf_dtype_and_for_each_name_it_compares():
    assert tab.infer_dtype(INFER, UTILS) == {
        "auto": {"absent": "float32", "bfloat16": "bfloat16", "float16": "float16", "float32": "bfloat16"},
        "explicit": {"float16": "float16", "half": "float16"},
        "unaccepted": {"raises": "KeyError"},
    }


def test_infer_dtype_must_take_torch_dtype_to_str_from_utils():
    with pytest.raises(UnrecognizedSource, match="not imported from _utils"):
        tab.infer_dtype(INFER.replace("from .._utils", "from .other"), UTILS)
    with pytest.raises(UnrecognizedSource, match="_torch_dtype_to_str_dict"):
        tab.infer_dtype(INFER, UTILS.replace("_torch_dtype_to_str_dict = ", "_elsewhere = "))


def test_the_converter_gives_its_dtype_default_and_the_hf_attribute_it_infers_from():
    assert tab.converter(LLAMA) == {
        "method": "LLaMAConfig.from_hugging_face",
        "dtype_default": "auto",
        "source_dtype": {"attribute": "dtype", "when_absent": None},
        "config_dtype_is_inferred": True,
    }
    untold = LLAMA.replace('getattr(hf_config, "dtype", None)', "hf_config.dtype")
    with pytest.raises(UnrecognizedSource, match="source dtype"):
        tab.converter(untold)


def test_the_model_dtype_is_the_property_s_attribute_or_its_fallback():
    assert tab.model_dtype(MODEL_CONFIG) == {
        "property": "ModelConfig.torch_dtype",
        "pretrained_config_attribute": "dtype",
        "fallback": "float16",
    }
    with pytest.raises(UnrecognizedSource, match="not a property"):
        tab.model_dtype(MODEL_CONFIG.replace("    @property\n    def torch_dtype", "    def torch_dtype"))


def test_the_llm_api_validator_is_run_below_and_at_the_capability_it_tests():
    assert tab.llm_api_dtype(VALIDATOR) == {
        "field": "dtype",
        "below_major": 9,
        "below": {"auto": "auto", "bfloat16": "float16", "float16": "float16", "float32": {"raises": "ValueError"}},
        "at_or_above": {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"},
    }


def test_the_transformers_pin_is_read_from_its_requirement_line():
    assert tab.transformers_pin(REQUIREMENTS) == {"op": "==", "version": "4.57.1"}
    assert tab.transformers_pin("transformers>=4.50,<5\n") == {"op": ">=", "version": "4.50"}
    with pytest.raises(UnrecognizedSource):
        tab.transformers_pin("torch==2.9.0\n")


class Files:
    def __init__(self, texts: dict[str, str]):
        self.texts, self.read_at = texts, []

    def read(self, repo: str, path: str, commit: str) -> str:
        self.read_at.append((repo, path, commit))
        return self.texts[path]


TEXTS = {
    tab.CONVERT_UTILS: INFER,
    tab.UTILS: UTILS,
    tab.LLAMA_CONFIG: LLAMA,
    tab.MODEL_CONFIG: MODEL_CONFIG,
    tab.LLM_ARGS: VALIDATOR,
    tab.REQUIREMENTS: REQUIREMENTS,
}


def test_tabulate_reads_every_file_at_a_commit_and_cites_it_unpinned_per_release():
    upstream = Files(TEXTS)
    table = tab.tabulate(upstream)
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for _, _, commit in upstream.read_at)
    assert list(table["releases"]) == list(tab.RELEASES)
    resolved = resolved_releases(table["releases"])
    assert resolved["0.21"]["pytorch"] is None and resolved["0.21"]["llm_api"] is None
    assert resolved["1.0"]["pytorch"]["model_dtype"]["pretrained_config_attribute"] == "dtype"
    assert resolved["1.2"]["engine"]["infer_dtype"]["auto"]["float32"] == "bfloat16"
    for release, block in resolved.items():
        files = block["source"]["files"]
        assert {f["path"] for f in files} >= {tab.CONVERT_UTILS, tab.UTILS, tab.LLAMA_CONFIG}
        assert all(not f["pinned"] and f["release_commit"] == tab.RELEASES[release]["release_commit"] for f in files)


def test_copies_of_a_file_that_disagree_are_refused():
    other = INFER.replace('return "float32"', 'return "float16"')

    class Two(Files):
        def read(self, repo: str, path: str, commit: str) -> str:
            text = super().read(repo, path, commit)
            return other if path == tab.CONVERT_UTILS and repo != tab.REPO else text

    with pytest.raises(UnrecognizedSource, match="disagree"):
        tab.tabulate(Two(TEXTS))


# ---------------------------------------------------------------- the committed trtllm_dtype table

TABLE = facts("trtllm_dtype")["releases"]


def test_the_table_covers_the_engine_workflow_from_0_21_and_the_pytorch_backend_from_1_0():
    assert releases("trtllm_dtype") == ("0.21", "1.0", "1.1", "1.2")
    assert list(TABLE) == list(tab.RELEASES)
    assert [r for r, block in TABLE.items() if block["pytorch"]] == ["1.0", "1.1", "1.2"]


@pytest.mark.parametrize("release", ["0.21", "1.0", "1.1", "1.2"])
def test_the_engine_converter_keeps_bfloat16_and_float16_and_makes_float32_float16(release):
    engine = TABLE[release]["engine"]
    assert engine["infer_dtype"]["auto"] == {
        "absent": "float16",
        "bfloat16": "bfloat16",
        "float16": "float16",
        "float32": "float16",
    }, release
    assert engine["infer_dtype"]["explicit"]["float32"] == "float32"  # an explicit float32 is kept
    assert engine["converter"] == {
        "method": "LLaMAConfig.from_hugging_face",
        "dtype_default": "auto",
        "source_dtype": {"attribute": "torch_dtype", "when_absent": None},
        "config_dtype_is_inferred": True,
    }, release


@pytest.mark.parametrize(("release", "transformers"), [("1.0", "4.53.1"), ("1.1", "4.56.0"), ("1.2", "4.57.1")])
def test_the_pytorch_backend_reads_torch_dtype_and_falls_back_to_bfloat16(release, transformers):
    pytorch = TABLE[release]["pytorch"]
    assert pytorch["model_dtype"] == {
        "property": "ModelConfig.torch_dtype",
        "pretrained_config_attribute": "torch_dtype",
        "fallback": "bfloat16",
    }, release
    assert pytorch["transformers"] == {"op": "==", "version": transformers}


@pytest.mark.parametrize("release", ["1.0", "1.1", "1.2"])
def test_the_llm_api_keeps_auto_from_compute_capability_8_and_refuses_bfloat16_below(release):
    validator = TABLE[release]["llm_api"]
    assert validator["below_major"] == 8
    assert validator["at_or_above"] == {value: value for value in tab.LLM_API_VALUES}
    assert validator["below"]["auto"] == "float16"
    assert validator["below"]["bfloat16"] == {"raises": "RuntimeError"}


def test_every_source_is_a_copy_named_by_commit_with_the_release_commit_it_stands_for():
    for release, block in TABLE.items():
        assert block["release_commit"] == tab.RELEASES[release]["release_commit"]
        for record in block["source"]["files"]:
            assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record
            assert record["pinned"] is False and record["release_commit"] == block["release_commit"], record
            assert record["path"] in tab.READ_FOR and record["read_for"] == tab.READ_FOR[record["path"]]
