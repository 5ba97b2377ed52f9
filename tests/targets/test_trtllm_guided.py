"""Guided decoding on the trtllm target: the xgrammar tokenizer info file the C++ tensorrtllm backend loads, checked
against what each release's backend reads (upstream/tensorrtllm_backend.json), and the generated configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.errors import BuildStepError
from pipeline.stages import triton_repo
from pipeline.targets.trtllm.backend import BACKENDS
from pipeline.targets.trtllm.guided import (
    GUIDED_DECODING_BACKEND,
    TOKENIZER_INFO_FILE,
    config_problems,
    detected_metadata,
    takes_guided_decoding,
    tokenizer_info_problems,
    write_tokenizer_info,
    xgrammar_facts,
    xgrammar_tokenizer_info,
)
from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES, has_option, options_problems
from pipeline.targets.trtllm.llm_api_serving import OPTIONS_FILE
from pipeline.targets.trtllm.pytorch_backend import release_options
from pipeline.targets.trtllm.repo_checks import model_checks
from pipeline.targets.trtllm.triton_cpp_backend import SUPPORTED_VERSIONS, backend_facts
from pipeline.targets.trtllm.triton_llmapi_model import LLMAPI_RELEASES, guide_inputs, llmapi_model, model_yaml_problems
from pipeline.triton.validate import validate_repo
from pipeline.upstream import facts, release_facts
from pipeline.validation import load_config
from tests.conftest import write_config
from tests.serving.test_repo import read_config, trtllm_engine_record


def test_only_0_18_lacks_guided_decoding():
    assert [v for v in SUPPORTED_VERSIONS if not takes_guided_decoding(v)] == ["0.18"]


def test_the_tokenizer_info_lists_the_vocabulary_by_id_and_serializes_the_tokenizer(tiny_llama, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    info = json.loads(write_tokenizer_info(tiny_llama, tmp_path).read_text())
    assert info["encoded_vocab"] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert info["stop_token_ids"] == [tokenizer.eos_token_id]
    text = "the quick brown fox"  # the serialized tokenizer is the same tokenizer
    assert Tokenizer.from_str(info["tokenizer_str"]).encode(text).ids == tokenizer(text)["input_ids"]
    for version in ("0.19", "1.2"):  # the keys and types each release's backend reads, no more
        assert set(info) == set(backend_facts(version)["tokenizer_info"]), version
        assert not tokenizer_info_problems(tmp_path / TOKENIZER_INFO_FILE, version), version


def test_a_tokenizer_whose_ids_have_gaps_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "word": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    with pytest.raises(BuildStepError, match=r"token ids are not 0\.\.2 without gaps \(first out of place: \[3\]\)"):
        xgrammar_tokenizer_info(tmp_path)


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "does not exist: the tensorrtllm backend fails to load without it"),
        ("{not json", "is not JSON"),
        ("[]", "holds a list, not a JSON object"),
        ({"encoded_vocab": ["a"], "tokenizer_str": "{}"}, "lacks 'stop_token_ids', which TensorRT-LLM 0.19's"),
        ({"encoded_vocab": ["a"], "tokenizer_str": "{}", "stop_token_ids": [True]}, "'stop_token_ids' is not a std"),
        ({"encoded_vocab": [1], "tokenizer_str": "{}", "stop_token_ids": [0]}, "'encoded_vocab' is not a std::vector"),
    ],
)
def test_a_tokenizer_info_file_the_backend_would_not_load_is_named_with_the_fix(tmp_path, content, problem):
    path = tmp_path / TOKENIZER_INFO_FILE
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    problems = tokenizer_info_problems(path, "0.19")
    assert len(problems) == 1 and problem in problems[0] and str(path) in problems[0], problems
    assert "rebuild the engine" in problems[0]


@pytest.mark.parametrize("version", ["0.19", "1.2"])
def test_the_engine_repository_turns_guided_decoding_on_as_the_release_takes_it(tmp_path, tiny_llama, version):
    """The tensorrt_llm model of 0.19 and 1.2: the backend value and tokenizer info file its C++ backend reads, and
    the guide inputs a request picks a guide with, each against the release's tabulated facts."""
    facts = backend_facts(version)
    cfg = load_config(
        write_config(
            tmp_path / "gpu.yaml", f'target: {{name: trtllm, trtllm_backend: tensorrt, trtllm_version: "{version}"}}\n'
        ),
        [],
    )
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, f"{version}.0")
    triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    assert not validate_repo(tmp_path / "repo", model_checks(version)).problems
    llm = read_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    params = {key: value.string_value for key, value in llm.parameters.items()}
    assert params["guided_decoding_backend"] == GUIDED_DECODING_BACKEND in facts["guided_decoding_backends"]
    info = Path(params["xgrammar_tokenizer_info_path"])
    assert info.is_absolute() and info.parent == engine.resolve()  # the C++ backend opens it as given
    assert set(json.loads(info.read_text())) == set(facts["tokenizer_info"])
    assert not tokenizer_info_problems(info, version)
    inputs = {tensor.name: tensor for tensor in llm.input}
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        assert inputs[name].optional and inputs[name].data_type == mc.TYPE_STRING, name


