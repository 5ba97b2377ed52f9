"""The OpenAI-compatible gateway in front of the real tritonserver, called with the `openai` client and curl."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import openai
import pytest

from pipeline.triton.client import stream_text
from pipeline.triton.server import free_port
from scripts.structured_outputs import GET_WEATHER
from tests.conftest import spawn_cli
from tests.serving.test_serving import metric

MODEL = "smollm2-135m-cpu"
QUESTION = [
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
]  # greedy answer stable across fp32/int8 (the bare question is a near-tie)


@contextmanager
def serving_app(app) -> Iterator[str]:
    """An ASGI app served by uvicorn on a thread of this process, on a free loopback port; yields its /v1 URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def running(grpc_port: int, engine, via_bls: bool = False, **options) -> Iterator[str]:
    """A gateway in front of the tritonserver on grpc_port, served by uvicorn on a thread; yields its /v1 URL. It
    talks to the repository beside `engine` as `serve` does (the LLM model that streams text), or `via_bls`."""
    from pipeline.serving.app import create_app
    from pipeline.serving.upstream import triton_upstream
    from pipeline.triton.validate import validate_repo

    address, repo = f"127.0.0.1:{grpc_port}", engine.parent / "triton_repo"
    upstream = address
    if repo.is_dir() and not via_bls:
        ready = options.pop("ready", None)  # the upstream's own, as `serve` gives it
        upstream = triton_upstream(validate_repo(repo).models, "tensorrt_llm_bls", address, options.get("lora"), ready)
        assert upstream.model == "tensorrt_llm" and upstream.llm is not None  # our LLM model streams text
    with serving_app(create_app(upstream, str(engine), MODEL, **options)) as url:
        yield url


@pytest.fixture(scope="module", params=["LLM model", "BLS"])
def gateway(server, smollm2_build, request) -> Iterator[str]:
    """Both ways the gateway reaches the engine: straight to the LLM model (as `serve --openai` does) and through the
    BLS (as it does for an LLM model that does not stream text: TensorRT-LLM's C++ backend)."""
    with running(server.ports.grpc, smollm2_build / "engine", via_bls=request.param == "BLS") as url:
        yield url


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
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it


def test_streamed_usage_comes_in_a_last_chunk_without_choices(client):
    """It came in the last content chunk (the one with finish_reason), and in streams that did not ask for it."""
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-2].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks[:-1])


def chat_both_ways(client, messages, **options) -> tuple[tuple[str, str], tuple[str, str]]:
    """(content, finish_reason) of a greedy chat, non-streamed and streamed."""
    request = {"model": MODEL, "messages": messages, "temperature": 0, **options}
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    return (whole.message.content, whole.finish_reason), (streamed, chunks[-1].choices[0].finish_reason)


def test_end_of_sequence_as_the_last_allowed_token_is_a_stop(client):
    """End-of-sequence is left out of the output (the engine's, like TensorRT-LLM's executor), so an answer of n
    tokens that it ended took max_tokens n + 1: fewer tokens than allowed is the engine's own signal that it stopped.
    With max_tokens n it was never generated, and the answer was cut: "length", as vLLM says."""
    n = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0).usage.completion_tokens
    for max_tokens, finish in ((n + 1, "stop"), (n, "length")):
        (_, collected), (_, streamed) = chat_both_ways(client, QUESTION, max_tokens=max_tokens)
        assert collected == streamed == finish, max_tokens


