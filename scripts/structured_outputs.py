#!/usr/bin/env python
"""Structured outputs and a tool call against a running gateway, with the `openai` client: the default model fills
an invoice's JSON schema, then calls a `get_weather` tool and answers from its result (docs/serving.md shows a run).

Example (after `trtllm-pipeline serve build_configs/smollm2-135m-cpu.yaml --openai`):
    python scripts/structured_outputs.py --base-url http://127.0.0.1:9000/v1
"""

import argparse
import json

from openai import OpenAI

INVOICE = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
                },
                "required": ["description", "quantity", "unit_price_cents"],
                "additionalProperties": False,
            },
        },
        "currency": {"enum": ["EUR", "USD", "GBP"]},
    },
    "required": ["customer", "items", "currency"],
    "additionalProperties": False,
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    parser.add_argument("--api-key", default="unused", help="the gateway's key, when it has one")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    invoice = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write an invoice for Ada Lovelace: two notebooks at 3.50 euros each."}],
        response_format={"type": "json_schema", "json_schema": {"name": "invoice", "schema": INVOICE, "strict": True}},
        temperature=0,
        max_tokens=160,
    )
    print("invoice:", invoice.choices[0].message.content)

    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    reply = client.chat.completions.create(
        model=model, messages=question, tools=[GET_WEATHER], tool_choice="required", temperature=0, max_tokens=60
    )
    message = reply.choices[0].message
    print("finish_reason:", reply.choices[0].finish_reason)
    for call in message.tool_calls:
        print(f"tool call: {call.function.name}({call.function.arguments})")
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}
        for call in message.tool_calls
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=[*question, message.model_dump(exclude_none=True), *results],
        tools=[GET_WEATHER],
        temperature=0,
        max_tokens=60,
    )
    print("answer:", answer.choices[0].message.content)


if __name__ == "__main__":
    main()
