"""The OpenAI-compatible gateway in front of the real tritonserver, called with the `openai` client and curl."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import openai
import pytest

from pipeline.triton.client import stream_text
from pipeline.triton.server import free_port
from tests.serving.test_serving import metric

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-cpu"
QUESTION = [
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
]  # greedy answer stable across fp32/int8 (the bare question is a near-tie)


@pytest.fixture(scope="module")
def gateway(server, smollm2_build) -> str:
    import uvicorn

    from pipeline.openai_gateway import create_app

    port = free_port()
    app = create_app(f"127.0.0.1:{server.ports.grpc}", str(smollm2_build / "engine"), MODEL)
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    while not running.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    running.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_greedy_chat_equals_the_ensemble_and_counts_usage(client, url, smollm2_build):
    from transformers import AutoTokenizer

    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_build / "engine")
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert reply.choices[0].message.content == "".join(stream_text(url, "ensemble", prompt, 24))
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert 0 < reply.usage.completion_tokens < 24


def test_streaming_chat_deltas_add_up_to_the_whole_answer(client):
    whole = (
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
        .choices[0]
        .message.content
    )
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens > 0


def test_completion_honours_stop_max_tokens_and_seed(client):
    free = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0).choices[0]
    assert free.finish_reason == "length"
    stop = free.text.split(",")[1] + ","  # a later piece of the greedy text
    stopped = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and free.text.startswith(stopped.text)
    a, b = (
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, seed=3
        )
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b


def test_curl_streams_server_sent_events(gateway):
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True})
    out = subprocess.run(
        ["curl", "-sN", f"{gateway}/chat/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"model": "gpt-4"}, openai.NotFoundError, "does not exist"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, openai.BadRequestError, "max_input_len 1024"),
        ({"temperature": 5}, openai.BadRequestError, "temperature"),
    ],
)
def test_bad_requests_get_openai_error_bodies(client, kwargs, error, text):
    with pytest.raises(error, match=text):
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 8, **kwargs})


def test_client_disconnect_stops_generation(client, server):
    before = metric(server, "trtllm_pipeline_generated_tokens_total")
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=500, stream=True, extra_body={"min_tokens": 500}
    )
    for _, _ in zip(range(5), stream):
        pass
    stream.close()
    time.sleep(1.5)
    settled = metric(server, "trtllm_pipeline_generated_tokens_total")
    time.sleep(1.0)
    assert metric(server, "trtllm_pipeline_generated_tokens_total") == settled and settled - before < 150
    assert metric(server, "trtllm_pipeline_active_rows") == 0
