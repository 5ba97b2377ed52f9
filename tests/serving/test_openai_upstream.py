"""The gateway in front of an OpenAI-compatible HTTP server (`OpenAIUpstream`, as `serve --openai` puts it in front of
trtllm-serve), end to end against a real one: this project's own gateway in front of the real tritonserver on the
SmolLM2 CPU build. So: the openai client -> gateway (OpenAI upstream) -> gateway (Triton upstream) -> tritonserver.

trtllm-serve itself needs a GPU; what it takes per release is tabulated (tests/test_tabulation_response_format.py),
and its release's translation of a JSON schema is sent here to the inner gateway, which takes the same `json` type."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pipeline.errors import TargetUnavailable
from pipeline.serving.openai_upstream import GATEWAY, Dialect, OpenAIUpstream, OwnServer
from pipeline.targets.trtllm.openai_dialect import response_format
from pipeline.triton.server import free_port
from tests.conftest import run_cli
from tests.serving.test_openai import MODEL, PERSON, QUESTION, running, serving_app
from tests.serving.test_serving import metric


@contextmanager
def fronting(upstream_url: str, engine, dialect: Dialect = GATEWAY, **options) -> Iterator[str]:
    """The gateway in front of the OpenAI-compatible server at `upstream_url` (its /v1 URL), on a uvicorn thread;
    yields the gateway's /v1 URL once it is ready (or at once with wait=False)."""
    from pipeline.serving.app import create_app

    wait, adapters = options.pop("wait", True), options.pop("adapters", {})
    upstream = OpenAIUpstream(upstream_url.removesuffix("/v1"), MODEL, dialect, poll_s=0.2, adapters=adapters)
    with serving_app(create_app(upstream, str(engine), MODEL, **options)) as url:
        deadline = time.monotonic() + 30
        while wait and not upstream.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield url


@pytest.fixture(scope="module")
def inner(server, smollm2_build) -> Iterator[str]:
    """The gateway in front of tritonserver: the OpenAI-compatible server behind the gateway under test."""
    with running(server.ports.grpc, smollm2_build / "engine") as url:
        yield url


@pytest.fixture(scope="module")
def outer(inner, smollm2_build) -> Iterator[str]:
    with fronting(inner, smollm2_build / "engine") as url:
        yield url


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_a_chat_through_the_openai_upstream_is_the_servers_answer_with_its_usage(inner, outer):
    request = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    direct, fronted = (client_of(url).chat.completions.create(**request) for url in (inner, outer))
    assert fronted.choices[0].message.content == direct.choices[0].message.content
    assert "Paris" in fronted.choices[0].message.content and fronted.choices[0].finish_reason == "stop"
    assert fronted.usage == direct.usage  # counted from the server's usage in every chunk
    assert [m.id for m in client_of(outer).models.list()] == [MODEL]


def test_a_streamed_chat_adds_up_to_the_whole_answer_and_cuts_at_max_tokens(outer):
    client = client_of(outer)
    request = dict(model=MODEL, messages=QUESTION, temperature=0)
    whole = client.chat.completions.create(**request, max_tokens=24).choices[0].message.content
    chunks = list(client.chat.completions.create(**request, max_tokens=24, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    cut = client.chat.completions.create(**request, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


def test_stop_seed_and_the_chosen_tokens_log_probabilities_pass_through(inner, outer):
    request = dict(model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0, stop=[" five,"])
    direct, fronted = (client_of(url).completions.create(**request).choices[0] for url in (inner, outer))
    assert (fronted.text, fronted.finish_reason) == (direct.text, direct.finish_reason) == (" four,", "stop")
    sampled = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, seed=3)
    assert len({client_of(url).completions.create(**sampled).choices[0].text for url in (inner, outer, outer)}) == 1
    chat = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True)
    direct, fronted = (
        client_of(url).chat.completions.create(**chat).choices[0].logprobs.content for url in (inner, outer)
    )
    assert [e.token for e in fronted] == [e.token for e in direct]
    assert [e.logprob for e in fronted] == pytest.approx([e.logprob for e in direct], abs=1e-4)


def test_a_json_schema_translated_for_trtllm_1_2_answers_json_that_validates(inner, smollm2_build):
    """The gateway writes the schema as 1.2's `json` type with the schema itself (never its json_schema type, whose
    whole field reaches the grammar): the inner gateway takes that type too, and enforces it."""
    import jsonschema

    release_1_2 = Dialect("trtllm-serve of TensorRT-LLM 1.2", lambda guide: response_format("1.2", guide), 0)
    messages = [{"role": "user", "content": "Invent a person. Reply with JSON: a name and an age."}]
    wrapped = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with fronting(inner, smollm2_build / "engine", release_1_2) as url:
        reply = client_of(url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=wrapped
        )
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert reply.choices[0].finish_reason == "stop"


def test_what_the_release_cannot_enforce_or_return_is_a_400_naming_it(inner, smollm2_build):
    release_1_0 = Dialect("trtllm-serve of TensorRT-LLM 1.0", lambda guide: response_format("1.0", guide), None)
    with fronting(inner, smollm2_build / "engine", release_1_0) as url:
        client = client_of(url)
        with pytest.raises(openai.BadRequestError, match="TensorRT-LLM 1.0 cannot enforce a regex guide") as raised:
            client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=4, extra_body={"response_format": {"type": "regex", "regex": "a+"}}
            )
        assert raised.value.param == "response_format"
        with pytest.raises(openai.BadRequestError, match="returns no log-probabilities") as raised:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True)
        assert raised.value.param == "logprobs"


