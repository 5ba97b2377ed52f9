"""Multi-LoRA served: a tiny Llama built with two random PEFT adapters and prefix reuse, in the real tritonserver,
called through the ensemble (lora_task_id) and through the OpenAI gateway with the `openai` client (the adapter
chosen by `model`), each answer equal to the ModelRunner's for that adapter; an adapter added while serving."""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pipeline.build import cache_dir
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.triton.client import stream_text
from pipeline.triton.server import TritonServer
from tests.conftest import run_cli, slow_fixture
from tests.runtime.test_multi_lora import ADAPTERS, lora_config, make_adapter
from tests.serving.test_openai import MODEL, running
from tests.serving.test_serving import metric

PROMPT = " ".join(f"w{i}" for i in range(3, 40))  # 37 tokens: a full 32-token block for the prefix cache
NEW_TOKENS = 8


def lora_requests(server, adapter: str) -> float:
    """trtllm_pipeline_lora_requests_total of one adapter (0 before its first request)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{server.ports.metrics}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    family = families.get("trtllm_pipeline_lora_requests")  # the parser drops a counter's _total
    return sum(s.value for s in family.samples if s.labels.get("adapter") == adapter) if family else 0.0


@slow_fixture(scope="module")
def lora_build(tiny_llama, tmp_path_factory):
    """The build (max_cpu_loras 4: two more adapters may be loaded while serving) and, in `allowed/`, the directory
    `serve --allow-lora-dir` names in these tests, one more adapter."""
    work = tmp_path_factory.mktemp("lora-serving")
    adapters = {
        name: make_adapter(tiny_llama, work / name, seed, **s) for seed, (name, s) in enumerate(ADAPTERS.items())
    }
    allowed = work / "allowed"
    extra = make_adapter(tiny_llama, allowed / "added", 9, r=2, lora_alpha=2, target_modules=["o_proj", "down_proj"])
    config = lora_config(work / "tiny-lora.yaml", tiny_llama, adapters, "{enable_kv_cache_reuse: true}", cpu_loras=4)
    result = run_cli("build", str(config), "--output", str(work / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out", adapters, extra


def with_lora_a(source: Path, out: Path, change) -> Path:
    """A copy of the adapter in `source` whose every lora_A is `change(tensor)`, saved as safetensors.numpy does."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(source / "adapter_model.safetensors")
    save_file({k: change(t) if "lora_A" in k else t for k, t in tensors.items()}, out / "adapter_model.safetensors")
    return out


def gateway_admin(served: TritonServer, out: Path, allowed: list[Path]):
    """The gateway's adapters as `serve --openai --allow-lora-dir ...` sets them up for this server."""
    from pipeline.serving.lifecycle import adapter_admin
    from pipeline.triton.validate import validate_repo

    return adapter_admin(validate_repo(out / "triton_repo"), served.lora_registry, allowed)


@pytest.fixture(scope="module")
def served(lora_build):
    out, _, _ = lora_build
    with TritonServer(out / "triton_repo", cache_dir(), log_file=out / "tritonserver.log") as server:
        yield server


@pytest.fixture(scope="module")
def expected(lora_build) -> dict[str, str]:
    """Each model's greedy continuation of PROMPT as the ModelRunner decodes it (base, the adapters, the one added)."""
    from transformers import AutoTokenizer

    out, adapters, extra = lora_build
    names = [*adapters, "added"]
    runner = ModelRunner.from_dir(out / "engine", num_threads=1, lora_dir=[*adapters.values(), extra])
    tokenizer = AutoTokenizer.from_pretrained(out / "engine")
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    texts = {}
    for uid, name in [("-1", MODEL), *((str(i), n) for i, n in enumerate(names))]:
        result = runner.generate([ids], max_new_tokens=NEW_TOKENS, end_id=-1, lora_uids=[uid], return_dict=True)
        tokens = result["output_ids"][0, 0, len(ids) : result["sequence_lengths"][0, 0]].tolist()
        texts[name] = tokenizer.decode(tokens).replace(" ", "")  # word-level pieces stream without their spaces
    assert len(set(texts.values())) == len(texts)  # every adapter answers differently
    return texts


