"""The request mix that once killed the BLS process (issue 45, item 4), repeated on fresh servers: each round starts
`trtllm-pipeline serve --openai`, sends one non-streamed json_schema chat of 50 nested objects (max_tokens 1500) while
clients send 8-token chats beside it (to the base model and, on a LoRA build, to each adapter in turn), then stops
the server with SIGTERM and times the stop. Before the mix, each round also times 8-token chats while a 1 MB JSON
schema never seen before compiles (item 5: compiles are off the decode loop's path), against the same chats alone.

A round passes when every request was answered (the structured one with JSON that parses), no model process died
(`serve` exits 0 and its log carries no "Fatal Python error" nor a model named as dead), and the stop took at most
8 s. Exit code 0 only when every round passed. Usage (the LoRA build made first: `make lora-adapters`, then
`trtllm-pipeline build build_configs/smollm2-135m-cpu-lora.yaml`):
    python scripts/fresh_servers.py build_configs/smollm2-135m-cpu-lora.yaml --rounds 20 --report fresh.json
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from statistics import median

import httpx
import openai
from soak import API_KEY, Serve, Soak, serve_command

STOP_LIMIT_S = 8.0
NESTED_OBJECTS = 50
SHORT_CHATS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three:"]
# 50 objects, each holding another: what the structured request of the run that found the death asked for.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": NESTED_OBJECTS,
            "maxItems": NESTED_OBJECTS,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            },
        }
    },
    "required": ["people"],
}
# a model process that died, as `serve` and the python backend report it
DEATH_SIGNS = ("Fatal Python error", "died", "Segmentation fault", "Stub process", "is not healthy")


def structured_chat(client: openai.OpenAI, model: str) -> str:
    """The 1500-token json_schema chat; returns what went wrong, or '' when it was answered: with 50 objects that
    parse, or cut at max_tokens (the run that found the death asked for more than 1500 tokens' worth too)."""
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"List {NESTED_OBJECTS} people with their addresses as JSON."}],
        max_tokens=1500,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "people", "schema": NESTED_SCHEMA}},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "length" and choice.message.content:
        return ""
    if choice.finish_reason != "stop":
        return f"finish_reason {choice.finish_reason}"
    people = json.loads(choice.message.content)["people"]
    return "" if len(people) == NESTED_OBJECTS else f"{len(people)} objects"


def big_schema(round_number: int) -> dict:
    """About 1 MB of JSON schema, new to the server in every round: 4,000 optional properties with descriptions."""
    description = "A field of a wide record, described at length as generated API schemas are. " * 3
    return {
        "type": "object",
        "properties": {
            f"field_{round_number}_{i}": {"type": "string", "maxLength": 16, "description": description}
            for i in range(4000)
        },
    }


def chat_seconds(client: openai.OpenAI, model: str) -> float:
    started = time.monotonic()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    return time.monotonic() - started


def compile_stall(client: openai.OpenAI, model: str, round_number: int) -> dict:
    """8-token chats alone, then while the 1 MB schema's request is prepared and compiled (its answer does not
    matter: llguidance refuses this schema's first token, past its row limit, with a 400 naming it)."""
    schema = big_schema(round_number)
    alone = sorted(chat_seconds(client, model) for _ in range(3))
    outcome: list[str] = []

    def schema_request() -> None:
        try:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Fill the record."}],
                max_tokens=8,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "wide", "schema": schema},
                },
            )
            outcome.append("answered")
        except openai.APIStatusError as exc:
            outcome.append(f"{exc.status_code}: {exc.message[:200]}")

    schema_thread = threading.Thread(target=schema_request)
    schema_thread.start()
    beside = []
    while schema_thread.is_alive():
        beside.append(chat_seconds(client, model))
    schema_thread.join()
    return {
        "schema bytes": len(json.dumps(schema)),
        "schema request": outcome[0] if outcome else "no answer",
        "8-token chat alone, median (s)": round(alone[1], 3),
        "8-token chats beside the compile": len(beside),
        "8-token chat beside the compile, max (s)": round(max(beside, default=0.0), 3),
    }


