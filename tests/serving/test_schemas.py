"""Structured outputs on real-world JSON Schema keywords (`pipeline.serving.schemas`): each keyword the grammar
cannot enforce is left out of it and checked after generation, or refused with `strict`; objects are closed unless
the schema (or the request) says otherwise. The grammar's verdict is taken token by token, as the engine takes it,
on a byte-level tokenizer made here; the schemas are written here for each keyword."""

from __future__ import annotations

import functools
import json

import llguidance
import pytest

from pipeline.bench.structured import WHITESPACE
from pipeline.serving.schemas import prepare
from pipeline.targets.onnxruntime.runtime.guided import Guide, grammar

END_OF_TEXT = 256


@functools.cache
def byte_tokenizer() -> llguidance.LLTokenizer:
    """A byte-level BPE with no merges: one token per byte, so any text is one token sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = END_OF_TEXT
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=END_OF_TEXT + 1, eos_token=END_OF_TEXT)


def grammar_takes(schema: dict, text: str, **options) -> bool:
    """Whether the engine's grammar for `schema` (as the gateway prepares it) takes `text`, token by token."""
    prepared = prepare(schema, strict=False, **options)
    tokenizer = byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar(Guide("json_schema", json.dumps(prepared.grammar_schema))))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def grammar_accepts(schema: dict, instance, **options) -> bool:
    """Whether the engine's grammar takes `instance` written as json.dumps writes it (", " and ": ")."""
    return grammar_takes(schema, json.dumps(instance), **options)


def verdict(schema: dict, instance) -> dict:
    return prepare(schema, strict=False).check(json.dumps(instance))


PAIR = {"a": {"type": "string"}, "b": {"type": "string"}}
# keyword -> (a schema using it, an instance the grammar takes but the schema does not, what the client is told)
RELAXED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], ["uniqueItems"]),
    "oneOf": (
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        3,  # an integer and a non-negative number: both branches
        ["oneOf"],
    ),
    "dependencies": (  # draft 7's spelling of the two below: a keyword of draft 7, not 2020-12
        {"$schema": "http://json-schema.org/draft-07/schema#", "properties": PAIR, "dependencies": {"a": ["b"]}},
        {"a": "x"},
        ["dependencies"],
    ),
    "dependencies without $schema": (  # read as draft 7 reads it: 2020-12's meta-schema keeps it, deprecated
        {"type": "object", "properties": PAIR, "dependencies": {"a": {"required": ["b"]}}},
        {"a": "x"},
        ["dependencies"],
    ),
    "dependentRequired": (
        {"type": "object", "properties": PAIR, "dependentRequired": {"a": ["b"]}},
        {"a": "x"},
        ["dependentRequired"],
    ),
    "dependentSchemas": (
        {"type": "object", "properties": PAIR, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": "x"},
        ["dependentSchemas"],
    ),
    "not": ({"type": "string", "not": {"const": "no"}}, "no", ["not"]),
    "minProperties": (  # of an open object; of a closed one, above 1 beside optional properties (see below)
        {"type": "object", "properties": PAIR, "additionalProperties": True, "minProperties": 1},
        {},
        ["minProperties"],
    ),
    "maxProperties": (
        {"type": "object", "properties": {**PAIR, "c": {}}, "maxProperties": 2},
        {"a": "x", "b": "y", "c": 1},
        ["maxProperties"],
    ),
    "if/then": (
        {"type": "object", "properties": PAIR, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        {"a": "x"},
        ["if", "then"],
    ),
    "recursive $ref beside keys": (
        {
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node", "type": "object"}}}},
            "$ref": "#/$defs/node",
            "required": ["next"],
        },
        {"next": 5},
        ["$ref #/$defs/node (recursive, beside other keys)"],
    ),
    "overlapping patternProperties": (
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}},
        {"ab": 1},
        ["patternProperties (overlapping)"],
    ),
    "pattern with a lookahead": (
        {"type": "string", "pattern": "^(?!x)[a-z]+$"},
        "xy",
        ["pattern ^(?!x)[a-z]+$"],
    ),
    "number bound llguidance cannot range": (
        {"type": "number", "minimum": 0, "maximum": 1e30},
        10**31,
        ["maximum 1e+30"],
    ),
}


