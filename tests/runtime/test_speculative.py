"""N-gram speculative decoding (runtime.speculative) on a real fp32 fused-graph engine of a tiny random Llama: the
output must be plain greedy decoding's, stop conditions included; plus the trtllm targets' handling of the setting."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.targets.onnxruntime.runtime.kv_layouts import Batch
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.sampling import Request, SamplingParams
from pipeline.targets.onnxruntime.runtime.scheduler import Scheduler
from pipeline.targets.onnxruntime.runtime.speculative import NGram, accept, ngram_drafts
from pipeline.validation import load_config
from tests.conftest import write_config
from tests.runtime.conftest import finish_engine_dir

NGRAM = NGram(max_draft_len=4, max_matching_ngram_size=2)
NO_END = -1


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_llama):
    """The fused graph and the engine's config.json written directly (no CLI build: a second is enough)."""
    from pipeline.targets.onnxruntime import graph as fused_onnx

    engine = tmp_path_factory.mktemp("speculative-engine") / "engine"
    engine.mkdir()
    fused_onnx.build(tiny_llama, engine / "model.onnx")
    return finish_engine_dir(tiny_llama, engine, max_batch_size=4)


@pytest.fixture(scope="module")
def runners(engine) -> tuple[ModelRunner, ModelRunner]:
    """(plain, speculative) over the same engine."""
    return ModelRunner.from_dir(engine, num_threads=1), ModelRunner.from_dir(engine, num_threads=1, speculative=NGRAM)


def prompts() -> list[list[int]]:
    """Ragged prompts that repeat themselves, so the model's continuations (and their loops) are drafted."""
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 200, size=n)] * 3 for n in (3, 7, 12, 2)]


def generate(runner: ModelRunner, batch: list[list[int]], **kwargs) -> list[list[int]]:
    out = runner.generate(batch, end_id=kwargs.pop("end_id", NO_END), return_dict=True, **kwargs)
    return [
        out["output_ids"][row, 0, len(p) : int(out["sequence_lengths"][row, 0])].tolist() for row, p in enumerate(batch)
    ]


def test_ngram_drafts_follow_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2]
    assert ngram_drafts(tokens, 3, 2) == [4, 5, 6]  # the latest earlier [1, 2], not the first
    assert ngram_drafts(tokens, 1, 2) == [4]
    assert ngram_drafts([7, 1, 2, 8, 5, 2], 2, 2) == [8, 5]  # no earlier [5, 2]: falls back to [2]
    assert ngram_drafts([1, 2, 3, 1, 2, 3, 1, 2], 4, 2) == [3, 1, 2, 3]  # the latest match a full draft follows
    assert ngram_drafts([5] * 6, 4, 2) == [5] * 4  # in a loop, not the 1 token after the suffix's neighbour
    assert ngram_drafts([1, 2, 3], 4, 3) == []
    assert ngram_drafts([5], 4, 2) == []