def test_a_request_the_server_refuses_is_a_400_with_its_reason(outer):
    """The inner gateway refuses a regex its engine cannot compile; the refusal reaches the client as a 400."""
    with pytest.raises(openai.BadRequestError, match=r"guided_decoding_guide \(regex\)"):
        client_of(outer).completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"response_format": {"type": "regex", "regex": "(a"}}
        )


def test_a_client_that_hangs_up_stops_the_generation_behind_both_gateways(outer, server):
    before = metric(server, "trtllm_pipeline_generated_tokens_total")
    stream = client_of(outer).chat.completions.create(
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


def test_every_route_answers_503_until_the_server_is_ready_and_after_it_goes(tiny_llama):
    """Readiness is the server's /health: the inner gateway answers 503 there until its `ready` is set; a server that
    stops answering makes the gateway answer 503 again (a generation then fails with 503, not 500)."""
    ready = threading.Event()
    with running(1, tiny_llama, ready=ready) as inner_url:
        with fronting(inner_url, tiny_llama, wait=False, api_key="sk-test") as url:
            key = {"Authorization": "Bearer sk-test"}
            health = f"{url.removesuffix('/v1')}/health"
            for reply in (httpx.get(f"{url}/models", headers=key), httpx.get(health)):
                assert reply.status_code == 503 and reply.json()["error"]["code"] == "not_ready", reply.text
            ready.set()
            deadline = time.monotonic() + 10
            while httpx.get(health).status_code != 200:
                assert time.monotonic() < deadline, "the gateway never saw the server ready"
                time.sleep(0.1)
            assert httpx.get(f"{url}/models", headers=key).json()["data"][0]["id"] == MODEL
    with fronting(f"http://127.0.0.1:{free_port()}/v1", tiny_llama, wait=False) as url:  # nothing listens there
        time.sleep(0.5)
        assert httpx.get(f"{url.removesuffix('/v1')}/health").status_code == 503


def test_a_server_gone_mid_request_is_a_503_before_any_text(tiny_llama):
    """The upstream's own failure statuses: nothing listening is 503 (unavailable), never a 500."""
    import asyncio

    from pipeline.serving.protocol import CompletionRequest, OpenAIError

    upstream = OpenAIUpstream(f"http://127.0.0.1:{free_port()}", MODEL, GATEWAY)
    body = CompletionRequest(model=MODEL, prompt="Hi")

    async def first():
        return await anext(upstream.generate("Hi", body, 4))

    with pytest.raises(OpenAIError) as raised:
        asyncio.run(first())
    assert raised.value.status == 503
    assert [upstream.refused(s, b'{"error": {"message": "x"}}', started).status for s, started in (
        (400, False), (400, True), (422, False), (500, False), (503, True), (401, False)
    )] == [400, 502, 400, 502, 503, 502]  # fmt: skip


def test_serve_fronts_its_own_server_and_stops_it_with_itself(smollm2_build, tmp_path):
    """`FrontedServing`, as `serve --openai` runs it for trtllm-serve: the server a subprocess on loopback (here the
    real `serve --openai` of the SmolLM2 build, itself an OpenAI-compatible server), the gateway in front of it,
    both stopped together."""
    from pipeline.serving.lifecycle import FrontedServing, GatewayOptions, served_name

    repo = smollm2_build / "triton_repo"
    http, grpc, metrics, inner_port, port = (free_port() for _ in range(5))
    command = [sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--http-port", str(http)]
    command += ["--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai", "--openai-port", str(inner_port)]
    engine = str(smollm2_build / "engine")
    own = OwnServer(
        command, f"http://127.0.0.1:{inner_port}", served_name(repo), engine, engine, GATEWAY, "serve of SmolLM2"
    )
    with FrontedServing(repo, own, "127.0.0.1", GatewayOptions(port, "sk-front", 4.0), log=lambda _: None) as fronted:
        fronted.start()
        health, deadline = f"http://127.0.0.1:{port}/health", time.monotonic() + 180
        while httpx.get(health).status_code != 200:
            assert fronted.process.poll() is None and time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=fronted.openai_url, api_key="sk-front", max_retries=0)
        reply = client.chat.completions.create(model=served_name(repo), messages=QUESTION, max_tokens=16, temperature=0)
        assert "Paris" in reply.choices[0].message.content
    assert fronted.process.poll() is not None  # stopped with the gateway
    with pytest.raises(httpx.ConnectError):
        httpx.get(health)


def pytorch_repository(root: Path, release: str) -> Path:
    """The files `serve` reads of a PyTorch-backend repository: the llmapi model's model.yaml naming the model
    directory, and the engine record naming the release (written as our build writes them)."""
    engine = root / "out" / "engine"
    (engine / "model").mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps({"trtllm_version": release, "backend": "pytorch"}))
    model = root / "out" / "triton_repo" / "tensorrt_llm" / "1"
    model.mkdir(parents=True)
    (model / "model.yaml").write_text(yaml.safe_dump({"model": str(engine / "model")}))
    return root / "out" / "triton_repo"


