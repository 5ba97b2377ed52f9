"""`bench serve --protocol openai --peer llama-server`: our OpenAI gateway (ignore_eos, usage in every chunk) and the
OpenAI request path against the real server, then llama-server measured side by side on the same prompts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import psutil
import pytest

from pipeline.bench import report
from pipeline.bench.peers import EngineSpec, PeerManifest
from pipeline.bench.serve import GATEWAY_FIELDS, openai_request
from pipeline.bench.serve_peer import PeerMissing, llama_server_files
from pipeline.bench.stats import summarize
from pipeline.errors import PipelineError
from tests.conftest import REPO, SMOLLM2_CONFIG, run_cli, slow_fixture

EMOJI = "Emoji party: \U0001f389\U0001f389"  # greedy output: more party emoji, three tokens each


def test_peer_options_are_checked_before_anything_starts():
    for args, message in (
        (["--peer", "llama-server"], "--peer llama-server speaks only the OpenAI API: add --protocol openai"),
        (["--peer", "vllm", "--protocol", "openai"], "--peer vllm: unknown; choose from llama-server"),
        (["--peer", "llama-server", "--protocol", "openai", "--http", "http://127.0.0.1:1"], "drop --grpc/--http"),
        (["--protocol", "websocket"], "--protocol websocket: use grpc, http, openai"),
        (["--protocol", "openai", "--grpc", "127.0.0.1:1"], "name the running OpenAI server's base URL with --http"),
    ):
        result = run_cli("bench", "serve", "absent.yaml", *args)
        assert result.returncode == 1 and message in result.stderr, result.stderr


def test_an_output_without_an_engine_is_named_before_anything_starts(tmp_path):
    result = run_cli("bench", "serve", str(SMOLLM2_CONFIG), "--protocol", "openai", "--output", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert f"no engine with a tokenizer in {tmp_path / 'engine'}" in " ".join(result.stderr.split()), result.stderr
    assert "pass that build's output directory as --output" in " ".join(result.stderr.split()), result.stderr


def test_a_missing_peer_is_named_with_its_reason_and_fix(tmp_path):
    with pytest.raises(PeerMissing, match=r"manifest.json not found: run `trtllm-pipeline bench peers CONFIG`$"):
        llama_server_files(tmp_path)
    PeerManifest(unavailable={"llama.cpp": "cmake is not installed"}).write(tmp_path)
    with pytest.raises(PeerMissing, match=r"cmake is not installed; build it with `trtllm-pipeline bench peers"):
        llama_server_files(tmp_path)
    gguf = EngineSpec("llama.cpp Q8_0", "llama.cpp", "Q8_0", "python", "m", str(tmp_path / "model-Q8_0.gguf"))
    PeerManifest([gguf], {"llama-server": str(tmp_path / "llama-server")}).write(tmp_path)
    with pytest.raises(PeerMissing, match=r"llama-server \(named in .*manifest.json\) does not exist"):
        llama_server_files(tmp_path)


def level(label: str, tok_s: float, ttft_s: float) -> dict:
    sample = {"ttft_s": ttft_s, "itl_s": [0.02] * 7, "e2e_s": ttft_s + 0.14, "output_tokens": 8, "error": None}
    summary = summarize([sample], 1.0, 2000, 250) | {"output_token_throughput": tok_s}
    return {"workload": "synthetic", "label": label, "summary": summary, "samples": [sample]}


def test_the_side_by_side_report_pairs_levels_with_our_ratios(tmp_path):
    ours = [level("concurrency 1", 40.0, 0.1), level("concurrency 8", 120.0, 0.4)]
    theirs = [level("concurrency 1", 50.0, 0.05), level("concurrency 8", 100.0, 0.8)]
    rows = report.serve_versus(ours, theirs[:1] + [theirs[1] | {"workload": "grounded"}])
    assert [(r["load"], r["output_tok_s_ratio"], r["ttft_p50_ratio"]) for r in rows] == [("concurrency 1", 0.8, 2.0)]
    table = report.serve_versus_table(report.serve_versus(ours, theirs), "llama-server")
    assert table.splitlines()[0].startswith(
        "| workload | load | output tok/s ours | llama-server | ours/llama-server |"
    )
    assert "| synthetic | concurrency 8 | 120.00 | 100.00 | 1.20x | 400.00 | 800.00 | 0.50x |" in table
    assert table.splitlines()[-1].endswith("| 20.00 | 20.00 | 1 (0) | 1 (0) |")  # ITL p99 ms, requests (errors)
    report.plot_serve(ours, tmp_path / "plot.png", theirs, "llama-server")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@slow_fixture(scope="module")
def gateway(smollm2_build):
    """tritonserver and our OpenAI gateway on the SmolLM2 build, started as `serve --openai` and `bench serve` do."""
    from pipeline.build import cache_dir
    from pipeline.serving.lifecycle import GatewayOptions, Serving, checked_repository, served_name
    from pipeline.triton.server import Ports, free_port

    repo = smollm2_build / "triton_repo"
    serving = Serving(
        repo,
        checked_repository(repo, repo),
        cache_dir(),
        ports=Ports.pick(),
        host="127.0.0.1",
        log_file=smollm2_build / "tritonserver-peer-tests.log",
        gateway=GatewayOptions(free_port(), None, 4.0),
        log=print,
    )
    with serving:
        serving.start(120)
        yield serving.openai_url, served_name(repo)


def test_the_gateway_honours_ignore_eos(gateway):
    """vLLM's field, sent as the openai client sends extensions: the answer that ended at 11 tokens runs to 32."""
    url, model = gateway
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is 2+2?"}]
    ended = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 32
    forced = client.chat.completions.create(
        model=model, messages=question, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 32
    assert forced.choices[0].message.content.startswith(ended.choices[0].message.content)


def test_openai_requests_count_every_token_of_chunks_that_carry_several(gateway, smollm2_build):
    """Emoji are three tokens each, streamed as one chunk: usage in every chunk (vLLM's continuous_usage_stats) gives
    each chunk's count, so the request's total and its inter-token gaps are exact."""
    from transformers import AutoTokenizer

    url, model = gateway
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=model,
        prompt=EMOJI,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    counts = [chunk.usage.completion_tokens for chunk in stream]
    steps = [after - before for before, after in zip([0, *counts], counts)]
    assert counts[-1] == 8 and min(steps) >= 0 and max(steps) == 3  # one emoji: three tokens in one chunk
    sample = asyncio.run(openai_request(url, model, GATEWAY_FIELDS, EMOJI, 8, True))
    assert sample["error"] is None and sample["output_tokens"] == 8
    assert len(sample["itl_s"]) == 8 - steps[0]  # the first chunk's tokens arrive with the first token
    assert sample["prompt_tokens"] == len(AutoTokenizer.from_pretrained(smollm2_build / "engine").encode(EMOJI))


def bench_serve(build: Path, out: Path, *extra: str):
    return run_cli(
        "bench",
        "serve",
        str(build / "triton_repo"),
        "--protocol",
        "openai",
        "--peer",
        "llama-server",
        "--concurrency",
        "1",
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--output-len",
        "8",
        "--out",
        str(out),
        *extra,
    )


def test_bench_serve_over_openai_runs_ours_and_names_a_peer_it_could_not_run(smollm2_build, tmp_path):
    PeerManifest(unavailable={"llama.cpp": "cmake is not installed"}).write(smollm2_build)
    result = bench_serve(smollm2_build, tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "latest-serve" / "results.json").read_text())
    assert data["settings"]["protocol"] == "openai" and data["settings"]["model"] == smollm2_build.name
    assert [lv["summary"]["errors"] for lv in data["levels"]] == [0, 0]
    assert all(s["output_tokens"] == 8 for lv in data["levels"] for s in lv["samples"])
    # tritonserver behind the gateway counted what the client counted
    assert [lv["server"]["generated_tokens"] for lv in data["levels"]] == [16, 16]
    reason = "cmake is not installed; build it with `trtllm-pipeline bench peers CONFIG --peer llama.cpp`"
    assert reason in data["peer"]["unavailable"] and data["versus"] == []
    summary = (tmp_path / "latest-serve" / "summary.md").read_text()
    assert f"Not measured:\n\n- llama-server: {reason}" in summary and reason in result.stdout


