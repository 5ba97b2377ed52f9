"""Tabulate what trtllm-serve of TensorRT-LLM 1.0, 1.1 and 1.2 does with an OpenAI `response_format`, and with the
other fields of a /v1/completions request the OpenAI gateway forwards to it (issue #48).

Maintainer tool, run by scripts/dev/tabulate_all.py. From `tensorrt_llm/serve/openai_protocol.py`, per release:

- `response_format.types`: the `type` values `ResponseFormat` accepts, and `fields`: its other fields.
- `response_format.guides`: per type, what `_response_format_to_guided_decoding_params` hands `GuidedDecodingParams`
  (the keyword, and the `ResponseFormat` field it takes, or the constant, or the whole format as JSON), and whether it
  refuses the type when that field is missing; null: no guide.
- `response_format.requests`: the request classes whose sampling parameters take their guide from that function.
- `completions`: which of the fields the gateway sends `CompletionRequest` has, `StreamOptions`' defaults, and which
  `logprobs` values its validator refuses ("nonzero": every value but 0, so no log-probabilities come back;
  "negative": only those below 0).
- `lora_request`: the class `CompletionRequest.lora_request` takes (from the protocol) and, from
  `tensorrt_llm/executor/request.py`, that class's fields with their types and defaults (none: required), which the
  gateway fills from the build to pick a LoRA adapter per request.

No copy was readable at a release's own commit; each is the nearest one read, chosen by content (`note`), with
`pinned` false and the `release_commit` to re-read it at.
"""

from __future__ import annotations

import ast

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, find_def, stored_releases

PROTOCOL = "tensorrt_llm/serve/openai_protocol.py"
REQUEST = "tensorrt_llm/executor/request.py"
LORA_REQUEST = "LoRARequest"
CONVERTER = "_response_format_to_guided_decoding_params"
GUIDED = "GuidedDecodingParams"
# The CompletionRequest fields the OpenAI gateway sends (pipeline/serving/openai_upstream.py `completion_body`).
FORWARDED = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "response_format",
    "lora_request",
)

RELEASES = {
    "1.0": {
        "repo": "LinPoly/TensorRT-LLM",
        "commit": "4917bb294efce01a037091b503ff281157028733",
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        # the request.py copies are chosen by content too: GenerationRequest with scheduling_params and no arrival_time
        # (1.0), with cache_salt_id and arrival_time (1.1), with cache_salt and priority (1.2)
        "request": {"repo": "BHbean/TensorRT-LLM", "commit": "2d72a889f77dcd7647ddfae12b6bf2149309ef2c"},
        "note": "Medium confidence: a copy from before regex and EBNF reached trtllm-serve (NVIDIA/TensorRT-LLM pull "
        "request 7925, opened 2025-09-23, after the 1.0 branch), read in a fork, as the brief of issue #48 describes "
        "1.0: text, json, json_object, structural_tag.",
    },
    "1.1": {
        "repo": REPO,
        "commit": "54cf7be08a3582024dfa6791e8bb8b2034bfad67",
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "request": {"repo": REPO, "commit": "4ce835a571f85cc37dcffb7268b3a4c014039ce6"},
        "note": "Medium confidence: a main-line copy with regex and ebnf and without json_schema.",
    },
    "1.2": {
        "repo": "Muqi1029/TensorRT-LLM",
        "commit": "2b7a535c563dd97385e06c3b9ac2c9d80bc086b4",
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "request": {"repo": "nv-guomingz/TensorRT-LLM", "commit": "814e71cc2669b9129f20100831fdb0c2941b9b83"},
        "note": "Medium confidence: a copy with json_schema whose whole json_schema field (OpenAI's wrapper, not the "
        "schema in it) becomes the JSON guide, read in a fork; NVIDIA/TensorRT issue 4855 reports the same of 1.2.1. "
        "This copy also adapts guides to reasoning parsers, which the request path above does not use.",
    },
}
NOTE = (
    "guides[type]: what trtllm-serve's converter hands GuidedDecodingParams for a response_format of that type: "
    "'param' the keyword, 'from' the ResponseFormat field whose value it takes whole, 'value' a constant, "
    "'whole_format' the whole response_format as JSON; 'required' it refuses the type when the field is missing; "
    "null: no guide. pipeline/targets/trtllm/openai_dialect.py translates the gateway's guides with it."
)