def test_the_ensemble_selects_adapters_by_lora_task_id_and_keeps_prefix_blocks_apart(served, expected):
    url = f"127.0.0.1:{served.ports.grpc}"

    def ask(task_id: int | None) -> str:
        return "".join(stream_text(url, "ensemble", PROMPT, NEW_TOKENS, end_id=-1, lora_task_id=task_id)).replace(
            " ", ""
        )

    hits = metric(served, "trtllm_pipeline_prefix_cache_hit_blocks_total")
    assert ask(None) == expected[MODEL]
    # the same prompt with each adapter: the base model's stored block is not theirs
    assert ask(1) == expected["every"] and ask(2) == expected["qv"]
    assert metric(served, "trtllm_pipeline_prefix_cache_hit_blocks_total") == hits
    assert ask(1) == expected["every"]  # its own block, stored by its first request, is
    assert metric(served, "trtllm_pipeline_prefix_cache_hit_blocks_total") == hits + 1
    with pytest.raises(Exception, match=r"lora_task_id 7 names no loaded LoRA adapter; loaded: 1 \(every\), 2 \(qv\)"):
        ask(7)


def test_the_openai_client_selects_adapters_by_model_in_one_batch(served, lora_build, expected):
    out, _, extra = lora_build
    admin = gateway_admin(served, out, [extra.parent])
    with running(served.ports.grpc, out / "engine", lora=admin) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL, "every", "qv"]

        def complete(model: str) -> str:
            reply = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return reply.choices[0].text.replace(" ", "")

        before = lora_requests(served, "qv")
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # base and both adapters decoding together
            models = [MODEL, "every", "qv"] * 2
            assert list(pool.map(complete, models)) == [expected[m] for m in models]
        assert lora_requests(served, "qv") == before + 2
        with pytest.raises(openai.NotFoundError, match="this server serves 'smollm2-135m-cpu', 'every', 'qv'"):
            complete("base")

        added = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "added", "lora_path": str(extra)})
        assert added.status_code == 200, added.text
        assert complete("added") == expected["added"]
        assert [m.id for m in client.models.list()] == [MODEL, "every", "qv", "added"]
        again = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "added", "lora_path": str(extra)})
        assert again.status_code == 400 and "already served" in again.text
        (extra.parent / "empty").mkdir()
        wrong = httpx.post(
            f"{base_url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(extra.parent / "empty")}
        )
        assert wrong.status_code == 400 and "adapter_config.json not found" in wrong.text
        unloaded = httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "added"})
        assert unloaded.status_code == 200, unloaded.text
        assert [m.id for m in client.models.list()] == [MODEL, "every", "qv"]
        with pytest.raises(Exception, match="lora_task_id 3 names no loaded LoRA adapter"):
            "".join(stream_text(f"127.0.0.1:{served.ports.grpc}", "ensemble", PROMPT, 2, lora_task_id=3))
        built = httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "every"})
        assert built.status_code == 400 and "one of the build's adapters" in built.text


def test_load_lora_adapter_reads_only_allowed_directories_and_stops_at_max_cpu_loras(served, lora_build, tmp_path):
    """A path outside the allowed directory (symbolic links resolved first) is refused naming only what the operator
    allowed; a missing one inside is named missing; past lora.max_cpu_loras (4: the build's two and two more) a
    load is refused until one is unloaded."""
    out, _, extra = lora_build
    allowed = extra.parent
    (allowed / "escape").symlink_to(out / "lora" / "every")  # a real adapter, outside the allowed directory
    with running(served.ports.grpc, out / "engine", lora=gateway_admin(served, out, [allowed])) as base_url:

        def load(name: str, path) -> httpx.Response:
            return httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

        for path in (out / "lora" / "every", allowed / "escape", "/etc", "/no/such/dir"):
            refused = load("x", path)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 400 and message == (
                f"lora_path is not in an allowed adapter directory ({allowed.resolve()})"
            ), (path, message)
        missing = load("x", allowed / "gone")
        assert missing.status_code == 400 and missing.json()["error"]["message"] == (
            f"lora_path {allowed / 'gone'} does not exist"
        )
        for name in ("one", "two"):
            assert load(name, extra).status_code == 200
        full = load("three", extra)
        assert full.status_code == 400 and "4 adapters are served, lora.max_cpu_loras is 4: unload one" in full.text
        for name in ("one", "two"):
            assert httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    with running(served.ports.grpc, out / "engine", lora=gateway_admin(served, out, [])) as base_url:
        closed = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(extra)})
        assert closed.status_code == 400 and "start serve with --allow-lora-dir" in closed.text


