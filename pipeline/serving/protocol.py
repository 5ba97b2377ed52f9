"""The OpenAI-compatible API's request and error shapes (`pipeline.serving.app` serves them), and what a request
asks the output to look like, as the engine's guided-decoding guide: the `response_format` of OpenAI and
trtllm-serve, vLLM's `structured_outputs`, and tool calls (`tools`, `tool_choice`).

Each shape becomes a `Constraint`: (guided_decoding_guide_type, guided_decoding_guide), the two inputs of the
`tensorrt_llm` model (whichever target's model stands there), and for JSON the client's schema, prepared for the
grammar and for checking the answer (`pipeline.serving.schemas`); a shape the engine cannot take is a 400 naming the
field. Tool calls are written in one generic format every model can be guided into: a JSON array of
`{"name": ..., "arguments": {...}}`; `required` and a named function are enforced by a grammar built from the
functions' own parameter schemas.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

from pipeline.serving.schemas import PreparedSchema, every_schema, prepare

Guide = tuple[str, str]  # (guided_decoding_guide_type, guided_decoding_guide)


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its answer to: the engine's `guide`, and for JSON the `schema` the answer is
    checked against once generated (None for a regex or a grammar, which the engine enforces whole)."""

    guide: Guide
    schema: PreparedSchema | None = None


def json_constraint(schema: dict, strict: bool, additional_properties_default: bool) -> Constraint:
    """A JSON schema's constraint: the grammar gets the schema as `prepare` makes it."""
    prepared = prepare(schema, strict=strict, additional_properties_default=additional_properties_default)
    return Constraint(("json_schema", json.dumps(prepared.grammar_schema)), prepared)


def any_object() -> Constraint:
    """OpenAI's json_object: the engine's `json` guide, the answer checked to be an object."""
    return Constraint(("json", ""), prepare({"type": "object"}, strict=True))


UNSET = object()  # a request's constraint not worked out yet
INT32_MAX = 2**31 - 1  # max_tokens and min_length are TYPE_INT32 tensors
UINT64_MAX = 2**64 - 1  # random_seed is TYPE_UINT64


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (text, json_object, json_schema) and trtllm-serve's further types (json with
    `schema`, regex, ebnf: NVIDIA/TensorRT-LLM tensorrt_llm/serve/openai_protocol.py `ResponseFormat`)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema", "json", "regex", "ebnf", "structural_tag"]
    json_schema: dict | None = None  # OpenAI: {"name", "schema", "strict", "description"}
    schema_: dict | None = Field(None, alias="schema")  # trtllm-serve's type json
    regex: str | None = None
    ebnf: str | None = None

    def constraint(self, additional_properties_default: bool) -> Constraint | None:
        """The answer's constraint; None for text. OpenAI's `strict` (false unless given) decides whether a schema
        keyword the grammar cannot enforce is refused or checked after generation."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return any_object()
        if self.type == "structural_tag":
            raise ValueError("type structural_tag is not supported by this server; use json_schema, regex or ebnf")
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("type json_schema needs json_schema.schema, the JSON schema as an object")
            strict = bool(self.json_schema.get("strict"))
            return json_constraint(schema, strict, additional_properties_default)
        value = {"json": self.schema_, "regex": self.regex, "ebnf": self.ebnf}[self.type]
        if value is None:
            field = "schema" if self.type == "json" else self.type
            raise ValueError(f"type {self.type} needs response_format.{field}")
        if self.type == "json":
            return json_constraint(value, False, additional_properties_default)
        return Constraint(({"regex": "regex", "ebnf": "ebnf_grammar"}[self.type], value))


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (vllm-project/vllm vllm/sampling_params.py `StructuredOutputsParams`): exactly
    one constraint."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self, additional_properties_default: bool) -> Constraint:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {len(given)})")
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, dict) else json_object_text(self.json_)
            return json_constraint(schema, False, additional_properties_default)
        if self.regex is not None:
            return Constraint(("regex", self.regex))
        if self.choice is not None:  # one of the strings, exactly
            return Constraint(("regex", "(" + "|".join(re.escape(choice) for choice in self.choice) + ")"))
        if self.grammar is not None:
            return Constraint(("ebnf_grammar", self.grammar))
        return any_object()


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class ChosenFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def calls_schema(tools: list[Tool]) -> dict:
    """The generic format: one or more calls, each naming a function and giving arguments valid for it. Each
    function's parameters move inside it, so their local references (`#/$defs/...`, as pydantic writes them) are
    rewritten to where they now are."""
    places = ["#/items"] if len(tools) == 1 else [f"#/items/anyOf/{index}" for index in range(len(tools))]
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": moved(tool.function.parameters, f"{place}/properties/arguments"),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool, place in zip(tools, places)
    ]
    return {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}


def moved(schema: dict, place: str) -> dict:
    """A copy of `schema` whose local references point where it is put (`place`, a JSON pointer of the new root).
    Those under a `$id` stay: they are relative to that schema, which stays their base wherever it is put."""
    copied = copy.deepcopy(schema)
    if "$id" in copied:
        return copied
    found = [
        part
        for part in every_schema(copied, enter=lambda sub: "$id" not in sub)
        if isinstance(part.get("$ref"), str) and (part["$ref"] == "#" or part["$ref"].startswith("#/"))
    ]
    for part in found:  # rewritten once all are found: a pointer is followed as the client wrote it
        part["$ref"] = place + part["$ref"][1:]
    return copied


def chosen_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the model may call under `choice` (none for "none"); ValueError for a name no tool has."""
    if choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.function.name == choice.function.name]
        if not named:
            raise ValueError(f"names function {choice.function.name!r}, which is not among the tools")
        return named
    return tools