@pytest.mark.parametrize("keyword", RELAXED)
def test_a_keyword_the_grammar_cannot_enforce_is_left_out_and_checked_after_generation(keyword):
    schema, instance, named = RELAXED[keyword]
    prepared = prepare(schema, strict=False)
    assert list(prepared.relaxed) == named
    assert grammar_accepts(schema, instance)  # the grammar lets it through ...
    report = verdict(schema, instance)  # ... and the answer says it is not valid, and why
    assert report["valid"] is False and report["relaxed"] == named and report["errors"]


# keyword -> how llguidance's refusal, quoted in the 400, names it
REFUSED_AS = {
    "uniqueItems": '"uniqueItems"',
    "oneOf": "oneOf",
    "dependencies": '"dependencies"',
    "dependencies without $schema": '"dependencies"',
    "dependentRequired": '"dependentRequired"',
    "dependentSchemas": '"dependentSchemas"',
    "not": '"not"',
    "minProperties": "min/maxProperties",
    "maxProperties": "min/maxProperties",
    "if/then": '"if", "then"',
    "recursive $ref beside keys": "#/$defs/node",
    "overlapping patternProperties": "patternProperty regexes",
    "pattern with a lookahead": "regex parse error",
    "number bound llguidance cannot range": "float range",
}


@pytest.mark.parametrize("keyword", RELAXED)
def test_with_strict_a_keyword_the_grammar_cannot_enforce_is_refused_naming_it(keyword):
    schema, _, _ = RELAXED[keyword]
    with pytest.raises(ValueError, match="cannot enforce this with strict: true") as refused:
        prepare(schema, strict=True)
    assert REFUSED_AS[keyword] in str(refused.value)


def test_one_of_whose_branches_exclude_each_other_is_enforced_exactly():
    schema = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    assert prepare(schema, strict=True).relaxed == ()
    assert grammar_accepts(schema, "x") and grammar_accepts(schema, 3) and not grammar_accepts(schema, [])


def test_min_and_max_properties_are_enforced_by_the_grammar_where_it_can_count_the_properties():
    """llguidance counts the properties of a closed object where every named one is required, or where the bound
    is 0 or 1."""
    two_optional = {"type": "object", "properties": PAIR, "minProperties": 1, "maxProperties": 1}  # closed
    assert prepare(two_optional, strict=True).relaxed == ()
    assert grammar_accepts(two_optional, {"b": "y"})
    assert not grammar_accepts(two_optional, {}) and not grammar_accepts(two_optional, {"a": "x", "b": "y"})
    pair = {"type": "object", "properties": PAIR, "required": ["a", "b"], "additionalProperties": {"type": "integer"}}
    three = {**pair, "minProperties": 3, "maxProperties": 3}
    assert prepare(three, strict=True).relaxed == ()
    assert grammar_accepts(three, {"a": "x", "b": "y", "c": 1})
    assert not grammar_accepts(three, {"a": "x", "b": "y"}) and not grammar_accepts(
        three, {"a": "x", "b": "y", "c": 1, "d": 2}
    )
    counted = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2}
    assert grammar_accepts(counted, {"c": 1}) and not grammar_accepts(counted, {})
    assert not grammar_accepts(counted, {"c": 1, "d": 2, "e": 3})