def test_a_length_cut_inside_an_emoji_drops_its_bytes(client):
    """An emoji takes several byte-level tokens; a length cut inside one ended the text with U+FFFD. The answer is
    held to three or more emojis by a regex guide (so no end of sequence before them), which makes the tokens
    independent of this CPU's int8 kernels."""
    messages = [{"role": "user", "content": "Reply with emojis for happiness."}]
    guide = {"response_format": {"type": "regex", "regex": "(\U0001f600|\U0001f60a){3,}"}}
    (whole, _), _ = chat_both_ways(client, messages, max_tokens=12, **guide)
    assert whole and set(whole) <= {"\U0001f600", "\U0001f60a"}, whole
    cuts = [chat_both_ways(client, messages, max_tokens=n, **guide) for n in range(1, 6)]
    for (collected, finish), streamed in cuts:
        assert (collected, finish) == streamed and finish == "length"
        assert "\ufffd" not in collected and whole.startswith(collected), collected
    lengths = [len(collected) for (collected, _), _ in cuts]
    assert lengths == sorted(lengths) and lengths[-1] >= 1, lengths
    # some token count ends inside an emoji: its bytes are dropped, so the text is no longer than one token fewer
    assert any(later == earlier for earlier, later in zip([0, *lengths], lengths)), lengths


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
    ("kwargs", "error", "param", "text"),
    [
        ({"model": "gpt-4"}, openai.NotFoundError, "model", "does not exist"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 4294967301}, openai.BadRequestError, "max_tokens", "less than or equal to 2147483647"),
        ({"max_tokens": 2040}, openai.BadRequestError, "max_tokens", "max_seq_len 2048"),  # 42 prompt tokens
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, openai.BadRequestError, "messages", "1024"),
        ({"temperature": 5}, openai.BadRequestError, "temperature", "less than or equal to 2"),
        ({"seed": 2**64}, openai.BadRequestError, "seed", "less than or equal to 18446744073709551615"),
        ({"extra_body": {"min_tokens": 2**31}}, openai.BadRequestError, "min_tokens", "2147483647"),
        ({"n": 2}, openai.BadRequestError, "n", "less than or equal to 1"),
        ({"logprobs": True, "top_logprobs": 2}, openai.BadRequestError, "top_logprobs", "only 0 is supported"),
        ({"logit_bias": {"1": 5}}, openai.BadRequestError, "logit_bias", "not supported"),
        ({"response_format": {"type": "structural_tag"}}, openai.BadRequestError, "response_format", "not supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            openai.BadRequestError,
            "response_format",
            "needs json_schema.schema",
        ),
        ({"response_format": {"type": "regex"}}, openai.BadRequestError, "response_format", "response_format.regex"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a+"}}},
            openai.BadRequestError,
            "structured_outputs",
            "not both",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a+", "choice": ["a"]}}},
            openai.BadRequestError,
            "structured_outputs",
            "exactly one of",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 3}},
            openai.BadRequestError,
            "min_tokens",
            "the format decides where the output ends",
        ),
    ],
)
def test_bad_requests_get_openai_error_bodies_naming_the_field(client, kwargs, error, param, text):
    with pytest.raises(error, match=text) as raised:
        client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 8, **kwargs})
    assert raised.value.param == param


def test_text_parts_and_the_developer_role_are_taken_as_a_string_and_system(client):
    """Current openai clients send both; they were 400s. developer goes to the chat template as system."""
    system = "You are a pirate. Answer in one sentence."
    as_strings = [{"role": "system", "content": system}, *QUESTION]
    as_parts = [
        {"role": "developer", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]},
    ]
    replies = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        for messages in (as_strings, as_parts)
    ]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage == replies[1].usage  # the same prompt


def test_a_non_text_content_part_is_a_400_naming_the_part(client):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(openai.BadRequestError, match="part 1 is of type 'image_url'") as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert raised.value.param == "messages.0.content"


