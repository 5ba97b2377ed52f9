"""scripts/dev/tabulate_trtllm_response_format.py on short inputs written here in the syntax of the file it reads
(openai_protocol.py's ResponseFormat, its converter and CompletionRequest), the committed table, and the gateway's
translation of its guides into each release's response_format (pipeline/targets/trtllm/openai_dialect.py)."""

import json

import pytest

from pipeline.targets.trtllm import openai_dialect
from pipeline.targets.trtllm.openai_dialect import adapter_fields, dialect, response_format
from pipeline.upstream import facts, releases
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_response_format")
TABLE = facts("trtllm_response_format")["releases"]


def table_block(release: str) -> dict:
    """A release's block as the code reads it (a stored block may be `same_as` or `based_on` another)."""
    return openai_dialect.facts(release)


# A made-up protocol in the upstream's syntax: two ways a branch hands over its guide, a constant, the whole format.
PROTOCOL = """
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = True


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "shape", "wrapped", "anything", "tagged"]
    shape: Optional[dict] = None
    wrapped: Optional[dict] = None


def _response_format_to_guided_decoding_params(response_format):
    if response_format is None:
        return None
    elif response_format.type == "text":
        return None
    elif response_format.type == "shape":
        if response_format.shape is None:
            raise ValueError("no shape")
        return GuidedDecodingParams(json=response_format.shape)
    elif response_format.type == "wrapped":
        made = GuidedDecodingParams(json=response_format.wrapped)
    elif response_format.type == "anything":
        return GuidedDecodingParams(json_object=True)
    elif response_format.type == "tagged":
        return GuidedDecodingParams(structural_tag=response_format.model_dump_json())
    else:
        raise ValueError("no such type")


class CompletionRequest(OpenAIBaseModel):
    model: str
    prompt: str
    logprobs: Optional[int] = None
    lora_request: Optional[AdapterPick] = None
    response_format: Optional[ResponseFormat] = None

    def to_sampling_params(self):
        return SamplingParams(guided_decoding=_response_format_to_guided_decoding_params(self.response_format))

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data):
        if data.get("logprobs"):
            raise ValueError("refused")
        return data
"""


def test_guides_name_the_keyword_and_the_field_or_constant_it_takes():
    made = tab.protocol_facts(PROTOCOL)["response_format"]
    assert made["types"] == ["text", "shape", "wrapped", "anything", "tagged"]
    assert made["fields"] == ["shape", "wrapped"]
    assert made["guides"] == {
        "text": None,
        "shape": {"param": "json", "from": "shape", "required": True},
        "wrapped": {"param": "json", "from": "wrapped", "required": False},
        "anything": {"param": "json_object", "value": True},
        "tagged": {"param": "structural_tag", "whole_format": True},
    }
    assert made["requests"] == ["CompletionRequest"]


def test_completion_fields_stream_options_and_the_logprobs_refused():
    made = tab.protocol_facts(PROTOCOL)["completions"]
    assert made["fields"] == ["model", "prompt", "logprobs", "response_format", "lora_request"]
    assert "stop" in made["lacks"] and "seed" in made["lacks"]
    assert made["stream_options"] == {"include_usage": False, "continuous_usage_stats": True}
    assert made["logprobs_refused"] == "nonzero"
    negative = PROTOCOL.replace('if data.get("logprobs"):', 'if (n := data.get("logprobs")) is not None and n < 0:')
    assert tab.protocol_facts(negative)["completions"]["logprobs_refused"] == "negative"


# A made-up request.py in the upstream's syntax: the class CompletionRequest.lora_request takes.
REQUEST = """
@dataclass(slots=True)
class AdapterPick:
    name: str
    number: int
    path: str = ""
    source: Optional[str] = "hf"

    def __post_init__(self):
        if not self.path:
            raise ValueError("no path")
"""


def test_the_lora_request_class_and_its_fields_types_and_defaults():
    assert tab.lora_request_class(tab.complete_statements(PROTOCOL)) == "AdapterPick"
    unpicked = PROTOCOL.replace("    lora_request: Optional[AdapterPick] = None\n", "")
    assert tab.lora_request_class(tab.complete_statements(unpicked)) is None
    assert tab.request_fields(REQUEST, "AdapterPick") == {
        "name": {"type": "str"},
        "number": {"type": "int"},
        "path": {"type": "str", "default": ""},
        "source": {"type": "Optional[str]", "default": "hf"},
    }
    with pytest.raises(tab.UnrecognizedSource, match="cannot state"):
        tab.request_fields(REQUEST.replace('= "hf"', "= default_source()"), "AdapterPick")
    with pytest.raises(tab.UnrecognizedSource, match="no LoRARequest class"):
        tab.request_fields(REQUEST)


def test_a_type_the_converter_does_not_test_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="does not test"):
        tab.protocol_facts(PROTOCOL.replace('"tagged"]', '"tagged", "new"]'))


def test_a_guide_it_cannot_state_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="guide value"):
        tab.protocol_facts(PROTOCOL.replace("json=response_format.shape", "json=load(response_format)"))