# ---------------------------------------------------------------- the PyTorch backend (LLM API)


def pytorch_config(tmp_path: Path, tiny_llama: Path, release: str) -> Path:
    return write_config(
        tmp_path / f"pytorch-{release}.yaml",
        f"""
        model: {{source: hf, path: {tiny_llama}}}
        target: {{name: trtllm, trtllm_backend: pytorch, trtllm_version: "{release}"}}
        quantization: {{weights: fp8, kv_cache: fp8}}
    """,
    )


@pytest.mark.parametrize("release", LLM_API_RELEASES)
def test_the_llm_api_options_turn_guided_decoding_on_where_the_release_has_the_option(tmp_path, tiny_llama, release):
    options, problems = release_options(load_config(pytorch_config(tmp_path, tiny_llama, release)))
    assert problems == [] and options_problems(options, release) == []
    table = release_facts("llm_args", release, "TorchLlmArgs")
    field = table["models"][table["root"]]["fields"].get("guided_decoding_backend")
    assert (
        ("guided_decoding_backend" in options)
        == (field is not None)
        == has_option(release, ("guided_decoding_backend",))
    )
    if field is not None:  # the release's own choices (xgrammar, llguidance in 1.0-1.2)
        assert options["guided_decoding_backend"] == GUIDED_DECODING_BACKEND in field["choices"]


def test_the_llmapi_model_yaml_for_1_2_carries_the_backend_and_its_model_takes_no_guide(tmp_path, tiny_llama):
    """1.2's Triton llmapi model: model.yaml passes guided_decoding_backend to LLM(); yet no request input of that
    model becomes a guide, so a client's guide cannot reach the LLM through it (the other path is trtllm-serve)."""
    import yaml

    cfg = load_config(pytorch_config(tmp_path, tiny_llama, "1.2"))
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / OPTIONS_FILE).write_text(yaml.safe_dump(release_options(cfg)[0]))
    llm, _ = BACKENDS["pytorch"].triton_models(cfg, engine, {})
    spec = yaml.safe_load(llm.texts["model.yaml"])
    assert spec["guided_decoding_backend"] == GUIDED_DECODING_BACKEND and not model_yaml_problems(spec, "1.2")
    for release in LLMAPI_RELEASES:
        facts = llmapi_model(release)
        declared = {row["name"] for row in facts["config"]["inputs"]}
        read = {*facts["sampling_inputs"], *facts["output_config_inputs"], facts["streaming_input"]["tensor"]}
        assert guide_inputs(release) == [], release
        # every declared input but the prompt and the cancel flag is a tabulated read: none of them is a guide
        assert declared - read == {"text_input", "stop"}, release


def test_config_problems_judge_a_written_models_guided_parameters_as_its_backend_would(tiny_llama, tmp_path):
    info = write_tokenizer_info(tiny_llama, tmp_path)
    on = {"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": str(info)}
    assert config_problems(on, "0.19") == config_problems(on, "1.2") == []
    for off in ({}, on | {"guided_decoding_backend": ""}, on | {"xgrammar_tokenizer_info_path": "${path}"}):
        assert config_problems(off, "0.19") == []  # the backend's own "off"
    assert config_problems(on | {"guided_decoding_backend": "outlines"}, "0.19") == [
        "parameter 'guided_decoding_backend' is 'outlines': TensorRT-LLM 0.19's tensorrtllm backend accepts "
        "['xgrammar'] and fails to load with anything else; set 'xgrammar'"
    ]
    (relative,) = config_problems(on | {"xgrammar_tokenizer_info_path": TOKENIZER_INFO_FILE}, "1.2")
    assert "opens it as given, from tritonserver's working directory; give an absolute path" in relative
    (missing,) = config_problems(on | {"xgrammar_tokenizer_info_path": str(tmp_path / "gone.json")}, "1.2")
    assert "gone.json does not exist" in missing