def test_speculative_output_and_log_probs_equal_plain_greedy_alone_and_batched(runners):
    plain, speculative = runners
    batch = prompts()
    for rows in ([batch[0]], batch):
        want = plain.generate(rows, max_new_tokens=40, end_id=NO_END, return_dict=True, output_log_probs=True)
        got = speculative.generate(rows, max_new_tokens=40, end_id=NO_END, return_dict=True, output_log_probs=True)
        assert got["output_ids"].tolist() == want["output_ids"].tolist()
        assert np.allclose(got["log_probs"].numpy(), want["log_probs"].numpy(), atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_scheduler_counts_drafts_and_each_accepted_draft_saves_a_step(runners, rows):
    plain, speculative = runners
    batch = prompts()[:rows]
    want = generate(plain, batch, max_new_tokens=40)
    scheduler = Scheduler(speculative)
    answers = [[] for _ in batch]
    for row, prompt in enumerate(batch):
        scheduler.submit(
            {"input_ids": np.array([prompt]), "request_output_len": np.array([[40]]), "end_id": np.array([[NO_END]])},
            Collect(answers[row]),
        )
    steps = 0
    while not scheduler.idle:
        scheduler.step()
        steps += 1
    assert answers == want
    drafted, accepted = scheduler.counters["draft_tokens_total"], scheduler.counters["accepted_draft_tokens_total"]
    assert 0 < accepted <= drafted
    assert scheduler.counters["generated_tokens_total"] == sum(map(len, want))
    if rows == 1:
        assert steps == 40 - accepted  # a step per token that was not an accepted draft


class Collect:
    """A Responder keeping a row's final tokens."""

    def __init__(self, into: list):
        self.into = into

    def send_tokens(self, row, tokens, log_probs, cum_log_prob, final):
        if final:
            self.into.extend(tokens)

    def send_error(self, message):
        raise AssertionError(message)

    def send_final(self):
        raise AssertionError("no tokens")


def test_stop_words_end_id_and_max_new_tokens_cut_where_plain_decoding_does(runners):
    """The tiny model soon repeats one token X, which is then drafted and accepted 4 at a time: a stop word of k
    X's or a max_new_tokens limit falls inside a step's accepted drafts."""
    plain, speculative = runners
    prompt = prompts()[1]
    looped = generate(plain, [prompt], max_new_tokens=40)[0][-1]
    cases = [{"max_new_tokens": n} for n in (1, 2, 3, 5, 6, 17)]
    cases += [{"max_new_tokens": 40, "stop_words_list": [[[looped] * k]]} for k in (2, 3, 6, 11)]
    cases += [{"max_new_tokens": 40, "stop_words_list": [[[198, 199], [looped] * 9]]}]
    cases += [{"max_new_tokens": 40, "end_id": end_id} for end_id in (looped, 2)]
    for case in cases:
        assert generate(speculative, [prompt], **case) == generate(plain, [prompt], **case), case


@pytest.mark.parametrize(
    ("settings", "finish"),
    [({"end_id": 7}, "end_id"), ({"end_id": NO_END, "stop_words": [[5, 7]]}, "stop_words")],
)
def test_a_draft_that_would_finish_the_request_is_left_to_sample(settings, finish):
    """Drafts [4, 5, 7, 8] that the logits all agree with: 7 ends the request, so only 4, 5 are accepted and the
    next `sample` takes 7 from the logits after them, finishing as plain decoding would."""
    drafts, vocab = [4, 5, 7, 8], 10
    logits = np.zeros((len(drafts) + 1, vocab), dtype=np.float32)
    logits[np.arange(len(drafts)), drafts] = 5.0  # logits[i] predicts drafts[i]
    request = Request([1, 2, 3], SamplingParams(max_new_tokens=20, **settings))
    taken = accept(request, drafts, logits)
    assert taken == 2 and request.output == [4, 5] and not request.finished
    batch = Batch([request], past={}, logits=logits[taken : taken + 1])
    ModelRunner.sample(batch)
    assert request.finish_reason == finish and request.output == ([4, 5] if finish == "end_id" else [4, 5, 7])


def test_sampling_and_penalised_rows_decode_normally_beside_speculating_ones(runners):
    """Greedy rows draft; a sampled row and a repetition-penalised one (greedy, but sequence-dependent) do not, so
    their last tokens run in a batched step and the greedy rows' drafts after it."""
    settings = [
        {},
        {"runtime_top_k": 5, "temperature": 0.8, "random_seed": 3},
        {"repetition_penalty": 1.3},
        {},
    ]
    answers, counters = {}, {}
    for name, runner in zip(("plain", "speculative"), runners):
        scheduler = Scheduler(runner)
        answers[name] = [[] for _ in settings]
        for row, (prompt, named) in enumerate(zip(prompts(), settings)):
            request = {"input_ids": np.array([prompt]), "request_output_len": np.array([[30]])}
            request |= {"end_id": np.array([[NO_END]])} | {k: np.array([[v]]) for k, v in named.items()}
            scheduler.submit(request, Collect(answers[name][row]))
        while not scheduler.idle:
            scheduler.step()
        counters[name] = scheduler.counters
    assert answers["speculative"] == answers["plain"]
    assert counters["speculative"]["accepted_draft_tokens_total"] > 0


# ---------------------------------------------------------------- the setting, per target

SPECULATIVE = "runtime: {speculative: {type: ngram, max_draft_len: 5, max_matching_ngram_size: 3}}\n"


def trtllm_config(tmp_path, tiny_llama, backend: str, release: str, runtime: str = SPECULATIVE):
    return write_config(
        tmp_path / f"{backend}-{release}.yaml",
        f"model: {{source: hf, path: {tiny_llama}}}\n"
        f'target: {{name: trtllm, trtllm_backend: {backend}, trtllm_version: "{release}"}}\n'
        "build: {max_batch_size: 4, max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}\n" + runtime,
    )


def test_the_pytorch_backend_writes_speculative_config_each_release_accepts(tmp_path, tiny_llama):
    from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES, options_problems
    from pipeline.targets.trtllm.pytorch_backend import RELEASES, release_options
    from pipeline.upstream import facts

    for release in RELEASES[
        1:
    ]:  # 1.0 refuses a guided decoder beside it (tests/targets/test_trtllm_pytorch_backend.py)
        options, problems = release_options(load_config(trtllm_config(tmp_path, tiny_llama, "pytorch", release)))
        assert problems == []
        assert options["speculative_config"] == {
            "decoding_type": "NGram",
            "max_draft_len": 5,
            "max_matching_ngram_size": 3,
        }
    for release in LLM_API_RELEASES:  # the table checks what we write: a wrong key or type is named
        fields = facts("llm_args")["releases"][release]["models"]["NGramDecodingConfig"]["fields"]
        assert fields["max_draft_len"]["default"] is None  # no usable default upstream: required in ours
        bad = {"speculative_config": {"decoding_type": "NGram", "max_draft_len": "5", "max_ngram": 3}}
        assert {path[-1] for path, _ in options_problems(bad, release)} == {"max_draft_len", "max_ngram"}


def test_max_draft_len_is_required(tmp_path, tiny_llama):
    runtime = "runtime: {speculative: {type: ngram}}\n"
    with pytest.raises(ConfigError) as info:
        load_config(trtllm_config(tmp_path, tiny_llama, "pytorch", "1.2", runtime))
    assert any("runtime.speculative.max_draft_len" in p for p in info.value.problems), info.value.problems


def test_the_engine_backend_refuses_it_and_names_the_backend_that_reads_it(tmp_path, tiny_llama):
    from pipeline.upstream import facts

    flag = facts("trtllm_build_flags")["flags"]["--speculative_decoding_mode"]
    modes = {*flag["choices"], *(m for v in flag.get("by_version", {}).values() for m in v.get("choices") or ())}
    assert not any("ngram" in mode or "lookup" in mode for mode in modes)  # trtllm-build has no n-gram mode
    with pytest.raises(ConfigError) as info:
        load_config(trtllm_config(tmp_path, tiny_llama, "tensorrt", "1.2"))
    assert info.value.problems and all(
        "runtime.speculative" in p and "target.trtllm_backend: pytorch" in p for p in info.value.problems
    ), info.value.problems


def test_onnxruntime_with_the_optimum_graph_refuses_it(tmp_path, tiny_llama):
    path = write_config(
        tmp_path / "optimum.yaml",
        f"model: {{source: hf, path: {tiny_llama}}}\ntarget: {{onnx_graph: optimum}}\n" + SPECULATIVE,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert (
        "runtime.speculative: needs the fused graph" in problem and "onnx_graph is optimum (set it to auto" in problem
    )


def test_the_onnxruntime_target_passes_the_setting_to_run_and_to_the_triton_model(tmp_path, tiny_llama, engine):
    from pipeline.targets.onnxruntime.adapter import OnnxRuntimeTarget
    from pipeline.targets.onnxruntime.runtime import speculative

    cfg = load_config(write_config(tmp_path / "ort.yaml", f"model: {{source: hf, path: {tiny_llama}}}\n" + SPECULATIVE))
    want = NGram(max_draft_len=5, max_matching_ngram_size=3)
    runner = OnnxRuntimeTarget().load_runner(engine, num_threads=1, runtime=cfg.runtime, thread_spinning=False)
    assert runner.speculative == want
    parameters = speculative.to_parameters(speculative.from_config(cfg.runtime.speculative))
    assert speculative.from_parameters({name: str(value) for name, value in parameters.items()}) == want
    assert speculative.from_parameters({}) is None  # a repository written without the setting