# ---------------------------------------------------------------- the committed table


@pytest.mark.parametrize("release", releases("trtllm_response_format"))
def test_every_release_cites_a_commit_and_holds_no_upstream_text(release):
    block = TABLE[release]
    assert len(block["source"]["commit"]) == 40 and block["source"]["pinned"] is False
    assert len(block["source"]["release_commit"]) == 40
    assert "CompletionRequest" in block["response_format"]["requests"]
    text = json.dumps(block)
    assert "raise" not in text and "self." not in text


@pytest.mark.parametrize("release", releases("trtllm_response_format"))
def test_every_release_takes_a_lora_request_of_name_integer_id_and_path(release):
    """What the gateway fills for an adapter of the build (openai_dialect.adapter_fields), cited per release."""
    block = table_block(release)
    taken = block["lora_request"]
    assert "lora_request" in block["completions"]["fields"] and taken["class"] == "LoRARequest"
    assert taken["source"]["path"] == "tensorrt_llm/executor/request.py" and len(taken["source"]["commit"]) == 40
    assert taken["source"]["pinned"] is False
    fields = taken["fields"]
    assert {
        f: fields[f]["type"] for f in ("lora_name", "lora_int_id", "lora_path")
    } == openai_dialect.LORA_REQUEST_FIELDS
    assert [f for f, spec in fields.items() if "default" not in spec] == ["lora_name", "lora_int_id"]


def test_the_table_says_what_issue_48_reports():
    """1.0: text, json, json_object, structural_tag; 1.1 adds regex and ebnf; 1.2 accepts json_schema but hands the
    grammar its whole json_schema field (OpenAI's wrapper); every release's json type takes the schema itself."""
    assert TABLE["1.0"]["response_format"]["types"] == ["text", "json", "json_object", "structural_tag"]
    assert {"regex", "ebnf"} <= set(TABLE["1.1"]["response_format"]["types"])
    assert "json_schema" not in TABLE["1.1"]["response_format"]["types"]
    assert TABLE["1.2"]["response_format"]["guides"]["json_schema"] == {
        "param": "json",
        "from": "json_schema",
        "required": True,
    }
    for release in releases("trtllm_response_format"):
        assert TABLE[release]["response_format"]["guides"]["json"]["from"] == "schema"


# ---------------------------------------------------------------- the gateway's translation

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


@pytest.mark.parametrize("release", ["1.0", "1.1", "1.2"])
def test_a_json_schema_reaches_every_release_as_its_json_type_with_the_schema_itself(release):
    """Never as 1.2's json_schema type, whose whole field (OpenAI's wrapper, if forwarded as it came) is the guide."""
    assert response_format(release, ("json_schema", json.dumps(SCHEMA))) == {"type": "json", "schema": SCHEMA}
    assert response_format(release, ("json", "")) == {"type": "json_object"}


def test_regex_and_grammar_reach_the_releases_that_enforce_them_and_are_refused_by_1_0():
    for release in ("1.1", "1.2"):
        assert response_format(release, ("regex", "a+")) == {"type": "regex", "regex": "a+"}
        assert response_format(release, ("ebnf_grammar", 'root ::= "a"')) == {"type": "ebnf", "ebnf": 'root ::= "a"'}
    for kind in ("regex", "ebnf_grammar"):
        with pytest.raises(ValueError, match=f"TensorRT-LLM 1.0 cannot enforce a {kind} guide"):
            response_format("1.0", (kind, "a+"))


def test_log_probabilities_come_back_only_from_the_release_that_accepts_logprobs():
    assert [dialect(release).chosen_logprobs for release in ("1.0", "1.1", "1.2")] == [None, None, 1]
    assert {"stop", "seed", "min_tokens", "ignore_eos", "stream_options"} <= dialect("1.2").takes


def test_an_adapter_of_the_build_is_picked_by_the_releases_lora_request(monkeypatch):
    for release in ("1.0", "1.1", "1.2"):
        picked = adapter_fields(release, "upper", 1, "/out/lora/upper")
        assert picked == {"lora_request": {"lora_name": "upper", "lora_int_id": 1, "lora_path": "/out/lora/upper"}}
        assert set(picked) <= dialect(release).takes
    block = json.loads(json.dumps(openai_dialect.facts("1.2")))  # 1.2's facts, with one more required field
    block["lora_request"]["fields"]["lora_owner"] = {"type": "str"}
    monkeypatch.setattr(openai_dialect, "facts", lambda release: block)
    with pytest.raises(ValueError, match="LoRARequest also requires lora_owner"):
        adapter_fields("1.2", "upper", 1, "/out/lora/upper")
    block["lora_request"]["fields"]["lora_int_id"] = {"type": "str"}
    with pytest.raises(ValueError, match="has no lora_int_id: int"):
        adapter_fields("1.2", "upper", 1, "/out/lora/upper")
    block["completions"]["fields"].remove("lora_request")
    with pytest.raises(ValueError, match="takes no lora_request"):
        adapter_fields("1.2", "upper", 1, "/out/lora/upper")