def test_a_lone_surrogate_is_a_400_and_the_connection_serves_the_next_request(gateway):
    """It was a 500 whose exception made uvicorn drop the keep-alive connection."""
    with httpx.Client(base_url=gateway, timeout=60) as http:

        def send(**request) -> tuple[httpx.Response, tuple]:
            reply = http.post("/completions", **request)
            return reply, reply.extensions["network_stream"].get_extra_info("client_addr")

        bad, first = send(
            content=json.dumps({"model": MODEL, "prompt": "abc \ud800", "max_tokens": 2}),  # as "\\ud800"
            headers={"Content-Type": "application/json"},
        )
        good, second = send(json={"model": MODEL, "prompt": "abc", "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
    assert good.status_code == 200 and first == second, (good.text, first, second)  # one connection for both


def test_a_body_that_is_not_utf8_gets_an_openai_error_body(gateway):
    body = f'{{"model": "{MODEL}", "prompt": "caf\xe9"}}'.encode("latin-1")
    reply = httpx.post(f"{gateway}/completions", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "utf-8" in reply.json()["error"]["message"], reply.text


def test_only_a_request_for_log_probabilities_asks_to_see_each_token():
    """The LLM model merges the tokens that piled up while a response was being sent; the gateway streams them as one
    piece unless the client asked for each token's log-probability (logprobs 0 asks for the chosen token's)."""
    from pipeline.serving.protocol import ChatRequest, CompletionRequest

    assert CompletionRequest(model=MODEL, prompt="p", logprobs=0).shows_tokens()
    assert not CompletionRequest(model=MODEL, prompt="p").shows_tokens()
    assert ChatRequest(model=MODEL, messages=QUESTION, logprobs=True).shows_tokens()
    assert not ChatRequest(model=MODEL, messages=QUESTION).shows_tokens()


def test_chosen_token_logprobs_add_up_to_the_text(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True)
    entries = chat.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == chat.choices[0].message.content
    assert all(e.logprob <= 0 and bytes(e.bytes) == e.token.encode() and e.top_logprobs == [] for e in entries)
    assert len(entries) == chat.usage.completion_tokens  # one piece per token for plain English text
    whole = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=0, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text and logprobs.top_logprobs is None
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset
    assert [p for s in streamed for p in s.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-4)


def test_a_body_over_the_cap_gets_413_before_it_is_read(gateway):
    prompt = "word " * 1_000_000  # 5 MB: over the default 4 MB cap
    declared = httpx.post(f"{gateway}/completions", json={"model": MODEL, "prompt": prompt}, timeout=60)
    chunked = httpx.post(
        f"{gateway}/completions",
        content=iter([b'{"prompt": "', prompt.encode(), b'"}']),  # no Content-Length: counted as it arrives
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    for reply in (declared, chunked):
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large", reply.text


def test_models_answers_while_a_big_prompt_is_tokenized(gateway):
    """A 3 MB prompt (600k tokens, over the engine's max_input_len) is tokenized on a worker thread.
    Measured with this prompt on 2 cores: /v1/models answered in at most 0.06 s (0.20 s with the host
    busy) while the big request took 1.6-1.9 s (5.2 s); with the tokenizer on the event loop, as
    before, /v1/models waited 2.4-2.7 s (5.3 s), i.e. until the tokenizer was done."""
    big: dict = {}

    def send() -> None:
        reply = httpx.post(f"{gateway}/completions", json={"model": MODEL, "prompt": "word " * 600_000}, timeout=120)
        big.update(reply=reply, done=time.monotonic())

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the body is in and being tokenized
    start = time.monotonic()
    assert httpx.get(f"{gateway}/models", timeout=60).status_code == 200
    answered = time.monotonic()
    sender.join(timeout=120)
    assert answered - start < 1.0 and answered < big["done"], (answered - start, big["done"] - start)
    assert big["reply"].status_code == 400 and "max_input_len 1024" in big["reply"].text  # never sent to Triton


def test_an_api_key_is_required_when_set(server, smollm2_build):
    """The key as a Kubernetes Secret holds it, newline included: it used to match no Authorization header."""
    with running(server.ports.grpc, smollm2_build / "engine", api_key="sk-test-key\n") as url:
        missing = httpx.get(f"{url}/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key", missing.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url, api_key="sk-test-key", max_retries=0)
        assert [m.id for m in keyed.models.list()] == [MODEL]
        assert keyed.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens > 0


def test_the_api_schema_and_its_pages_need_the_key_too(server, smollm2_build):
    """/docs, /redoc and /openapi.json answered anyone."""
    with running(server.ports.grpc, smollm2_build / "engine", api_key="sk-test-key") as url:
        root = url.removesuffix("/v1")
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{root}{path}").status_code == 401, path
            keyed = httpx.get(f"{root}{path}", headers={"Authorization": "Bearer sk-test-key"})
            assert keyed.status_code == 200, (path, keyed.text)


def test_every_route_answers_503_until_the_model_is_ready_and_health_needs_no_key(tiny_llama):
    """The gateway listens before tritonserver is ready (`serve`): until then /v1/models, a chat and /health answer
    503 with Retry-After, so a client or load balancer polling them is not told to start early."""
    ready = threading.Event()
    key = {"Authorization": "Bearer sk-test-key"}
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    with running(1, tiny_llama, api_key="sk-test-key", ready=ready) as url:
        health = f"{url.removesuffix('/v1')}/health"
        for reply in (
            httpx.get(f"{url}/models", headers=key),
            httpx.post(f"{url}/chat/completions", json=chat, headers=key),
            httpx.get(health),
        ):
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
            assert reply.json()["error"]["code"] == "not_ready"
        ready.set()
        assert httpx.get(f"{url}/models", headers=key).status_code == 200
        assert httpx.get(health).status_code == 200
        assert httpx.get(f"{url}/models").status_code == 401  # /health alone needs no key


@pytest.mark.parametrize("key", [" ", "\n", " \t\r\n"])
def test_a_whitespace_key_is_refused_when_the_app_is_created(key):
    from pipeline.errors import PipelineError
    from pipeline.serving.app import create_app

    with pytest.raises(PipelineError, match="only whitespace"):
        create_app("127.0.0.1:1", "unused", MODEL, api_key=key)


def test_an_empty_key_is_no_key(server, smollm2_build):
    """TRTLLM_PIPELINE_API_KEY="" reaches create_app as ""."""
    with running(server.ports.grpc, smollm2_build / "engine", api_key="") as url:
        assert httpx.get(f"{url}/models").status_code == 200


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        ((), {"TRTLLM_PIPELINE_API_KEY": ""}, "--allow-unauthenticated"),
        (("--allow-unauthenticated",), {"TRTLLM_PIPELINE_API_KEY": ""}, "build it first"),  # past the check
        ((), {"TRTLLM_PIPELINE_API_KEY": "sk-test-key"}, "build it first"),
    ],
)
def test_serve_refuses_an_open_gateway_on_a_public_address(tmp_path, args, env, error):
    result = spawn_cli(
        "serve", str(tmp_path / "absent.yaml"), "--openai", "--host", "0.0.0.0", *args, env=env, timeout=60
    )
    assert result.returncode == 1 and error in result.stderr, result.stderr


@pytest.mark.parametrize("via_bls", [False, True], ids=["LLM model", "BLS"])
def test_a_stream_cut_by_a_server_stop_ends_with_an_error_event_and_done(smollm2_build, tmp_path, via_bls):
    """Its own short-lived tritonserver, stopped as `serve` stops it while a stream is in flight: tritonserver lets
    what is in flight finish for the stop's timeout (a short answer ends normally), then the process is killed."""
    from pipeline.build import cache_dir
    from pipeline.triton.server import TritonServer

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "min_tokens": 1500, "stream": True}
    with TritonServer(smollm2_build / "triton_repo", cache_dir(), log_file=tmp_path / "triton.log") as triton:
        # SIGINT as `serve` sends it, killed after 5 s rather than tritonserver's 30 s exit timeout
        stopper = threading.Thread(target=triton.stop, kwargs={"timeout": 5})
        with running(triton.ports.grpc, smollm2_build / "engine", via_bls=via_bls) as url:
            events = []
            with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as reply:
                for line in filter(None, reply.iter_lines()):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        stopper.start()
        stopper.join()
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["message"], error
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])


