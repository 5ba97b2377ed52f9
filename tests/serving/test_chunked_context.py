"""Chunked context on the CPU target: a long prompt is prefilled a piece per step between decode steps."""

from __future__ import annotations

import shutil
import threading

import pytest
import yaml

from pipeline.build import cache_dir
from pipeline.triton.client import stream_text
from pipeline.triton.server import TritonServer
from tests.conftest import REPO, run_cli
from tests.serving.conftest import BATCHED_LOGIT_TOLERANCE, PROMPT
from tests.serving.test_serving import metric

MAX_NUM_TOKENS = 64


@pytest.fixture(scope="module")
def chunked_server(smollm2_build, tmp_path_factory):
    """The default build with max_num_tokens 64 and chunked context (import and export reused from the
    default build)."""
    out = tmp_path_factory.mktemp("chunked") / "out"
    shutil.copytree(smollm2_build, out, ignore=shutil.ignore_patterns("triton_repo", "*.log"))
    settings = yaml.safe_load((REPO / "build_configs" / "smollm2-135m-cpu.yaml").read_text())
    settings["build"]["max_num_tokens"] = MAX_NUM_TOKENS
    settings["runtime"]["enable_chunked_context"] = True
    # the default build's gate stands for the model; this one is about serving, so its gate scores a quarter of the
    # text and no chat set (the export stage reads verify too, and re-runs: seconds)
    settings["verify"] |= {"eval_tokens": 512, "min_chat_answer_match": None}
    config = out.parent / "chunked.yaml"
    config.write_text(yaml.safe_dump(settings))
    result = run_cli("build", str(config), "--output", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "import: running" not in result.stdout  # the checkpoint is reused
    with TritonServer(out / "triton_repo", cache_dir(), log_file=out / "tritonserver-test.log") as running:
        yield running


def test_a_long_prompt_is_prefilled_in_pieces_while_another_stream_decodes(chunked_server, greedy_gaps):
    url = f"127.0.0.1:{chunked_server.ports.grpc}"
    long_prompt = (
        "The history of the city of Paris, told year by year. " * 24
    )  # ~300 tokens: at least 5 pieces of <= 64
    before = metric(chunked_server, "trtllm_pipeline_prefill_chunks_total")
    results = {}
    short = threading.Thread(
        target=lambda: results.__setitem__("short", "".join(stream_text(url, "ensemble", PROMPT, 24)))
    )
    short.start()
    results["long"] = "".join(stream_text(url, "ensemble", long_prompt, 8))
    short.join(timeout=120)
    assert metric(chunked_server, "trtllm_pipeline_prefill_chunks_total") - before >= 300 // MAX_NUM_TOKENS + 1
    for name, prompt in (("short", PROMPT), ("long", long_prompt)):
        assert results[name] and max(greedy_gaps(prompt, results[name])) < BATCHED_LOGIT_TOLERANCE, (
            name,
            results[name],
        )