# ---------------------------------------------------------------- the xgrammar each release depends on


@pytest.mark.parametrize("release", ["1.0", "1.1", "1.2"])
def test_the_tokenizer_info_reads_right_in_the_xgrammar_the_release_depends_on(tiny_llama, tmp_path, release):
    """The file's tokenizer_str goes to the release's xgrammar (0.1.21 or 0.1.25, not the 0.2.8 once checked by
    hand), whose rules read from its source detect the vocabulary type: the word-level tiny Llama has no decoder, so
    RAW, which is right for tokens that are plain text."""
    xgrammar = xgrammar_facts(release)
    assert xgrammar["version"] == facts("trtllm_pytorch_features")["releases"][release]["xgrammar"]["version"]
    assert xgrammar["version"] == ("0.1.21" if release == "1.0" else "0.1.25")
    info = json.loads(write_tokenizer_info(tiny_llama, tmp_path).read_text())
    assert detected_metadata(json.loads(info["tokenizer_str"]), xgrammar["detect_from_hf"]) == {
        "vocab_type": "RAW",
        "add_prefix_space": False,
    }
    assert not tokenizer_info_problems(tmp_path / TOKENIZER_INFO_FILE, release)


def byte_level_tokenizer(out: Path, decoder, byte_fallback: bool = False) -> Path:
    """A byte-level BPE tokenizer (its tokens spell bytes, as GPT-2's do) with the given decoder, saved as HF does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["a", "b", "\u0120", "\u0120a", "</s>"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "a")], byte_fallback=byte_fallback))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoder
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(out)
    return out


def test_a_byte_level_tokenizer_the_releases_xgrammar_would_take_for_another_type_is_refused(tmp_path):
    """A ByteFallback-first decoder makes xgrammar detect BYTE_FALLBACK for byte-level tokens (as a GGUF-born
    tokenizer once had it): named with the xgrammar and the fix; with a ByteLevel decoder it reads as BYTE_LEVEL."""
    from tokenizers import decoders

    wrong = byte_level_tokenizer(tmp_path / "wrong", decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()]))
    path = write_tokenizer_info(wrong, tmp_path / "wrong")
    (problem,) = tokenizer_info_problems(path, "1.2")
    assert "makes xgrammar 0.1.25 (TensorRT-LLM 1.2's) take the vocabulary for BYTE_FALLBACK" in problem
    assert "give tokenizer.json a ByteLevel decoder" in problem and "rebuild the engine" in problem
    right = byte_level_tokenizer(tmp_path / "right", decoders.ByteLevel())
    info = json.loads(write_tokenizer_info(right, tmp_path / "right").read_text())
    detected = detected_metadata(json.loads(info["tokenizer_str"]), xgrammar_facts("1.0")["detect_from_hf"])
    assert detected["vocab_type"] == "BYTE_LEVEL"
    assert tokenizer_info_problems(tmp_path / "right" / TOKENIZER_INFO_FILE, "1.0") == []


def test_the_detection_rules_read_sequences_and_the_prefix_space_settings():
    rules = xgrammar_facts("1.1")["detect_from_hf"]
    fallback = {"decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}}
    assert detected_metadata(fallback, rules) == {"vocab_type": "BYTE_FALLBACK", "add_prefix_space": False}
    untyped = {"decoder": {"type": "Sequence", "decoders": [{"kind": "x"}, {"type": "ByteLevel"}]}}
    assert detected_metadata(untyped, rules)["vocab_type"] == "RAW"  # xgrammar stops at an item without a type
    metaspace = {"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"}}
    assert detected_metadata(metaspace, rules)["add_prefix_space"]
    prepend = {"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}]}}
    assert detected_metadata(prepend, rules)["add_prefix_space"]
    assert not detected_metadata({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"}}, rules)[
        "add_prefix_space"
    ]


def test_a_tokenizer_str_that_is_no_json_object_is_refused_with_the_xgrammar_that_needs_it(tmp_path):
    path = tmp_path / TOKENIZER_INFO_FILE
    path.write_text(json.dumps({"encoded_vocab": ["a"], "tokenizer_str": "[1, 2]", "stop_token_ids": [0]}))
    (problem,) = tokenizer_info_problems(path, "1.0")
    assert "'tokenizer_str' is not a JSON object, which xgrammar 0.1.21 (TensorRT-LLM 1.0's) requires" in problem


# ---------------------------------------------------------------- the C++ backend's releases 0.19-0.21

CPP_XGRAMMAR = {"0.19": "0.1.16", "0.20": "0.1.16", "0.21": "0.1.16 to 0.1.21"}


@pytest.mark.parametrize("release", sorted(CPP_XGRAMMAR))
def test_the_table_names_each_cpp_backend_releases_xgrammar_with_its_source(release):
    """0.19 and 0.20: the xgrammar pin of a requirements.txt copy of the release's line (a fork's copy, not at the
    release commit, so not pinned; its TensorRT and ModelOpt pins place it); 0.21, of which no copy was found: every
    version from 0.20's to 1.0's, each read from its tag, all reading a tokenizer alike. Not PyTorch releases."""
    table = facts("trtllm_pytorch_features")
    entry = table["cpp_backend_xgrammar"]["releases"][release]
    assert release not in table["releases"] and xgrammar_facts(release)["version"] == CPP_XGRAMMAR[release]
    source = entry["source"]
    assert re.fullmatch(r"[0-9a-f]{40}", source["release_commit"])
    assert source["release_commit_from"]["repo"] == "triton-inference-server/tensorrtllm_backend"
    named = entry["xgrammar"]["version"]
    if named:
        (copy,) = source["files"]
        assert (copy["path"], copy["pinned"], copy["release_commit"]) == (
            "requirements.txt",
            False,
            source["release_commit"],
        )
        assert entry["xgrammar"]["requirement"] == f"=={named}" and set(entry["release_line"]) == {
            "tensorrt",
            "modelopt",
        }
        versions = [named]
    else:
        versions = entry["xgrammar"]["versions"]
        assert source["files"] == [] and entry["release_line"] is None
        assert (versions[0], versions[-1]) == (xgrammar_facts("0.20")["version"], xgrammar_facts("1.0")["version"])
    for version in versions:
        cited = table["xgrammar"][version]["source"]
        assert all(f["repo"] == "mlc-ai/xgrammar" and f["pinned"] for f in cited), version
        assert {k: v for k, v in table["xgrammar"][version].items() if k != "source"} == {
            k: v for k, v in xgrammar_facts(release).items() if k != "version"
        }


@pytest.mark.parametrize("release", sorted(CPP_XGRAMMAR))
def test_a_byte_level_tokenizer_reads_right_in_a_cpp_backend_releases_xgrammar_and_a_misread_one_is_refused(
    tmp_path, release
):
    """SmolLM2-like byte-level BPE as transformers' GGUF loader leaves it (byte_fallback, a ByteFallback-first
    decoder) is taken for BYTE_FALLBACK by the release's xgrammar and refused; as `import` writes it (a ByteLevel
    decoder) it is detected BYTE_LEVEL and loads. A hand-written byte-level tokenizer whose decoder names neither type
    reads as RAW: refused too."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    from pipeline.stages.import_model import _byte_level_as_shipped

    fuse = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    gguf_born = byte_level_tokenizer(tmp_path / "gguf", fuse, byte_fallback=True)
    (problem,) = tokenizer_info_problems(write_tokenizer_info(gguf_born, gguf_born), release)
    named = f"xgrammar {CPP_XGRAMMAR[release]} (TensorRT-LLM {release}'s)"
    assert f"makes {named} take the vocabulary for BYTE_FALLBACK" in problem and "ByteLevel decoder" in problem

    tokenizer = AutoTokenizer.from_pretrained(gguf_born)
    assert _byte_level_as_shipped(tokenizer)  # what the import stage does to it
    tokenizer.save_pretrained(tmp_path / "imported")
    path = write_tokenizer_info(tmp_path / "imported", tmp_path / "imported")
    tokenizer_str = json.loads(path.read_text())["tokenizer_str"]
    detected = detected_metadata(json.loads(tokenizer_str), xgrammar_facts(release)["detect_from_hf"])
    assert detected == {"vocab_type": "BYTE_LEVEL", "add_prefix_space": False}
    assert tokenizer_info_problems(path, release) == []
    on = {"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": str(path)}
    assert config_problems(on, release) == []

    handmade = {
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "ByteLevel"}]},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "Strip"}]},
    }
    raw = tmp_path / TOKENIZER_INFO_FILE
    raw.write_text(
        json.dumps({"encoded_vocab": ["a", "\u0120a"], "tokenizer_str": json.dumps(handmade), "stop_token_ids": [0]})
    )
    (problem,) = tokenizer_info_problems(raw, release)
    assert f"makes {named} take the vocabulary for RAW" in problem