@pytest.mark.no_gpu
def test_serve_openai_of_a_pytorch_build_stops_with_the_gateway_in_front_of_trtllm_serve(tmp_path):
    """Without TensorRT-LLM and a GPU: exit 4 (TargetUnavailable) with the command that runs the gateway in front of
    trtllm-serve in our GPU image; without --openai, trtllm-serve alone in NVIDIA's container."""
    from pipeline.targets import TARGETS

    repo = pytorch_repository(tmp_path, "1.2")
    with pytest.raises(TargetUnavailable) as raised:
        TARGETS["trtllm"].serve_without_triton(repo, "127.0.0.1", 8000, 9000)
    message = str(raised.value)
    served = message.splitlines()[1].strip()
    assert "--publish=127.0.0.1:9000:9000 --env=TRTLLM_PIPELINE_API_KEY trtllm-pipeline:gpu-1.2" in served
    assert served.endswith(
        f"/.venv/bin/trtllm-pipeline serve {repo.resolve()} --host 0.0.0.0 --http-port 8000 --openai "
        "--openai-port 9000 --allow-unauthenticated"
    )
    assert "the OpenAI gateway in front of trtllm-serve" in message
    with pytest.raises(TargetUnavailable) as raised:
        TARGETS["trtllm"].serve_without_triton(repo, "0.0.0.0", 8000, None)
    served = str(raised.value).splitlines()[1]
    assert (
        "--publish=0.0.0.0:8000:8000" in served
        and f"trtllm-serve {(repo.parent / 'engine' / 'model').resolve()}" in served
    )
    assert TARGETS["onnxruntime"].serve_without_triton(repo, "127.0.0.1", 8000, 9000) is None
    # with a launcher, trtllm-serve runs where it takes it (NVIDIA's container here, mpirun's hosts): nothing is
    # asked of this machine, and the gateway gets the server as the launcher starts it
    docker = ("docker", "run", "--rm", "--gpus=all", "--network=host", "nvcr.io/nvidia/tritonserver:25.10-trtllm")
    own = TARGETS["trtllm"].serve_without_triton(repo, "127.0.0.1", 8000, 9000, docker)
    assert own.command[: len(docker) + 1] == [*docker, "trtllm-serve"] and own.url == "http://127.0.0.1:8000"


