"""One real tritonserver on the default SmolLM2 CPU build, shared by the serving tests."""

from __future__ import annotations

import pytest

from pipeline.build import cache_dir
from pipeline.triton.server import TritonServer

PROMPT = "The capital of France is"
# Rows decoded in a batch are left-padded; the padding changes float summation order in attention, and
# the int8-compute MatMulNBits kernels amplify that into logit shifts of up to 2.6 (measured on 16 prompts
# x 8 steps, batched vs alone); served tokens measured at most 0.66 below the best in 4 x 32 streams,
# random ones 11-18 below. A served token in a batch is right when it is this close to the best.
BATCHED_LOGIT_TOLERANCE = 4.0


@pytest.fixture(scope="session")
def server(smollm2_build, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
    with TritonServer(smollm2_build / "triton_repo", cache_dir(), log_file=log_file) as running:
        yield running


@pytest.fixture(scope="session")
def url(server) -> str:
    return f"127.0.0.1:{server.ports.grpc}"


@pytest.fixture(scope="session")
def runner_text(smollm2_build):
    """What the ModelRunner generates greedily for PROMPT, decoded: the reference for the server."""
    from transformers import AutoTokenizer

    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    engine = smollm2_build / "engine"
    tokenizer = AutoTokenizer.from_pretrained(engine)
    runner = ModelRunner.from_dir(engine)

    def generate(prompt: str, max_tokens: int) -> str:
        ids = tokenizer.encode(prompt)
        out = runner.generate([ids], max_new_tokens=max_tokens, return_dict=True)
        return tokenizer.decode(
            out["output_ids"][0, 0, len(ids) : out["sequence_lengths"][0, 0]].tolist(),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )

    return generate


@pytest.fixture(scope="session")
def greedy_gaps(smollm2_build):
    """For a served continuation, how far below the runner's best logit each of its tokens is.

    The runner reads the prompt alone, then follows the served text: at each step it takes its best
    token that keeps the decoded text a prefix of the served one (re-encoding the text could split it
    differently, e.g. "\n\n" vs "\n", "\n"), so a flip at a near-tie is judged in the served context.
    """
    from transformers import AutoTokenizer

    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
    from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams

    engine = smollm2_build / "engine"
    tokenizer = AutoTokenizer.from_pretrained(engine)
    runner = ModelRunner.from_dir(engine)

    def gaps(prompt: str, served: str) -> list[float]:
        request = Request(tokenizer.encode(prompt), SamplingParams(4 * len(served) + 1, runner.end_id))
        batch, result, text = runner.prefill([request]), [], ""
        while text != served:
            logits = batch.logits[0]
            for token in logits.argsort()[::-1][:50]:
                candidate = tokenizer.decode(
                    request.output + [int(token)], skip_special_tokens=True, clean_up_tokenization_spaces=False
                )
                if len(candidate) > len(text) and served.startswith(candidate):
                    break
            else:
                raise AssertionError(f"none of the runner's 50 best tokens continues {text!r} towards {served!r}")
            result.append(float(logits.max() - logits[token]))
            request.output.append(int(token))
            text = candidate
            runner.decode_step(batch)
        return result

    return gaps