def test_one_tenants_broken_adapter_never_changes_another_tenants_answers(served, lora_build, expected):
    """A NaN adapter is refused when loaded (400 naming the tensor). One whose finite weights overflow passes every
    check (below the load check): while it decodes, the base model and another adapter answer in the same batch
    exactly as alone, and only its own request fails, naming it."""
    out, _, extra = lora_build
    nan = with_lora_a(extra, extra.parent / "nan", lambda t: np.full_like(t, np.nan))
    huge = with_lora_a(extra, extra.parent / "huge", lambda t: np.full_like(t, 3e38))
    with running(served.ports.grpc, out / "engine", lora=gateway_admin(served, out, [extra.parent])) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        refused = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "nan", "lora_path": str(nan)})
        assert refused.status_code == 400
        assert "lora_A.weight holds NaN; a LoRA weight must be finite" in refused.json()["error"]["message"]
        loaded = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(huge)})
        assert loaded.status_code == 200, loaded.text

        def complete(model: str) -> str:
            try:
                reply = client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
                )
            except openai.APIStatusError as exc:
                return exc.message
            return reply.choices[0].text.replace(" ", "")

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            models = ["huge", MODEL, "every"] * 2
            answers = list(pool.map(complete, models))
        assert answers[1:3] == answers[4:6] == [expected[MODEL], expected["every"]]
        for answer in answers[0::3]:
            assert "LoRA adapter 'huge' produced non-finite logits" in answer, answer
        assert httpx.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "huge"}).status_code == 200


def test_tritons_own_port_can_neither_load_nor_replace_an_adapter(served, lora_build, expected):
    """Triton's ports carry no authentication: a gRPC request straight to the LLM model naming a directory of the
    server's under an adapter's name is refused by tritonserver (no such input), and the adapter answers as before;
    the model's config, which any client can read, names no registry."""
    import tritonclient.grpc as grpcclient

    out, _, extra = lora_build
    url = f"127.0.0.1:{served.ports.grpc}"
    values = {
        "input_ids": np.array([[5, 6, 7]], np.int32),
        "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[1]], np.int32),
        "lora_task_id": np.array([[1]], np.uint64),
        "lora_adapter_dir": np.array([[str(extra).encode()]], object),
        "lora_adapter_name": np.array([[b"every"]], object),
    }
    wire = {np.dtype(np.int32): "INT32", np.dtype(np.uint64): "UINT64", np.dtype(object): "BYTES"}
    tensors = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), wire[value.dtype])
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    answers: list = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.append(error or result))
    client.async_stream_infer("tensorrt_llm", tensors)
    deadline = time.monotonic() + 10
    while not answers and time.monotonic() < deadline:
        time.sleep(0.05)
    client.stop_stream()
    assert re.search(r"unexpected inference input 'lora_adapter_(dir|name)' for model 'tensorrt_llm'", str(answers[0]))
    config = httpx.get(f"http://127.0.0.1:{served.ports.http}/v2/models/tensorrt_llm/config").text
    assert "lora_adapter_dir" not in config and "registry" not in config
    answer = "".join(stream_text(url, "ensemble", PROMPT, NEW_TOKENS, end_id=-1, lora_task_id=1))
    assert answer.replace(" ", "") == expected["every"]


def test_serve_answers_503_until_tritonserver_is_ready_then_serves_every_route(lora_build, expected, tmp_path):
    """`serve --openai` starts the gateway before tritonserver: a client polling /v1/models (or /health) is told 503
    until the models are loaded, and from its first 200 on a request is served."""
    from pipeline.build import cache_dir
    from pipeline.serving.lifecycle import GatewayOptions, Serving, checked_repository
    from pipeline.triton.server import Ports, free_port

    out, _, extra = lora_build
    repo, key = out / "triton_repo", {"Authorization": "Bearer sk-test"}
    gateway = GatewayOptions(free_port(), "sk-test", 4.0, (extra.parent,))
    report = checked_repository(repo, repo)
    serving = Serving(
        repo, report, cache_dir(), ports=Ports.pick(), host="127.0.0.1", log_file=tmp_path / "log", gateway=gateway
    )
    with serving:
        starting = threading.Thread(target=serving.start, args=(120,))
        starting.start()
        health, models, healths = f"{serving.openai_url.removesuffix('/v1')}/health", [], []
        while not models or models[-1] != 200:
            try:
                models.append(httpx.get(f"{serving.openai_url}/models", headers=key).status_code)
                healths.append(httpx.get(health).status_code)
            except httpx.ConnectError:  # the gateway is not listening yet
                assert starting.is_alive()
            time.sleep(0.05)
        for seen in (models, healths):  # tritonserver takes seconds to load: polled many times, 503 until ready
            assert 503 in seen and set(seen) <= {503, 200} and seen == sorted(seen, reverse=True), seen
        client = openai.OpenAI(base_url=serving.openai_url, api_key="sk-test", max_retries=0)
        reply = client.completions.create(
            model="every", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text.replace(" ", "") == expected["every"]
        assert httpx.get(health).status_code == 200
        starting.join()