def test_the_gateway_command_needs_a_key_off_loopback(tmp_path):
    from pipeline.targets.trtllm.llm_api_serving import Deployment

    deployment = Deployment.of(pytorch_repository(tmp_path, "1.1"))
    public, _ = deployment.container_commands("0.0.0.0", 8000, 9000)
    assert "--allow-unauthenticated" not in public and "--env=TRTLLM_PIPELINE_API_KEY" in public
    own = deployment.own_server(8123)  # trtllm-serve on loopback only: the gateway is its one door
    assert own.url == "http://127.0.0.1:8123" and own.command[0] == "trtllm-serve"
    assert "--host=127.0.0.1" in own.command and "--port=8123" in own.command
    assert own.dialect.server == "trtllm-serve of TensorRT-LLM 1.1" and own.dialect.chosen_logprobs is None
    assert own.tokenizer_dir == str(deployment.model_dir) and own.limits_dir == str(deployment.model_dir.parent)
    launcher = ("mpirun", "--host", "node0:2,node1:2", "-n", "4", "trtllm-llmapi-launch")
    spread = deployment.own_server(8123, launcher)  # a group: mpirun starts the ranks, rank 0 on this host
    assert spread.command == [*launcher, *own.command] and spread.url == own.url


def test_a_launcher_is_refused_for_a_repository_tritonserver_serves(smollm2_build):
    result = run_cli("serve", str(smollm2_build / "triton_repo"), "--launcher", "mpirun -n 2")
    said = " ".join(result.stderr.split())
    assert result.returncode == 1 and "--launcher:" in said and "only a PyTorch-backend build's trtllm-serve" in said


# ---------------------------------------------------------------- LoRA adapters of the server behind the gateway


@contextmanager
def recording_server() -> Iterator[tuple[str, list[dict]]]:
    """A real OpenAI-compatible HTTP server (FastAPI on uvicorn) that answers every /v1/completions with one streamed
    word and records each request body; yields (its /v1 URL, the bodies)."""
    app, bodies = FastAPI(), []

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        bodies.append(await request.json())
        chunk = {"choices": [{"index": 0, "text": " yes"}], "usage": {"completion_tokens": 1}}
        return StreamingResponse(iter([f"data: {json.dumps(chunk)}\n\n", "data: [DONE]\n\n"]))

    with serving_app(app) as url:
        yield url, bodies


def lora_request(name: str, task_id: int) -> dict:
    return {"lora_request": {"lora_name": name, "lora_int_id": task_id, "lora_path": f"/out/lora/{name}"}}


def test_an_adapter_model_is_sent_with_its_lora_request_and_the_base_model_with_none(tiny_llama):
    """The adapters (from the build, as the trtllm target writes them) are models of the gateway's: listed by
    /v1/models, picked by `model`; a client's own lora_request never reaches the server, an unknown model is a 404."""
    adapters = {"upper": lora_request("upper", 1), "ahoy": lora_request("ahoy", 2)}
    with recording_server() as (server_url, bodies), fronting(server_url, tiny_llama, adapters=adapters) as url:
        client = client_of(url)
        listed = client.models.list().data
        assert [m.id for m in listed] == [MODEL, "upper", "ahoy"]
        assert [getattr(m, "parent", None) for m in listed] == [None, MODEL, MODEL]
        for model in ("upper", MODEL, "ahoy"):
            assert client.completions.create(model=model, prompt="Hi", max_tokens=4).choices[0].text == " yes"
        smuggled = {"lora_request": {"lora_name": "x", "lora_int_id": 9, "lora_path": "/etc"}}
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=smuggled)
        with pytest.raises(openai.NotFoundError, match="'lower' does not exist") as raised:
            client.completions.create(model="lower", prompt="Hi", max_tokens=4)
        assert raised.value.status_code == 404
        admin = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"})
        assert admin.status_code == 404  # nothing is loaded while serving: the adapters are the build's
    assert [b.get("lora_request") for b in bodies] == [adapters["upper"]["lora_request"], None, adapters["ahoy"][
        "lora_request"], None]  # fmt: skip
    assert {b["model"] for b in bodies} == {MODEL}  # the server's own model name, adapter or not