def short_chats(client: openai.OpenAI, models: list[str], until: threading.Event, counts: Counter) -> None:
    """8-token chats, round robin over the models (the base and its adapters), until the structured one ends."""
    turn = 0
    while not until.is_set():
        model = models[turn % len(models)]
        try:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": SHORT_CHATS[turn % len(SHORT_CHATS)]}],
                max_tokens=8,
            )
            counts["answered" if reply.choices[0].finish_reason else f"unfinished:{model}"] += 1
        except Exception as exc:  # counted by kind: the round fails on any of them
            counts[f"failed:{model}:{type(exc).__name__}"] += 1
        turn += 1


def one_round(command: list[str], gateway: str, clients: int, round_number: int) -> dict:
    serve = Serve(command)
    started = time.monotonic()
    serve.start()
    ready_s = round(time.monotonic() - started, 1)
    models = [m["id"] for m in httpx.get(f"{gateway}/v1/models", headers=Soak.auth()).json()["data"]]
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stall = compile_stall(client, models[0], round_number)
    counts: Counter = Counter()
    done = threading.Event()
    beside = [threading.Thread(target=short_chats, args=(client, models, done, counts)) for _ in range(clients)]
    for thread in beside:
        thread.start()
    asked = time.monotonic()
    try:
        structured = structured_chat(client, models[0])
    except Exception as exc:  # the failure is the round's result
        structured = f"{type(exc).__name__}: {exc}"
    structured_s = round(time.monotonic() - asked, 1)
    done.set()
    for thread in beside:
        thread.join()
    stopping = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    serve.process.wait(timeout=120)
    stop_s = round(time.monotonic() - stopping, 1)
    log = serve.output()
    deaths = [line.strip() for line in log.splitlines() if any(sign in line for sign in DEATH_SIGNS)]
    failed = {kind: n for kind, n in counts.items() if kind != "answered"}
    result = {
        "ready (s)": ready_s,
        "structured chat (s)": structured_s,
        "structured chat problem": structured,
        "short chats answered": counts["answered"],
        "short chats failed": failed,
        "stop (s)": stop_s,
        "serve exit code": serve.process.returncode,
        "model process deaths": deaths,
        "compile stall": stall,
    }
    result["passed"] = (
        not structured and not failed and not deaths and serve.process.returncode == 0 and stop_s <= STOP_LIMIT_S
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a build config (serves its output's triton_repo) or a repository directory")
    parser.add_argument("--rounds", type=int, default=20, help="fresh servers, one after another (default 20)")
    parser.add_argument("--clients", type=int, default=2, help="clients sending 8-token chats beside (default 2)")
    parser.add_argument("--port", type=int, default=18100, help="first of four loopback ports used (default 18100)")
    parser.add_argument("--report", type=Path, help="also write the rounds here as JSON")
    args = parser.parse_args()

    command, ports = serve_command(args.source, args.port)
    gateway = f"http://127.0.0.1:{ports['--openai-port']}"
    rounds = []
    for number in range(1, args.rounds + 1):
        result = {"round": number, **one_round(command, gateway, args.clients, number)}
        rounds.append(result)
        print(json.dumps(result), flush=True)
    stops = sorted(r["stop (s)"] for r in rounds)
    summary = {
        "rounds": len(rounds),
        "passed": sum(r["passed"] for r in rounds),
        "model process deaths": sum(len(r["model process deaths"]) for r in rounds),
        "stop (s) median / max": [stops[len(stops) // 2], stops[-1]],
        "structured chat (s) max": max(r["structured chat (s)"] for r in rounds),
        "short chats answered": sum(r["short chats answered"] for r in rounds),
        "8-token chat alone, median of rounds (s)": median(
            r["compile stall"]["8-token chat alone, median (s)"] for r in rounds
        ),
        "8-token chat beside a 1 MB schema's compile, max of rounds (s)": max(
            r["compile stall"]["8-token chat beside the compile, max (s)"] for r in rounds
        ),
    }
    print(json.dumps(summary, indent=2))
    if args.report:
        args.report.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2) + "\n")
    return 0 if summary["passed"] == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
