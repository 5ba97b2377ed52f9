"""runtime.batch_invariant on a real int8 engine (MatMulNBits with int8 activations, the default CPU quantization)
of a tiny random Llama: a request's logits, bit for bit, do not depend on its batch or on how its prompt is chunked."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams
from pipeline.targets.onnxruntime.runtime.speculative import NGram
from tests.runtime.conftest import finish_engine_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_llama):
    """The fused graph quantized as the default config quantizes it (int8 weights, int8 compute)."""
    from pipeline.targets.onnxruntime import graph as fused_onnx
    from pipeline.targets.onnxruntime.quantize import quantize_graph

    work = tmp_path_factory.mktemp("batch-invariant-engine")
    export, engine = work / "export", work / "engine"
    export.mkdir()
    fused_onnx.build(tiny_llama, export / "model.onnx")
    assert quantize_graph(export, engine, weights="int8", group_size=32)["accuracy_level"] == 4
    return finish_engine_dir(tiny_llama, engine, max_batch_size=8)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(3, 200, size=n)] for n in (9, 4, 13, 1, 6)]


def chunked_logits(runner: ModelRunner, prompt: list[int], chunk: int) -> np.ndarray:
    request, partial = Request(prompt, SamplingParams(4, -1)), None
    while partial is None or partial.length < len(prompt):
        partial = runner.prefill_chunk(partial, request, chunk)
    return partial.logits[0]


def greedy(runner: ModelRunner, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    requests = [Request(prompt, SamplingParams(12, -1)) for prompt in batch]
    for _ in runner.run(requests):
        pass
    return [(r.output, r.log_probs) for r in requests]


def test_chunking_changes_an_int8_engine_unless_batch_invariant(engine):
    plain, invariant = (ModelRunner.from_dir(engine, num_threads=1, batch_invariant=mode) for mode in (False, True))
    prompt = prompts()[2]
    for runner, must_match in ((invariant, True), (plain, False)):
        whole = runner.prefill([Request(prompt, SamplingParams(4, -1))]).logits[0]
        same = [np.array_equal(whole, chunked_logits(runner, prompt, chunk)) for chunk in (1, 2, 3, 5)]
        assert all(same) if must_match else not all(same), same


def test_greedy_tokens_and_log_probs_do_not_depend_on_the_batch(engine):
    runner = ModelRunner.from_dir(engine, num_threads=1, batch_invariant=True)
    batch = prompts()
    alone = [greedy(runner, [prompt])[0] for prompt in batch]
    assert greedy(runner, batch) == alone
    assert greedy(runner, batch[:3]) + greedy(runner, batch[3:]) == alone
    assert greedy(runner, batch[::-1]) == alone[::-1]


def test_speculation_keeps_the_invariant_runner_within_its_buffers(engine):
    """Drafts verified on a 1-row view get a dummy token too; the row's capacity leaves room for it."""
    plain = ModelRunner.from_dir(engine, num_threads=1, batch_invariant=True)
    drafting = ModelRunner.from_dir(engine, num_threads=1, batch_invariant=True, speculative=NGram(4, 2))
    batch = [prompt * 3 for prompt in prompts()]
    assert [tokens for tokens, _ in greedy(drafting, batch)] == [tokens for tokens, _ in greedy(plain, batch)]