def test_adapter_fields_the_servers_dialect_lacks_or_an_adapter_named_as_the_base_are_refused(tiny_llama):
    from pipeline.serving.app import create_app
    from pipeline.serving.protocol import CompletionRequest
    from pipeline.targets.trtllm.openai_dialect import dialect

    taken = OpenAIUpstream("http://127.0.0.1:1", MODEL, dialect("1.2"), adapters={"a": lora_request("a", 1)})
    assert taken.completion_body("Hi", CompletionRequest(model="a", prompt="Hi"), 4)["lora_request"]["lora_int_id"] == 1
    narrow = Dialect("a server without LoRA", GATEWAY.response_format, 0, takes=frozenset({"model", "prompt"}))
    with pytest.raises(ValueError, match="adapter a: a server without LoRA has no field lora_request"):
        OpenAIUpstream("http://127.0.0.1:1", MODEL, narrow, adapters={"a": lora_request("a", 1)})
    clash = OpenAIUpstream("http://127.0.0.1:1", MODEL, GATEWAY, adapters={MODEL: lora_request(MODEL, 1)})
    with pytest.raises(ValueError, match="the base model's name"):
        create_app(clash, str(tiny_llama), MODEL)


def test_a_pytorch_build_with_adapters_serves_each_with_its_lora_request(tmp_path):
    """`Deployment.own_server`: the lora stage's index and PEFT directories become the gateway's adapter models, each
    with the release's lora_request naming the build's directory and task id; adapters without lora_config in the
    options are an error before anything starts."""
    from pipeline.adapter_registry import write_index
    from pipeline.errors import PipelineError
    from pipeline.targets.trtllm.llm_api_serving import Deployment

    repo = pytorch_repository(tmp_path, "1.2")
    deployment = Deployment.of(repo)
    assert deployment.own_server(8123).adapters == {}  # a build without the lora stage
    lora = tmp_path / "out" / "lora"
    for name in ("upper", "ahoy"):
        (lora / name).mkdir(parents=True)
    write_index(lora, {"upper": {"task_id": 1}, "ahoy": {"task_id": 2}})
    deployment.options.write_text(yaml.safe_dump({"backend": "pytorch"}))
    with pytest.raises(PipelineError, match="has no lora_config"):
        deployment.own_server(8123)
    deployment.options.write_text(yaml.safe_dump({"lora_config": {"max_lora_rank": 8}}))
    adapters = deployment.own_server(8123).adapters
    assert adapters == {
        "upper": {
            "lora_request": {"lora_name": "upper", "lora_int_id": 1, "lora_path": str((lora / "upper").resolve())}
        },
        "ahoy": {"lora_request": {"lora_name": "ahoy", "lora_int_id": 2, "lora_path": str((lora / "ahoy").resolve())}},
    }
    fronted = OpenAIUpstream("http://127.0.0.1:1", "model", deployment.own_server(8123).dialect, adapters=adapters)
    assert set(fronted.adapters) == {"upper", "ahoy"}  # 1.2's trtllm-serve takes lora_request


def test_a_lora_build_is_not_served_by_trtllm_serve_alone_on_an_open_address(tmp_path):
    """trtllm-serve loads whatever lora_path a request to its port names: with a lora_config, `serve` without the
    gateway keeps it on loopback (the refusal comes before the missing GPU is even looked at)."""
    from pipeline.errors import PipelineError
    from pipeline.targets.trtllm.llm_api_serving import Deployment, serve_llm_api

    repo = pytorch_repository(tmp_path, "1.2")
    Deployment.of(repo).options.write_text(yaml.safe_dump({"lora_config": {"max_lora_rank": 8}}))
    with pytest.raises(PipelineError, match="loads whatever lora_path a request to its port names") as raised:
        serve_llm_api(repo, "0.0.0.0", 8000)
    assert not isinstance(raised.value, TargetUnavailable)
    with pytest.raises(TargetUnavailable):  # on loopback, or behind the gateway, it goes on (to the missing GPU here)
        serve_llm_api(repo, "127.0.0.1", 8000)