def test_the_json_layout_is_the_models_within_llama_cpps_bounds_or_one_line_as_the_schema_asks():
    """Between tokens a space, or one or two newlines and up to 20 spaces or tabs (`JSON_OPTIONS`); a schema's own
    `x-guidance` asks llguidance for one line instead, as `bench structured --whitespace compact` does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert grammar_takes(schema, '{"a":1,"b":2}') and grammar_takes(schema, '{"a": 1, "b": 2}')
    assert grammar_takes(schema, '{\n  "a": 1,\n\t"b": 2\n}') and grammar_takes(schema, "{\n\n" + " " * 20 + '"a": 1}')
    assert not grammar_takes(schema, "{\n" + " " * 21 + '"a": 1}') and not grammar_takes(schema, '{\n\n\n"a": 1}')
    assert not grammar_takes(schema, '{  "a": 1}')  # one space at most on a line
    one_line = {**schema, "x-guidance": WHITESPACE["compact"]}  # whitespace_pattern null: the engine's is dropped
    assert grammar_takes(one_line, '{"a": 1, "b": 2}') and not grammar_takes(one_line, '{\n  "a": 1}')
    assert not grammar_takes(one_line, '{"a":1}')


def test_an_unknown_format_is_an_annotation_a_known_one_is_enforced_and_asserted():
    unknown = {"type": "string", "format": "colour-hex"}
    assert prepare(unknown, strict=False).relaxed == ("format colour-hex",)
    assert verdict(unknown, "not a colour")["valid"] is True  # JSON Schema: an unknown format asserts nothing
    uuid = {"type": "string", "format": "uuid"}
    assert prepare(uuid, strict=True).relaxed == ()
    assert grammar_accepts(uuid, "123e4567-e89b-12d3-a456-426614174000") and not grammar_accepts(uuid, "nope")
    assert verdict(uuid, "nope")["valid"] is False  # what the grammar enforces is asserted after it too


def test_objects_are_closed_unless_the_schema_or_the_request_opens_them():
    named = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not grammar_accepts(named, {"a": 1, "invented": 2})  # OpenAI strict, xgrammar, llama.cpp
    assert grammar_accepts(named, {"a": 1, "invented": 2}, additional_properties_default=True)  # JSON Schema's
    opened = {**named, "additionalProperties": {"type": "string"}}
    assert grammar_accepts(opened, {"a": 1, "x": "y"}) and not grammar_accepts(opened, {"a": 1, "x": 2})
    assert grammar_accepts({"type": "object"}, {"free": True})  # names no property: any object
    assert verdict(named, {"a": 1, "invented": 2})["valid"] is True  # the client's schema allows it


@pytest.mark.parametrize(
    "schema, instance",
    [
        (  # allOf members meet in one object: closing either would forbid the other's properties
            {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
            {"a": 1, "b": 2},
        ),
        (  # a $ref extended by properties beside it
            {
                "$defs": {"base": {"properties": {"a": {"type": "integer"}}}},
                "$ref": "#/$defs/base",
                "properties": {"b": {}},
            },
            {"a": 1, "b": 2},
        ),
        (  # branches beside properties
            {"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"type": "integer"}}}]},
            {"a": 1, "b": 2},
        ),
        (  # a $ref by anchor, extended by properties beside it
            {"$defs": {"a": {"$anchor": "a", "properties": {"x": {}}}}, "properties": {"y": {}}, "$ref": "#a"},
            {"y": 2, "x": 1},  # the grammar writes the properties beside a $ref first
        ),
        (  # the same property in two allOf members: its two object schemas meet too
            {
                "allOf": [
                    {"properties": {"f": {"properties": {"a": {}}}}},
                    {"properties": {"f": {"properties": {"b": {}}}}},
                ]
            },
            {"f": {"a": 1, "b": 2}},
        ),
        (  # a $ref whose pointer is percent-encoded, as JSON Schema's URIs are
            {
                "properties": {"p": {"allOf": [{"$ref": "#/$defs/a%20b"}, {"properties": {"y": {}}}]}},
                "$defs": {"a b": {"properties": {"x": {}}}},
            },
            {"p": {"x": 1, "y": 2}},
        ),
        (  # a required property the object does not name
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
            {"a": 1, "b": 2},
        ),
    ],
)
def test_objects_whose_properties_meet_another_schemas_stay_open(schema, instance):
    assert grammar_accepts(schema, instance)
    assert verdict(schema, instance)["valid"] is True


def test_an_all_of_that_only_wraps_an_object_is_dissolved_and_the_object_closed():
    schema = {"type": "object", "description": "wrapper", "allOf": [{"properties": {"a": {"type": "integer"}}}]}
    assert prepare(schema, strict=False).grammar_schema == {
        "type": "object",
        "description": "wrapper",
        "properties": {"a": {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}},
        "additionalProperties": False,
    }
    assert not grammar_accepts(schema, {"a": 1, "b": 2}) and verdict(schema, {"a": 1, "b": 2})["valid"] is True


def test_numbers_stay_within_i_json_where_the_schema_does_not_bound_them():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}}}
    assert grammar_accepts(schema, {"n": 2**53 - 1, "x": -1.5}) and not grammar_accepts(schema, {"n": 2**53})
    assert not grammar_accepts(schema, {"x": 10**17}) and grammar_accepts(schema, {"x": None})
    big = {"type": "integer", "minimum": 10**16}  # a bound of its own beyond ours: left as written
    assert grammar_accepts(big, 10**17)
    assert verdict(schema, {"n": 10**17})["valid"] is True  # checked against the schema as written


def test_strings_stay_within_256_characters_where_the_schema_does_not_bound_them():
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "long": {"type": "string", "maxLength": 999}}}
    assert grammar_accepts(schema, {"s": "x" * 256}) and not grammar_accepts(schema, {"s": "x" * 257})
    assert grammar_accepts(schema, {"long": "x" * 999})  # a bound of its own: the schema's
    assert verdict(schema, {"s": "x" * 1000})["valid"] is True  # checked against the schema as written


def test_alternatives_alone_are_each_closed():
    schema = {"anyOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "string"}}}]}
    assert grammar_accepts(schema, {"a": 1}) and grammar_accepts(schema, {"b": "x"})
    assert not grammar_accepts(schema, {"a": 1, "c": 3})


def test_the_check_says_why_an_answer_is_not_valid():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    assert verdict(schema, {"n": 2}) == {"valid": True, "relaxed": []}
    assert verdict(schema, {"n": 9})["errors"] == ["$.n: 9 is greater than the maximum of 3"]
    unfinished = prepare(schema, strict=False).check('{"n": ')
    assert unfinished["valid"] is False and unfinished["errors"][0].startswith("not JSON")


def test_the_schemas_own_draft_is_used_and_a_schema_that_is_none_is_refused():
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number",
        "maximum": 3,
        "exclusiveMaximum": True,
    }
    assert verdict(draft4, 3)["valid"] is False  # draft 4's boolean exclusiveMaximum
    with pytest.raises(ValueError, match="not a valid JSON Schema at type"):
        prepare({"type": "integr"}, strict=False)


def test_only_the_objects_whose_properties_llguidance_cannot_count_lose_their_counts():
    counted = {"type": "object", "properties": PAIR, "maxProperties": 1}  # closed, a bound of 1: counted
    uncounted = {"type": "object", "properties": {"e": {}}, "additionalProperties": True, "minProperties": 1}
    schema = {"type": "object", "properties": {"c": counted, "d": uncounted}}
    prepared = prepare(schema, strict=False)
    assert prepared.relaxed == ("minProperties",)
    assert prepared.grammar_schema["properties"]["c"]["maxProperties"] == 1
    assert not grammar_accepts(schema, {"c": {"a": "x", "b": "y"}})


def test_every_unknown_format_is_left_out_at_once():
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "format": f"fmt{i}"} for i in range(20)}}
    assert len(prepare(schema, strict=False).relaxed) == 20  # more than a round per format would allow
    assert prepare({"type": "string", "format": ""}, strict=False).relaxed == ("format ",)


def test_a_string_bound_never_undercuts_the_schemas_min_length():
    schema = {"type": "string", "minLength": 300}  # 256 characters beyond it
    assert grammar_accepts(schema, "x" * 556) and not grammar_accepts(schema, "x" * 557)


def test_a_schema_in_draft_3_or_naming_a_draft_llguidance_does_not_know_is_taken():
    draft3 = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "string", "format": "ip-address"}
    assert verdict(draft3, "x")["relaxed"] == ["format ip-address"]
    https = {"$schema": "https://json-schema.org/draft-07/schema#", "type": "integer"}  # not fetched: left out
    assert prepare(https, strict=True).relaxed == () and grammar_accepts(https, 3) and not grammar_accepts(https, "3")


def test_a_schema_or_an_answer_nested_too_deep_is_refused_or_unchecked_never_a_server_error():
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper"):
        prepare(deep, strict=False)
    recursive = prepare({"type": "array", "items": {"$ref": "#"}}, strict=False)
    report = recursive.check("[" * 1200 + "]" * 1200)
    assert report["valid"] is None and "nested deeper" in report["errors"][0]


@pytest.mark.parametrize(
    "options",
    [{"lenient": True}, {"coerce_one_of": True}, [], {"item_separator": "X"}, {"whitespace_pattern": "[a-z]*"}],
    ids=["lenient", "coerce_one_of", "not an object", "a separator not a comma", "a pattern of the client's"],
)
def test_llguidance_options_other_than_a_json_layout_are_refused(options):
    """`lenient` would let llguidance leave out what it cannot enforce unannounced (past `strict`), `coerce_one_of`
    enforce oneOf as anyOf, a separator or whitespace pattern of the client's admit text that is not JSON: the client
    may set how JSON is laid out, not what is enforced."""
    schema = {"type": "array", "uniqueItems": True, "x-guidance": options}
    for strict in (True, False):
        with pytest.raises(ValueError, match="x-guidance: "):
            prepare(schema, strict=strict)
    layout = {"type": "array", "x-guidance": {"item_separator": " , ", "whitespace_pattern": None}}
    assert grammar_takes(layout, "[1 , 2]") and not grammar_takes(layout, "[1,2]")


def test_a_tools_parameters_keep_their_local_references():
    """pydantic writes `$defs` and `#/$defs/...` references; the calls' format puts each function's parameters
    inside it, where those references are rewritten to point."""
    from pipeline.serving.protocol import Tool, tool_constraint

    def tool(name: str, kind: str) -> Tool:
        parameters = {"$defs": {"T": {"type": kind}}, "type": "object", "properties": {"v": {"$ref": "#/$defs/T"}}}
        return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})

    def own_base(name: str, kind: str) -> Tool:  # references under a $id are the $id's: they stay as written
        return tool(name, kind).model_copy(
            update={
                "function": tool(name, kind).function.model_copy(
                    update={
                        "parameters": {
                            "$id": "https://example.com/p.json",
                            **tool(name, kind).function.parameters,
                            "$schema": "https://json-schema.org/draft-07/schema#",  # not one llguidance knows: left out
                        }
                    }
                )
            }
        )

    for tools in ([tool("f", "integer")], [tool("f", "integer"), tool("g", "string")], [own_base("f", "integer")]):
        prepared = tool_constraint(tools, "required", False).schema
        assert prepared.check(json.dumps([{"name": "f", "arguments": {"v": 1}}]))["valid"] is True
        assert prepared.check(json.dumps([{"name": "f", "arguments": {"v": "1"}}]))["valid"] is False
        assert tools[0].function.parameters["properties"]["v"]["$ref"] == "#/$defs/T"  # the client's, untouched


def test_tool_parameters_nested_too_deep_are_a_400_naming_the_field():
    from pipeline.serving.protocol import ChatRequest, OpenAIError

    deep = {"type": "integer"}
    for _ in range(500):
        deep = {"type": "array", "items": deep}
    request = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}],
            "tool_choice": "required",
        }
    )
    with pytest.raises(OpenAIError, match="nested deeper") as refused:
        request.constraint
    assert refused.value.status == 400 and refused.value.param == "tool_choice"


def test_a_ref_into_a_one_of_still_points_at_its_branch_once_one_of_is_any_of():
    schema = {
        "properties": {
            "a": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "b": {"$ref": "#/properties/a/oneOf/0"},
        }
    }
    assert prepare(schema, strict=False).relaxed == ("oneOf",)
    assert grammar_accepts(schema, {"b": 1}) and not grammar_accepts(schema, {"b": 1.5})


@pytest.mark.parametrize(
    "schema, instance",
    [
        ({"type": "string", "allOf": [{"minLength": 300}]}, "x" * 400),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "minLength": 300}, "x" * 400),
        ({"$defs": {"n": {"type": "number"}}, "$ref": "#/$defs/n", "minimum": 1e16}, 10**17),
    ],
    ids=["minLength in an allOf", "minLength beside a $ref", "minimum beside a $ref"],
)
def test_bounds_of_ours_that_meet_the_schemas_own_elsewhere_are_left_out(schema, instance):
    assert prepare(schema, strict=True).relaxed == ()
    assert grammar_accepts(schema, instance)


def test_a_count_written_as_a_decimal_is_the_integer_it_is():
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 2.0, "minItems": 1.0}
    assert prepare(schema, strict=True).relaxed == ()
    assert (
        grammar_accepts(schema, [1, 2]) and not grammar_accepts(schema, [1, 2, 3]) and not grammar_accepts(schema, [])
    )
    assert verdict(schema, [1, 2, 3])["valid"] is False


def test_a_pattern_is_ecma_262s_not_pythons():
    """`\\p{Letter}` is an ECMA-262 regex (JSON Schema's dialect) that Python's `re` refuses: the schema is taken,
    the grammar enforces the pattern, and an answer jsonschema cannot check is said to be unchecked."""
    schema = {"type": "string", "pattern": "^\\p{Letter}+$"}
    assert prepare(schema, strict=True).relaxed == ()
    assert grammar_takes(schema, '"Ωmega"') and not grammar_takes(schema, '"a1"')
    report = verdict(schema, "Ωmega")
    assert report["valid"] is None and report["errors"][0].startswith("not checked")


def test_key_order_is_the_clients():
    schema = {"type": "object", "properties": {"z": {"const": 1}, "a": {"const": 2}}, "required": ["z", "a"]}
    assert list(prepare(schema, strict=False).grammar_schema["properties"]) == ["z", "a"]
    assert grammar_accepts(schema, {"z": 1, "a": 2})


def test_a_request_opens_objects_and_a_strict_function_refuses_what_the_grammar_cannot_enforce():
    """The request's own fields, as the gateway reads them (`Sampling.constraint`)."""
    from pipeline.serving.protocol import ChatRequest, OpenAIError

    named = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": named}}
    closed = ChatRequest(**ask, response_format=json_schema)
    opened = ChatRequest(**ask, response_format=json_schema, additional_properties_default=True)
    assert json.loads(closed.guide[1])["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(opened.guide[1])
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    tool = {"type": "function", "function": {"name": "tag", "parameters": unique}}
    relaxed = ChatRequest(**ask, tools=[tool], tool_choice="required")
    assert relaxed.constraint.schema.relaxed == ("uniqueItems",)
    strict = ChatRequest(
        **ask, tools=[{**tool, "function": {**tool["function"], "strict": True}}], tool_choice="required"
    )
    with pytest.raises(OpenAIError, match="uniqueItems") as refused:
        strict.constraint
    assert refused.value.status == 400 and refused.value.param == "tool_choice"


def test_a_schema_being_prepared_holds_up_no_other_requests_constraint(monkeypatch):
    """Each request works out its own constraint: while one request's schema is prepared (a megabyte takes a second),
    another request's constraint is worked out at once (functools.cached_property would have made it wait: Python
    3.11's holds one lock for every instance)."""
    import threading

    from pipeline.serving import protocol

    preparing, release = threading.Event(), threading.Event()
    prepare_as_before = protocol.prepare

    def slow_prepare(schema, **options):
        if schema.get("title") == "slow":
            preparing.set()
            release.wait(30)
        return prepare_as_before(schema, **options)

    monkeypatch.setattr(protocol, "prepare", slow_prepare)

    def request(title: str) -> protocol.ChatRequest:
        schema = {"title": title, "type": "object", "properties": {"a": {"type": "integer"}}}
        return protocol.ChatRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": title, "schema": schema}},
            }
        )

    slow, other = request("slow"), request("other")
    worker = threading.Thread(target=lambda: slow.constraint)
    worker.start()
    assert preparing.wait(30)
    done = threading.Event()
    threading.Thread(target=lambda: (other.constraint, done.set()), daemon=True).start()
    assert done.wait(10), "the other request waited for the slow one's schema"
    release.set()
    worker.join(30)
    assert slow.constraint.schema.schema["title"] == "slow" and other.constraint.guide[0] == "json_schema"


def test_only_the_number_bounds_llguidance_cannot_range_are_left_out():
    schema = {
        "properties": {
            "a": {"type": "number", "minimum": 0, "maximum": 1e30},
            "b": {"type": "integer", "minimum": 10**16},  # beyond ours, but llguidance ranges it
        }
    }
    prepared = prepare(schema, strict=False)
    assert prepared.relaxed == ("maximum 1e+30",) and prepared.grammar_schema["properties"]["b"]["minimum"] == 10**16