def tool_constraint(tools: list[Tool], choice: ToolChoice, additional_properties_default: bool) -> Constraint | None:
    """`required` and a named function: the output must be calls (to that function); `auto` and `none`: free. A
    keyword the grammar cannot enforce is refused when a function asks for `strict`."""
    if not tools or choice in ("auto", "none"):
        return None
    chosen = chosen_tools(tools, choice)
    strict = any(tool.function.strict for tool in chosen)
    return json_constraint(calls_schema(chosen), strict, additional_properties_default)


def json_object_text(text: str) -> dict:
    """A schema given as JSON text, as an object; ValueError otherwise."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("json: a JSON schema is an object")
    return schema


def tool_prompt(tools: list[Tool]) -> str:
    """A system message for chat templates that do not render tools themselves: the functions and the format."""
    listed = json.dumps([tool.function.model_dump(exclude_none=True) for tool in tools])
    return (
        "You can call these functions:\n"
        f"{listed}\n"
        "To call one or more of them, answer with only a JSON array of calls, each "
        '{"name": <function name>, "arguments": <an object of its parameters>}. Otherwise answer normally.'
    )


def parse_calls(text: str, tools: list[Tool]) -> list[dict] | None:
    """The OpenAI `tool_calls` in an answer written in the generic format, or None when it is not a call of these
    tools (then it is content)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    names = {tool.function.name for tool in tools}
    valid = (
        isinstance(calls, list)
        and calls
        and all(isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict) for c in calls)
    )
    if not valid:
        return None
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in calls
    ]


