"""How the OpenAI gateway speaks to trtllm-serve of each TensorRT-LLM release (`serve --openai` in front of the
PyTorch backend): the gateway's guided-decoding guide written as the `response_format` that release enforces, and the
`logprobs` it answers.

What a release does with each `response_format` type is tabulated from its `tensorrt_llm/serve/openai_protocol.py`
(upstream/trtllm_response_format.json, by scripts/dev/tabulate_trtllm_response_format.py): the type's field whose
value reaches `GuidedDecodingParams`, and as which keyword. A guide is written as the first type whose guide is the
keyword that enforces it: a JSON schema as `{"type": "json", "schema": S}` on every release. On 1.2 OpenAI's own
`json_schema` type hands the grammar its whole `json_schema` field, OpenAI's wrapper (`name`, `schema`, `strict`)
rather than the schema in it, so forwarding a client's `json_schema` as it came would constrain nothing; the gateway
never does. A guide no type of the release enforces (a regex or EBNF grammar on 1.0) is refused naming the release.

A LoRA adapter of the build is picked per request by `lora_request`, the release's `LoRARequest` (tabulated from
`tensorrt_llm/executor/request.py`): its name, integer id and PEFT directory, all three from the build
(`adapter_fields`), never from a client. trtllm-serve loads the directory a request names, so it listens on loopback
only, behind the gateway, which sends only the build's.
"""

from __future__ import annotations

import json

from pipeline.targets import Dialect
from pipeline.upstream import release_facts

TABLE = "trtllm_response_format"
# The gateway's guide types (pipeline.serving.protocol) -> the GuidedDecodingParams keyword that enforces each.
GUIDE_PARAMS = {"json_schema": "json", "json": "json_object", "regex": "regex", "ebnf_grammar": "grammar"}


def facts(release: str) -> dict:
    return release_facts(TABLE, release, "target.trtllm_version: what trtllm-serve does with response_format")


def server(release: str) -> str:
    return f"trtllm-serve of TensorRT-LLM {release}"


def response_format(release: str, guide: tuple[str, str]) -> dict:
    """The `response_format` that makes `release`'s trtllm-serve enforce `guide` on /v1/completions; ValueError where
    none does."""
    kind, text = guide
    table = facts(release)["response_format"]
    if "CompletionRequest" not in table["requests"]:
        raise ValueError(f"{server(release)} takes no guide on /v1/completions")
    param = GUIDE_PARAMS.get(kind)
    for type_, made in table["guides"].items():
        if made is None or made.get("param") != param:
            continue
        if "value" in made:
            return {"type": type_}
        if "from" in made:
            return {"type": type_, made["from"]: json.loads(text) if kind == "json_schema" else text}
    types = ", ".join(t for t, made in table["guides"].items() if made is not None)
    raise ValueError(f"{server(release)} cannot enforce a {kind} guide (its response_format enforces only {types})")


# LoRARequest's fields the gateway fills, and the Python type each must have in the release's class.
LORA_REQUEST_FIELDS = {"lora_name": "str", "lora_int_id": "int", "lora_path": "str"}


def adapter_fields(release: str, name: str, task_id: int, path: str) -> dict:
    """The /v1/completions fields that make `release`'s trtllm-serve generate with the build's adapter `name` (its
    task id and PEFT directory); ValueError where the release takes no adapter per request, or its LoRARequest has
    fields of other types, or one more it requires."""
    made = facts(release)
    taken = made.get("lora_request")
    if "lora_request" not in made["completions"]["fields"] or taken is None:
        raise ValueError(f"{server(release)} takes no lora_request on /v1/completions")
    fields = taken["fields"]
    for field, annotation in LORA_REQUEST_FIELDS.items():
        if fields.get(field, {}).get("type") != annotation:
            raise ValueError(f"{server(release)}'s {taken['class']} has no {field}: {annotation}")
    required = [f for f, spec in fields.items() if "default" not in spec and f not in LORA_REQUEST_FIELDS]
    if required:
        raise ValueError(f"{server(release)}'s {taken['class']} also requires {', '.join(required)}")
    return {"lora_request": {"lora_name": name, "lora_int_id": task_id, "lora_path": path}}


def dialect(release: str) -> Dialect:
    """The gateway's dialect for `release`'s trtllm-serve."""
    completions = facts(release)["completions"]
    return Dialect(
        server(release),
        lambda guide: response_format(release, guide),
        # a release that refuses every logprobs but 0 returns none; otherwise 1 asks for the chosen token's
        chosen_logprobs=None if completions["logprobs_refused"] == "nonzero" else 1,
        takes=frozenset(completions["fields"]),
    )