def _literal_values(annotation: ast.expr) -> list[str]:
    """The strings of `Literal[...]`."""
    if not (isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal"):
        raise UnrecognizedSource(f"ResponseFormat.type is not a Literal: {ast.unparse(annotation)}")
    values = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    return [ast.literal_eval(value) for value in values]


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {s.target.id: s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def response_format_class(statements: list[ast.stmt]) -> dict:
    """ResponseFormat's `type` values and its other fields."""
    cls = find_def(statements, "ResponseFormat")
    if cls is None:
        raise UnrecognizedSource("no ResponseFormat class in this text")
    fields = _fields(cls)
    if "type" not in fields:
        raise UnrecognizedSource("ResponseFormat has no `type` field")
    return {"types": _literal_values(fields["type"].annotation), "fields": [f for f in fields if f != "type"]}


def _type_tested(test: ast.expr) -> str | None:
    """X of `response_format.type == "X"`, else None."""
    if (
        isinstance(test, ast.Compare)
        and ast.unparse(test.left) == "response_format.type"
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
    ):
        return test.comparators[0].value
    return None


def _guide(body: list[ast.stmt]) -> dict | None:
    """What one branch hands GuidedDecodingParams (None: no call, no guide)."""
    calls = [n for s in body for n in ast.walk(s) if isinstance(n, ast.Call) and ast.unparse(n.func) == GUIDED]
    if not calls:
        return None
    if len(calls) > 1 or len(calls[0].keywords) != 1:
        raise UnrecognizedSource(f"a branch this tabulator cannot state: {ast.unparse(calls[0])}")
    keyword = calls[0].keywords[0]
    guide: dict = {"param": keyword.arg}
    value = keyword.value
    if isinstance(value, ast.Attribute) and ast.unparse(value.value) == "response_format":
        guide["from"] = value.attr
        checked = [
            n
            for s in body
            for n in ast.walk(s)
            if isinstance(n, ast.If)
            and ast.unparse(n.test) == f"response_format.{value.attr} is None"
            and any(isinstance(r, ast.Raise) for r in ast.walk(n))
        ]
        guide["required"] = bool(checked)
    elif isinstance(value, ast.Constant):
        guide["value"] = value.value
    elif isinstance(value, ast.Call) and ast.unparse(value.func) == "response_format.model_dump_json":
        guide["whole_format"] = True
    else:
        raise UnrecognizedSource(f"a guide value this tabulator cannot state: {ast.unparse(value)}")
    return guide


def converter_guides(statements: list[ast.stmt]) -> dict:
    """Per `response_format.type` the converter tests: the guide it makes (None: none)."""
    function = find_def(statements, CONVERTER)
    if function is None:
        raise UnrecognizedSource(f"no {CONVERTER} in this text")
    chain = next((s for s in function.body if isinstance(s, ast.If)), None)
    guides = {}
    while chain is not None:
        tested = _type_tested(chain.test)
        if tested is not None:
            guides[tested] = _guide(chain.body)
        elif ast.unparse(chain.test) != "response_format is None":
            raise UnrecognizedSource(f"a test this tabulator cannot state: {ast.unparse(chain.test)}")
        chain = chain.orelse[0] if len(chain.orelse) == 1 and isinstance(chain.orelse[0], ast.If) else None
    if not guides:
        raise UnrecognizedSource(f"{CONVERTER} tests no response_format.type")
    return guides


def guided_requests(statements: list[ast.stmt]) -> list[str]:
    """The request classes whose to_sampling_params builds the guide with the converter from self.response_format."""
    found = []
    for cls in (s for s in statements if isinstance(s, ast.ClassDef)):
        method = find_def(cls.body, "to_sampling_params")
        calls = [
            n
            for n in ast.walk(method)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == CONVERTER and n.args
        ] if method else []  # fmt: skip
        if any(ast.unparse(call.args[0]) == "self.response_format" for call in calls):
            found.append(cls.name)
    return found


def logprobs_refused(cls: ast.ClassDef) -> str:
    """Which `logprobs` values the request's check_logprobs validator refuses."""
    method = find_def(cls.body, "check_logprobs")
    if method is None:
        return "none"
    refusing = [n for n in ast.walk(method) if isinstance(n, ast.If) and any(isinstance(r, ast.Raise) for r in n.body)]
    if len(refusing) != 1:
        raise UnrecognizedSource("check_logprobs has no single refusing test")
    test = refusing[0].test
    if isinstance(test, ast.Call) and ast.unparse(test) == "data.get('logprobs')":
        return "nonzero"
    compares = [n for n in ast.walk(test) if isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.Lt)]
    if compares and all(ast.unparse(c.comparators[0]) == "0" for c in compares):
        return "negative"
    raise UnrecognizedSource(f"a logprobs check this tabulator cannot state: {ast.unparse(test)}")


def completion_request(statements: list[ast.stmt]) -> dict:
    """The forwarded fields CompletionRequest has, StreamOptions' defaults, and the logprobs it refuses."""
    request, options = find_def(statements, "CompletionRequest"), find_def(statements, "StreamOptions")
    if request is None or options is None:
        raise UnrecognizedSource("no CompletionRequest or StreamOptions class in this text")
    fields = _fields(request)
    return {
        "fields": [name for name in FORWARDED if name in fields],
        "lacks": [name for name in FORWARDED if name not in fields],
        "stream_options": {name: ast.literal_eval(f.value) for name, f in _fields(options).items()},
        "logprobs_refused": logprobs_refused(request),
    }


def lora_request_class(statements: list[ast.stmt]) -> str | None:
    """The class CompletionRequest.lora_request takes (`Optional[X]` or `X`); None where it has no such field."""
    request = find_def(statements, "CompletionRequest")
    if request is None:
        raise UnrecognizedSource("no CompletionRequest class in this text")
    field = _fields(request).get("lora_request")
    if field is None:
        return None
    annotation = field.annotation
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Optional":
        annotation = annotation.slice
    if not isinstance(annotation, ast.Name):
        raise UnrecognizedSource(f"CompletionRequest.lora_request is {ast.unparse(field.annotation)}")
    return annotation.id


def request_fields(text: str, name: str = LORA_REQUEST) -> dict:
    """The fields of dataclass `name`: {field: {"type", and "default" where it has one}}, in order."""
    cls = find_def(complete_statements(text), name)
    if cls is None:
        raise UnrecognizedSource(f"no {name} class in this text")
    fields = {}
    for field_name, statement in _fields(cls).items():
        fields[field_name] = {"type": ast.unparse(statement.annotation)}
        if statement.value is not None:
            try:
                fields[field_name]["default"] = ast.literal_eval(statement.value)
            except ValueError:
                raise UnrecognizedSource(f"{name}.{field_name} has a default this tabulator cannot state") from None
    if not fields:
        raise UnrecognizedSource(f"{name} declares no fields")
    return fields


def protocol_facts(text: str) -> dict:
    statements = complete_statements(text)
    declared = response_format_class(statements)
    guides = converter_guides(statements)
    untested = [t for t in declared["types"] if t not in guides]
    if untested:
        raise UnrecognizedSource(f"ResponseFormat types the converter does not test: {untested}")
    return {
        "response_format": {**declared, "guides": guides, "requests": guided_requests(statements)},
        "completions": completion_request(statements),
    }


def tabulate(upstream: Upstream) -> dict:
    releases = {}
    for release, spec in RELEASES.items():
        text = upstream.read(spec["repo"], PROTOCOL, spec["commit"])
        source = cite(spec["repo"], PROTOCOL, spec["commit"], pinned=False)
        made = protocol_facts(text)
        taken = lora_request_class(complete_statements(text))
        releases[release] = {
            "source": source | {"release_commit": spec["release_commit"]},
            "note": spec["note"],
            **made,
        }
        if taken is not None:
            request = spec["request"]
            fields = request_fields(upstream.read(request["repo"], REQUEST, request["commit"]), taken)
            releases[release]["lora_request"] = {
                "source": cite(request["repo"], REQUEST, request["commit"], pinned=False),
                "class": taken,
                "fields": fields,
            }
    return {"note": NOTE, "releases": stored_releases(releases)}
