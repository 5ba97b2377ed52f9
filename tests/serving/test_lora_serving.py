"""Multi-LoRA served: a tiny Llama built with two random PEFT adapters and prefix reuse, in the real tritonserver,
called through the ensemble (lora_task_id) and through the OpenAI gateway with the `openai` client (the adapter
chosen by `model`), each answer equal to the ModelRunner's for that adapter; an adapter added while serving."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from pipeline.build import cache_dir
from pipeline.runtime.model_runner import ModelRunner
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
    work = tmp_path_factory.mktemp("lora-serving")
    adapters = {
        name: make_adapter(tiny_llama, work / name, seed, **s) for seed, (name, s) in enumerate(ADAPTERS.items())
    }
    extra = make_adapter(tiny_llama, work / "added", 9, r=2, lora_alpha=2, target_modules=["o_proj", "down_proj"])
    config = lora_config(work / "tiny-lora.yaml", tiny_llama, adapters, "{enable_kv_cache_reuse: true}")
    result = run_cli("build", str(config), "--output", str(work / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out", adapters, extra


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
    adapters = {"every": 1, "qv": 2}
    with running(served.ports.grpc, out / "engine", adapters=adapters, llm_model="tensorrt_llm") as base_url:
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
        wrong = httpx.post(f"{base_url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(out)})
        assert wrong.status_code == 400 and "adapter_config.json not found" in wrong.text