def test_shutdown_after_answers_cut_at_a_stop_string_does_not_wait_out_the_exit_timeout(smollm2_build, tmp_path):
    """The engine ends these generations at the stop string as the gateway cuts them; the gateway used to cancel the
    just-completed streams, after which tritonserver's BLS model took the 30 s exit timeout to unload."""
    from pipeline.build import cache_dir
    from pipeline.triton.server import TritonServer

    with TritonServer(smollm2_build / "triton_repo", cache_dir(), log_file=tmp_path / "triton.log") as triton:
        with running(triton.ports.grpc, smollm2_build / "engine") as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
            request = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 16, "temperature": 0}
            whole = client.completions.create(**request, stop=[" five,"]).choices[0]
            streamed = list(client.completions.create(**request, stop=[" five,"], stream=True))
        started = time.monotonic()
        triton.stop()
        stopped_in = time.monotonic() - started
    assert (whole.text, whole.finish_reason) == (" four,", "stop")
    assert "".join(c.choices[0].text for c in streamed) == " four," and streamed[-1].choices[0].finish_reason == "stop"
    assert stopped_in < 15, f"stop took {stopped_in:.1f} s; the exit timeout is 30 s"  # measured 2.5 s, 30 s before


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


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_json_schema_response_format_answers_json_that_validates_streamed_or_not(client):
    import jsonschema

    messages = [{"role": "user", "content": "Invent a person. Reply with JSON: a name and an age."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=response_format
    )
    answer = reply.choices[0].message.content
    jsonschema.validate(json.loads(answer), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["structured_output"] == {"valid": True, "relaxed": []}
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=response_format, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == answer
    assert [c.choices[0].model_extra.get("structured_output") for c in chunks][-1] == {"valid": True, "relaxed": []}
    assert all("structured_output" not in c.choices[0].model_extra for c in chunks[:-1])  # the last chunk alone


def test_a_keyword_the_grammar_cannot_enforce_is_checked_after_generation_or_refused_when_strict(client):
    """`uniqueItems` is not in the grammar: without strict the answer is checked and says so; with strict, a 400."""
    schema = {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
    messages = [{"role": "user", "content": "Name three colours as a JSON array."}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "colours", "schema": schema}},
    )
    report = reply.choices[0].model_extra["structured_output"]
    assert report["relaxed"] == ["uniqueItems"]  # three of two colours cannot be unique
    assert report["valid"] is False and "non-unique" in report["errors"][0]
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
        )
    assert raised.value.param == "response_format"