# OpenAI fields the engine cannot honour, with the value that asks for nothing: any other value is a
# 400, never a silently different answer. Other unknown fields are ignored, as vLLM does.
UNSUPPORTED = {
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "functions": None,
    "function_call": "none",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _encodable(value: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer or UTF-8 tensor can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate at index {exc.start}, which is not valid Unicode") from None
    return value


def _chosen_only(value: int | None) -> int | None:
    if value:
        raise ValueError("only 0 is supported: the engine returns the chosen token's log-probability, no alternatives")
    return value


def _text_parts(content: str | list[dict]) -> str:
    """Current openai clients may send content as a list of parts; text parts are joined with newlines, as vLLM
    does, and any other part is refused by name rather than dropped."""
    if isinstance(content, str):
        return content
    for index, part in enumerate(content):
        if part.get("type") != "text":
            raise ValueError(f"part {index} is of type {part.get('type')!r}: this server takes only text parts")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {index}: a text part needs a string 'text'")
    return _encodable("\n".join(part["text"] for part in content))


Text = Annotated[str, AfterValidator(_encodable)]
Content = Annotated[Text | list[dict], AfterValidator(_text_parts)]
ChosenOnly = Annotated[int | None, AfterValidator(_chosen_only)]  # number of alternative tokens asked for


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extension: usage in every chunk, so a client counts the tokens of each (a chunk may carry several)
    continuous_usage_stats: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept in model_extra, where UNSUPPORTED is looked up

    model: Text
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request, like the engine's beam width 1
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # vLLM's extension: end of sequence blocked until then
    ignore_eos: bool = False  # vLLM's extension: generate on past end of sequence, to max_tokens (benchmarks)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    # This server's extension: what an object schema that does not say `additionalProperties` allows beside the
    # properties it names: nothing (false, as OpenAI's strict mode, xgrammar and llama.cpp have it) or anything (true,
    # JSON Schema's own default)
    additional_properties_default: bool = False
    _constraint: Constraint | None | object = PrivateAttr(default_factory=lambda: UNSET)

    def formats(self) -> dict:
        """The request's fields that may constrain the answer: name -> a callable giving its Constraint (or None)."""
        return {
            name: functools.partial(section.constraint, self.additional_properties_default)
            for name in ("response_format", "structured_outputs")
            if (section := getattr(self, name)) is not None
        }

    @property
    def guide(self) -> Guide | None:
        """The engine's guide (guided_decoding_guide_type, guided_decoding_guide), or None."""
        return self.constraint.guide if self.constraint is not None else None

    @property
    def constraint(self) -> Constraint | None:
        """The answer's constraint from response_format, structured_outputs or tool_choice, or None; OpenAIError 400
        naming the field for one the engine cannot take. Worked out once a request (the gateway checks it first, on
        a worker thread, then sends it). Not a functools.cached_property: Python 3.11's holds one lock for every
        instance, so one request preparing a large schema held up every other request's constraint."""
        if self._constraint is UNSET:
            self._constraint = self._work_out_constraint()
        return self._constraint

    def _work_out_constraint(self) -> Constraint | None:
        guides = {}
        for name, constraint_of in self.formats().items():
            try:
                guide = constraint_of()
            except ValueError as exc:
                raise OpenAIError(400, f"{name}: {exc}", param=name) from None
            except RecursionError:
                raise OpenAIError(400, f"{name}: nested deeper than it can be read", param=name) from None
            if guide is not None:
                guides[name] = guide
        if len(guides) > 1:
            raise OpenAIError(400, f"give one of {' and '.join(guides)}, not both", param=list(guides)[-1])
        for name in guides:
            for option in ("min_tokens", "ignore_eos"):
                if getattr(self, option):
                    raise OpenAIError(
                        400, f"{option} with {name}: the format decides where the output ends", param=option
                    )
        return next(iter(guides.values()), None)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_limit(self) -> int | None:
        return self.max_tokens

    def shows_tokens(self) -> bool:
        """Whether the answer shows each token on its own (log-probabilities asked for); if not, the tokens of one
        upstream response may be streamed as one piece."""
        return False


class CompletionRequest(Sampling):
    prompt: Text
    logprobs: ChosenOnly = Field(None, ge=0, le=5)  # OpenAI allows up to 5 alternatives

    def shows_tokens(self) -> bool:
        return self.logprobs is not None


def _json_or_text(function: dict):
    """A call's arguments as the JSON the model wrote (a client's string that is not JSON stays a string)."""
    try:
        return json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return function.get("arguments")


class ChatMessage(BaseModel):
    role: Literal["developer", "system", "user", "assistant", "tool"]
    content: Content | None = None  # None only for an assistant message that made tool calls
    tool_calls: list[dict] | None = None  # an assistant message's calls, as this server answered them
    tool_call_id: str | None = None  # a tool message: the call it answers

    def for_template(self, renders_tools: bool) -> dict:
        """`developer` is OpenAI's new name for `system`, which chat templates know (vLLM maps it the same way). A
        template that does not render tool calls gets them as the content it was asked to write them in."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.tool_calls and renders_tools:
            message["tool_calls"] = self.tool_calls
        elif self.tool_calls:
            calls = [call.get("function", {}) for call in self.tool_calls]
            message["content"] = json.dumps([{"name": c.get("name"), "arguments": _json_or_text(c)} for c in calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: ChosenOnly = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # OpenAI's default: auto with tools, none without

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def shows_tokens(self) -> bool:
        return self.logprobs

    @property
    def choice(self) -> ToolChoice:
        return self.tool_choice or ("auto" if self.tools else "none")  # OpenAI's defaults

    @property
    def callable_tools(self) -> list[Tool]:
        """The tools the answer may call (none: the answer is content). Worked out at each use, as it costs a pass
        over the tools: not a functools.cached_property, whose lock on Python 3.11 is shared by every request."""
        if self.choice != "none" and not self.tools:
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        try:
            return chosen_tools(self.tools or [], self.choice)
        except ValueError as exc:
            raise OpenAIError(400, f"tool_choice: {exc}", param="tool_choice") from None

    def formats(self) -> dict:
        defaults = self.additional_properties_default
        tools = {"tool_choice": lambda: tool_constraint(self.tools, self.choice, defaults)} if self.tools else {}
        return super().formats() | tools


class LoadLoraAdapter(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="The model name requests will select the adapter by.")
    lora_path: str = Field(min_length=1, description="PEFT adapter directory on the server's machine.")


class UnloadLoraAdapter(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, description="The adapter's model name.")
