"""One real tritonserver on the default SmolLM2 CPU build, shared by the serving tests."""

from __future__ import annotations

import pytest

from pipeline.build import cache_dir
from pipeline.triton.server import TritonServer

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def server(smollm2_build):
    with TritonServer(smollm2_build / "triton_repo", cache_dir(), log_file=smollm2_build / "tritonserver-test.log") as running:
        yield running


@pytest.fixture(scope="session")
def url(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


@pytest.fixture(scope="session")
def runner_text(smollm2_build):
    """What the ModelRunner generates greedily for PROMPT, decoded: the reference for the server."""
    from transformers import AutoTokenizer

    from pipeline.runtime.model_runner import ModelRunner

    engine = smollm2_build / "engine"
    tokenizer = AutoTokenizer.from_pretrained(engine)
    runner = ModelRunner.from_dir(engine)

    def generate(prompt: str, max_tokens: int) -> str:
        ids = tokenizer.encode(prompt)
        out = runner.generate([ids], max_new_tokens=max_tokens, return_dict=True)
        return tokenizer.decode(out["output_ids"][0, 0, len(ids): out["sequence_lengths"][0, 0]].tolist(), skip_special_tokens=True)

    return generate