def built_llama_server() -> Path:
    """llama-server as `make peers` built it for the default build on this machine (compiled once per machine)."""
    from pipeline.build import default_output

    binary = PeerManifest.read(REPO / default_output(REPO / SMOLLM2_CONFIG)).tools.get("llama-server")
    if not binary or not Path(binary).is_file():
        pytest.skip("llama.cpp is not built on this machine: run `make peers`")
    return Path(binary)


def llama_servers(binary: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["exe"]) if p.info["exe"] == str(binary.resolve())]


def test_bench_serve_measures_llama_server_side_by_side(smollm2_build, tmp_path):
    binary = built_llama_server()
    peers = run_cli("bench", "peers", SMOLLM2_CONFIG, "--output", str(smollm2_build), "--peer", "llama.cpp")
    assert peers.returncode == 0, peers.stdout + peers.stderr
    result = bench_serve(smollm2_build, tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "latest-serve" / "results.json").read_text())
    peer = data["peer"]
    assert "levels" in peer, peer.get("unavailable")
    assert peer["prompts_token_identical"] == 4 and peer["parallel"] == 8  # the build's max_batch_size
    assert "--cache-ram" in peer["command"] and str(8 * 2048) in peer["command"]  # slots x max_seq_len
    for side in (data["levels"], peer["levels"]):
        assert [lv["summary"]["errors"] for lv in side] == [0, 0]
        assert all(s["output_tokens"] == 8 for lv in side for s in lv["samples"])  # ignore_eos on both
    ours_prompts = sorted(s["prompt_tokens"] for lv in data["levels"] for s in lv["samples"])
    assert sorted(s["prompt_tokens"] for lv in peer["levels"] for s in lv["samples"]) == ours_prompts
    assert [(r["load"], r["output_tok_s_ratio"] > 0) for r in data["versus"]] == [
        ("concurrency 1", True),
        ("concurrency 2", True),
    ]
    summary = (tmp_path / "latest-serve" / "summary.md").read_text()
    assert "| output tok/s ours | llama-server | ours/llama-server |" in summary
    assert (tmp_path / "latest-serve" / "throughput_vs_latency.png").is_file()
    assert not llama_servers(binary)  # stopped with the run


def test_llama_server_that_cannot_load_its_model_fails_with_its_log_and_leaves_nothing(tmp_path):
    from pipeline.bench.serve_peer import LlamaServer

    binary = built_llama_server()
    (tmp_path / "model.gguf").write_text("not a GGUF")
    server = LlamaServer(
        binary, tmp_path / "model.gguf", parallel=2, threads=1, context=512, log_file=tmp_path / "llama-server.log"
    )
    with pytest.raises(PipelineError, match=r"llama-server exited with code \d+: its log \(.*\) ends: "):
        server.start()
    assert server.process is None and not llama_servers(binary)