def test_structured_outputs_choice_regex_and_grammar_constrain_the_answer(client):
    """vLLM's structured_outputs and trtllm-serve's response_format types, on completions and chat."""
    question = [{"role": "user", "content": "Is Paris in France?"}]
    choice = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["Yes.", "No.", "Maybe (not sure)."]}},
    )  # fmt: skip
    assert choice.choices[0].message.content in {"Yes.", "No.", "Maybe (not sure)."}
    regex = client.completions.create(
        model=MODEL, prompt="The year the Eiffel Tower opened:", max_tokens=8, temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "1[0-9]{3}"}},
    )  # fmt: skip
    assert re.fullmatch(r"1[0-9]{3}", regex.choices[0].text)
    grammar = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=12, temperature=0,
        extra_body={"response_format": {"type": "ebnf", "ebnf": 'root ::= ("yes" | "no") ", in " [A-Z][a-z]+'}},
    )  # fmt: skip
    assert re.fullmatch(r"(yes|no), in [A-Z][a-z]+", grammar.choices[0].message.content)


def test_text_is_the_tokens_own_streamed_or_not_even_a_space_before_a_comma(client):
    """transformers' tokenization clean-up would turn " ," into "," (on in SmolLM2's tokenizer): a streamed delta
    then lost the comma; the text is what the tokens say, the same both ways."""
    guide = {"response_format": {"type": "regex", "regex": "Paris ,France \\.Europe"}}
    messages = [{"role": "user", "content": "Where is Paris?"}]
    (whole, _), (streamed, _) = chat_both_ways(client, messages, max_tokens=16, **guide)
    assert whole == streamed == "Paris ,France .Europe"


def test_a_guide_the_engine_cannot_compile_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match=r"guided_decoding_guide \(regex\)"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"response_format": {"type": "regex", "regex": "(a"}}
        )


WEATHER = GET_WEATHER  # the worked example's tool (scripts/structured_outputs.py)
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_a_required_tool_call_round_trips_through_the_openai_client(client):
    """tool_choice required: the answer is calls whose arguments validate; sent back with the tool's result, the
    next answer is content."""
    import jsonschema

    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(call.type == "function" and call.id.startswith("call_") for call in calls)
    tools = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    follow_up = [
        *ASK_WEATHER,
        choice.message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'} for call in calls],
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=[WEATHER, TIME], max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in {"stop", "length"}


def test_a_named_tool_choice_streams_the_call_it_answers_unstreamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    options = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, max_tokens=60)
    whole = client.chat.completions.create(**options, temperature=0).choices[0]
    assert [call.function.name for call in whole.message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(**options, temperature=0, stream=True))
    deltas = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, call.function.name, call.function.arguments) for i, call in enumerate(whole.message.tool_calls)
    ]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    streamed_call = {"role": "assistant", "tool_calls": [
        {"id": d.id, "type": "function", "function": {"name": d.function.name, "arguments": d.function.arguments}}
        for d in deltas
    ]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": deltas[0].id, "content": '{"temperature": 18}'}
    answer = client.chat.completions.create(
        model=MODEL, messages=[*ASK_WEATHER, streamed_call, result], tools=[WEATHER], max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "not among"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
    ],
)
def test_a_tool_choice_the_server_cannot_follow_is_a_400(client, kwargs, text):
    with pytest.raises(openai.BadRequestError, match=text) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, **kwargs)
    assert raised.value.param in {"tool_choice", "response_format"}


def test_the_gateway_opens_no_grpc_channel_before_tritonserver_is_ready():
    """`serve` forks tritonserver after the gateway listens, and a fork while gRPC's threads ran aborted the child
    once (gRPC's at-fork handler, which a Popen with a preexec_fn runs): the upstream's one client is made only once
    the models are ready, and closed when the app stops."""
    import asyncio
    import contextlib

    from pipeline.serving.upstream import TritonUpstream

    ready = threading.Event()
    upstream = TritonUpstream("127.0.0.1:1", "tensorrt_llm_bls", ready_event=ready)

    async def scenario() -> None:
        running = asyncio.ensure_future(upstream.run())
        await asyncio.sleep(0.3)
        assert upstream.client is None
        ready.set()
        await asyncio.sleep(0.3)
        assert upstream.client is not None
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        assert upstream.client is None

    asyncio.run(scenario())
