"""The in-flight batching scheduler, driven step by step (and on its thread) on a real fp32 engine built by the CLI."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import numpy as np
import pytest

from pipeline.targets.onnxruntime.runtime.jobs import parse_job
from pipeline.targets.onnxruntime.runtime.kv_cache import BlockManager
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.scheduler import Scheduler
from tests.runtime.conftest import MAX_BATCH_SIZE, MAX_INPUT_LEN, MAX_NUM_TOKENS, MAX_SEQ_LEN

NO_END = -1  # an end_id no token equals: outputs run to max_tokens


class Recorder:
    """A Responder keeping every answer, as the Triton model would send them."""

    def __init__(self):
        self.events: list[tuple] = []

    def send_tokens(self, row, tokens, log_probs, cum_log_prob, final):
        self.events.append(("tokens", row, list(tokens), final))

    def send_error(self, message):
        self.events.append(("error", message))

    def send_final(self):
        self.events.append(("final",))

    def finals(self) -> int:
        return sum(event[0] != "tokens" or event[3] for event in self.events)

    def tokens(self, row: int = 0) -> list[int]:
        """Row `row`'s tokens, concatenated over its responses."""
        return [t for event in self.events if event[0] == "tokens" and event[1] == row for t in event[2]]

    def errors(self) -> list[str]:
        return [event[1] for event in self.events if event[0] == "error"]


def inputs(prompts: list[list[int]], max_tokens: int, **named) -> dict[str, np.ndarray]:
    """Triton-style named inputs: input_ids right-padded [rows, width], the others [rows, 1] (or one value)."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    out = {
        "input_ids": ids,
        "input_lengths": np.array([[len(p)] for p in prompts], dtype=np.int32),
        "request_output_len": np.full((len(prompts), 1), max_tokens, dtype=np.int32),
    }
    return out | {name: np.array([[value]]) for name, value in named.items()}


def prompt(length: int, offset: int = 0) -> list[int]:
    return [3 + (7 * i + offset) % 240 for i in range(length)]


def assert_within_kv_budget(scheduler: Scheduler) -> None:
    """The KV-cache blocks held now are exactly those of the running and prefilling rows, within the pool."""
    rows = [*(scheduler.batch.requests if scheduler.batch else []), *(r for r, _ in scheduler.prefilling)]
    assert scheduler.gauges["kv_cache_blocks_used"] == sum(scheduler.kv.blocks_for(r) for r in rows)
    assert (
        scheduler.gauges["kv_cache_blocks_used"] + scheduler.gauges["kv_cache_blocks_free"] == scheduler.kv.num_blocks
    )


def run_to_idle(scheduler: Scheduler) -> None:
    while not scheduler.idle:
        scheduler.step()
        assert_within_kv_budget(scheduler)


def generate_alone(runner: ModelRunner, ids: list[int], max_tokens: int) -> list[int]:
    return runner.generate([ids], max_new_tokens=max_tokens, end_id=NO_END)[
        0, 0, len(ids) : len(ids) + max_tokens
    ].tolist()


def idle_gauges(scheduler: Scheduler) -> dict[str, float]:
    free = scheduler.kv.num_blocks
    return {"active_rows": 0, "kv_cache_blocks_used": 0, "kv_cache_blocks_free": free, "queued_requests": 0}


def assert_nothing_left(scheduler: Scheduler) -> None:
    assert scheduler.idle and not scheduler.jobs and scheduler.batch is None and not scheduler.prefilling
    assert scheduler.gauges == idle_gauges(scheduler)


class FlakyRunner:
    """A real runner whose engine calls (prefill, prefill_chunk, advance, counted together from 1) raise on
    chosen calls; it notes which jobs the scheduler held at each failure."""

    def __init__(self, runner: ModelRunner, failing_calls: set[int]):
        self.runner, self.failing_calls, self.calls = runner, failing_calls, 0
        self.held_jobs = lambda: set()  # set by the test: ids of the jobs the scheduler holds
        self.held_at_failures: list[set[int]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _engine_call(self, name: str) -> None:
        self.calls += 1
        if self.calls in self.failing_calls:
            self.held_at_failures.append(self.held_jobs())
            raise RuntimeError(f"injected {name} failure")

    def prefill(self, requests):
        self._engine_call("prefill")
        return self.runner.prefill(requests)

    def prefill_chunk(self, partial, request, budget):
        self._engine_call("prefill_chunk")
        return self.runner.prefill_chunk(partial, request, budget)

    def advance(self, batch):  # the scheduler's decode step (speculative when configured)
        self._engine_call("decode_step")
        return self.runner.advance(batch)


# ---------------------------------------------------------------- many random requests


@pytest.mark.parametrize("chunked_context", [False, True], ids=["whole-prefill", "chunked-context"])
def test_a_thousand_random_requests_are_each_answered_once_and_nothing_leaks(runner, chunked_context):
    rng = np.random.default_rng(20240611 + chunked_context)
    flaky = FlakyRunner(runner, failing_calls={100, 500, 900, 1200})

    def ends_mid_character(tokens):  # pretend some tokens end inside a UTF-8 character: streaming holds them back
        return tokens[-1] % 5 == 0

    scheduler = Scheduler(
        flaky, kv_budget=160, tokens_per_block=4, chunked_context=chunked_context, ends_mid_character=ends_mid_character
    )
    flaky.held_jobs = lambda: {id(job) for job in scheduler.jobs.values()}
    clock = {"step": 0}
    submitted: list[tuple[str, Recorder, object]] = []  # (kind, recorder, job or None)
    stops: dict[int, list[str]] = {}  # step -> request ids stopped then
    invalid = {
        "empty": ([[]], "input 0 is empty"),
        "too long": ([prompt(MAX_INPUT_LEN + 3)], "max_input_len"),
        "bad token": ([[5, runner.vocab_size + 2]], "outside the vocabulary"),
        "negative token": ([[-4, 5]], "outside the vocabulary"),
    }

    def submit_random(index: int) -> None:
        recorder, kind = Recorder(), rng.choice(["valid"] * 90 + ["invalid"] * 6 + ["cancel"] * 4 + ["stop"] * 4)
        if kind == "invalid":
            name = rng.choice([*invalid, "beam width 2"])
            prompts, expected = invalid.get(name, ([prompt(4)], "beam width 2 is not supported"))
            job = scheduler.submit(inputs(prompts, 4, beam_width=2 if name == "beam width 2" else 1), recorder)
            assert (
                job is None
                and recorder.events == [("error", recorder.errors()[0])]
                and expected in recorder.errors()[0]
            )
            submitted.append(("invalid", recorder, None))
            return
        rows = int(rng.choice([1] * 8 + [2, 3]))
        prompts = [prompt(int(rng.integers(1, 41)), int(rng.integers(0, 240))) for _ in range(rows)]
        named = {"streaming": bool(rng.random() < 0.5), "exclude_input_in_output": bool(rng.random() < 0.8)}
        if rng.random() < 0.3:  # seeded sampling instead of greedy
            named |= {
                "temperature": 1.3,
                "runtime_top_k": 20,
                "runtime_top_p": 0.9,
                "random_seed": int(rng.integers(1 << 30)),
            }
        cancel_step = clock["step"] + int(rng.integers(0, 8))
        is_cancelled = (lambda: clock["step"] >= cancel_step) if kind == "cancel" else (lambda: False)
        job = scheduler.submit(
            inputs(prompts, int(rng.integers(1, 9)), **named),
            recorder,
            request_id=f"r{index}",
            is_cancelled=is_cancelled,
        )
        assert job is not None, recorder.events
        if kind == "stop":
            stops.setdefault(cancel_step, []).append(f"r{index}")
        submitted.append((kind, recorder, job))

    started, steps_waiting_for_kv_budget = time.perf_counter(), 0
    while len(submitted) < 1000 or not scheduler.idle:
        for _ in range(int(rng.integers(0, 4)) if len(submitted) < 1000 else 0):
            submit_random(len(submitted))
        for request_id in stops.pop(clock["step"], []):
            scheduler.stop(request_id)
        scheduler.step()
        clock["step"] += 1
        assert_within_kv_budget(scheduler)
        rows = (len(scheduler.batch) if scheduler.batch else 0) + len(scheduler.prefilling)
        assert rows <= MAX_BATCH_SIZE
        steps_waiting_for_kv_budget += bool(scheduler.queue) and rows + len(scheduler.queue[0].rows) <= MAX_BATCH_SIZE
    elapsed = time.perf_counter() - started

    assert_nothing_left(scheduler)
    assert len(flaky.held_at_failures) == 4 and all(flaky.held_at_failures), "every injected failure hit held jobs"
    failed_by_injection = {
        id(job) for kind, recorder, job in submitted if any("injected" in e for e in recorder.errors())
    }
    assert failed_by_injection == set().union(*flaky.held_at_failures)  # exactly the jobs held, one error each
    rows_sampled = first_tokens = 0
    for kind, recorder, job in submitted:
        assert recorder.finals() == 1 and (recorder.events[-1][0] != "tokens" or recorder.events[-1][3]), (
            recorder.events
        )
        if job is None:
            continue
        rows_sampled += sum(len(r.output) for r in job.rows)
        first_tokens += sum(len(r.output) + (r.finish_reason == "end_id") > 0 for r in job.rows)
        if id(job) in failed_by_injection:
            assert len(recorder.errors()) == 1
            continue
        assert not recorder.errors()
        for row, request in enumerate(job.rows):
            if request.finish_reason in (None, "cancelled"):  # cancelled or stopped, queued or running
                assert kind != "valid"
            else:
                whole = request.output if job.streaming or job.exclude_input else request.prompt + request.output
                assert recorder.tokens(row) == whole
    assert scheduler.counters["generated_tokens_total"] == rows_sampled
    assert scheduler.counters["first_tokens_total"] == first_tokens
    assert sum(kind == "invalid" for kind, _, _ in submitted) > 30 and steps_waiting_for_kv_budget > 50
    print(f"1000 requests, {clock['step']} steps, {rows_sampled} tokens in {elapsed:.1f}s")


# ---------------------------------------------------------------- outputs


def test_greedy_in_a_busy_batch_equals_generate_alone_and_streams_concatenate_to_the_whole(runner):
    held_back = Counter()

    def ends_mid_character(tokens):  # pretend tokens ending in an even id end inside a UTF-8 character
        held_back[tokens[-1] % 2 == 0] += 1
        return tokens[-1] % 2 == 0

    scheduler = Scheduler(runner, ends_mid_character=ends_mid_character)
    target = prompt(23, 5)
    whole, streamed = Recorder(), Recorder()
    scheduler.submit(inputs([prompt(7, 1)], 20, end_id=NO_END), Recorder())
    scheduler.submit(inputs([prompt(40, 2), prompt(3, 9)], 6, end_id=NO_END), Recorder())
    scheduler.step()
    scheduler.step()
    scheduler.submit(inputs([target], 12, end_id=NO_END, exclude_input_in_output=False), whole)  # joins a running batch
    scheduler.submit(inputs([target], 12, end_id=NO_END, streaming=True), streamed)
    scheduler.step()
    scheduler.submit(inputs([prompt(11, 3)], 9, end_id=NO_END), Recorder())
    run_to_idle(scheduler)

    expected = generate_alone(runner, target, 12)
    assert whole.events == [("tokens", 0, target + expected, True)]
    assert streamed.tokens() == expected and streamed.finals() == 1
    assert held_back[True] and len([e for e in streamed.events if e[2]]) < len(expected)  # held-back tokens came later
    assert_nothing_left(scheduler)


def test_chunked_context_prefills_in_pieces_between_decode_steps_and_gives_the_same_tokens(runner):
    long_prompt, short_prompt = prompt(60, 4), prompt(5, 8)
    results = {}
    for chunked in (False, True):
        scheduler = Scheduler(runner, chunked_context=chunked)
        short, long = Recorder(), Recorder()
        scheduler.submit(inputs([short_prompt], 20, end_id=NO_END, streaming=True), short)
        scheduler.step()
        scheduler.submit(inputs([long_prompt], 6, end_id=NO_END), long)
        steps_prefilling = 0
        for _ in range(6):
            before = len(short.tokens())
            scheduler.step()
            steps_prefilling += bool(scheduler.prefilling)
            assert len(short.tokens()) == before + 1  # the running stream never stalls
        run_to_idle(scheduler)
        results[chunked] = short.tokens(), long.tokens()
        if chunked:  # 60 tokens, at most max_num_tokens - 1 running row per step
            assert steps_prefilling >= 3 and scheduler.counters["prefill_chunks_total"] >= 60 // (MAX_NUM_TOKENS - 1)
        else:
            assert steps_prefilling == 0 and scheduler.counters["prefill_chunks_total"] == 0
    assert (
        results[True]
        == results[False]
        == (generate_alone(runner, short_prompt, 20), generate_alone(runner, long_prompt, 6))
    )


# ---------------------------------------------------------------- admission


def test_admission_is_fifo_a_large_job_at_the_head_blocks_later_ones_within_the_kv_budget(runner):
    scheduler = Scheduler(runner, kv_budget=100, tokens_per_block=4)
    running, large, small = Recorder(), Recorder(), Recorder()
    scheduler.submit(inputs([prompt(10)], 30, end_id=NO_END, streaming=True), running)  # 10 blocks of 25
    scheduler.step()
    large_job = scheduler.submit(inputs([prompt(30, 1)], 40, end_id=NO_END, streaming=True), large)  # 18: not beside it
    small_job = scheduler.submit(inputs([prompt(5, 2)], 5, end_id=NO_END, streaming=True), small)  # would fit beside it
    first_token_step = {}
    step = 0
    while not scheduler.idle:
        scheduler.step()
        step += 1
        assert_within_kv_budget(scheduler)
        for name, recorder in (("large", large), ("small", small)):
            if recorder.events:
                first_token_step.setdefault(name, step)
        if "large" not in first_token_step:
            assert list(scheduler.queue) == [large_job, small_job]
    # the large one once the first finished (the small one beside it: blocks, not padded rows, are reserved)
    assert first_token_step["small"] == first_token_step["large"] > 20
    assert running.tokens() == generate_alone(runner, prompt(10), 30)
    assert large.tokens() == generate_alone(runner, prompt(30, 1), 40)
    assert_nothing_left(scheduler)


def test_a_failing_step_fails_exactly_the_jobs_it_held_and_the_queue_goes_on(runner):
    flaky = FlakyRunner(runner, failing_calls={3})  # prefill, decode_step, then the second decode_step raises
    scheduler = Scheduler(flaky, kv_budget=40, tokens_per_block=4)
    held = [Recorder(), Recorder()]
    for offset, recorder in enumerate(held):
        scheduler.submit(inputs([prompt(10, offset)], 10, end_id=NO_END, streaming=bool(offset)), recorder)
    waiting = Recorder()
    scheduler.submit(inputs([prompt(12, 7)], 8, end_id=NO_END), waiting)  # no room in the budget beside them
    run_to_idle(scheduler)
    assert [r.errors() for r in held] == [["injected decode_step failure"]] * 2
    assert [r.finals() for r in held] == [1, 1]
    assert waiting.events == [("tokens", 0, generate_alone(runner, prompt(12, 7), 8), True)]
    assert_nothing_left(scheduler)


def test_cancelled_and_stopped_jobs_end_with_one_empty_final_whether_queued_or_running(runner):
    scheduler = Scheduler(runner, kv_budget=60, tokens_per_block=4)
    cancelled = {"running": False, "queued": False}
    answers = {name: Recorder() for name in ("cancel running", "stop running", "cancel queued", "stop queued")}
    scheduler.submit(
        inputs([prompt(5)], 20, end_id=NO_END, streaming=True),
        answers["cancel running"],
        is_cancelled=lambda: cancelled["running"],
    )
    scheduler.submit(inputs([prompt(5, 1)], 20, end_id=NO_END), answers["stop running"], request_id="a")
    scheduler.submit(
        inputs([prompt(30, 2)], 20, end_id=NO_END), answers["cancel queued"], is_cancelled=lambda: cancelled["queued"]
    )
    scheduler.submit(inputs([prompt(30, 3)], 20, end_id=NO_END), answers["stop queued"], request_id="b")
    for _ in range(3):
        scheduler.step()
    assert len(scheduler.queue) == 2 and len(scheduler.batch) == 2
    cancelled["running"] = cancelled["queued"] = True
    scheduler.stop("a")
    scheduler.stop("b")
    scheduler.stop("")  # no id: stops nothing
    run_to_idle(scheduler)
    assert answers["cancel running"].events[-1] == ("final",) and len(answers["cancel running"].tokens()) == 3
    assert [recorder.events for name, recorder in answers.items() if name != "cancel running"] == [[("final",)]] * 3
    assert_nothing_left(scheduler)


def test_metrics_reach_the_callback_under_the_same_names(runner):
    seen_counters, seen_gauges = Counter(), {}

    def on_metrics(increments, levels):
        seen_counters.update(increments)
        seen_gauges.update(levels)

    scheduler = Scheduler(runner, chunked_context=True, on_metrics=on_metrics)
    scheduler.submit(inputs([prompt(40), prompt(3, 1)], 5, end_id=NO_END), Recorder())
    scheduler.step()  # the first piece of the long prompt; the short one waits behind it
    assert seen_gauges["active_rows"] == 0 and seen_counters["prefill_chunks_total"] == 1
    run_to_idle(scheduler)
    assert dict(seen_counters) == {name: value for name, value in scheduler.counters.items() if value}
    assert scheduler.counters["generated_tokens_total"] == 10 and scheduler.counters["first_tokens_total"] == 2
    assert scheduler.counters["prefill_chunks_total"] == 4  # 16 + 16 + 8 of the long prompt, then the short one
    assert scheduler.counters["time_to_first_token_us_total"] > 0
    assert seen_gauges == scheduler.gauges == idle_gauges(scheduler)


def test_on_its_thread_it_answers_concurrent_submissions_and_closes(runner):
    scheduler = Scheduler(runner)
    scheduler.start()
    answers = [Recorder() for _ in range(12)]

    def client(offset: int) -> None:
        for index in range(offset, len(answers), 3):
            scheduler.submit(
                inputs([prompt(4 + index, index)], 6, end_id=NO_END, streaming=index % 2 == 0), answers[index]
            )

    clients = [threading.Thread(target=client, args=(offset,)) for offset in range(3)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    deadline = time.monotonic() + 60
    while not all(recorder.finals() for recorder in answers) and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.close()
    assert "inflight-batching" not in [thread.name for thread in threading.enumerate()]
    for index, recorder in enumerate(answers):
        assert recorder.finals() == 1 and recorder.tokens() == generate_alone(runner, prompt(4 + index, index), 6)
    assert_nothing_left(scheduler)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("prompts", "max_tokens", "beam_width", "message"),
    [
        ([[]], 4, 1, "input 0 is empty"),
        ([prompt(MAX_INPUT_LEN + 1)], 4, 1, f"exceeds the engine's max_input_len {MAX_INPUT_LEN}"),
        ([prompt(4), [5, 300]], 4, 1, "input 1 has token ids outside the vocabulary"),
        ([[-1, 5]], 4, 1, "outside the vocabulary"),
        ([prompt(4)], 4, 2, "beam width 2 is not supported"),
        ([prompt(4)], 0, 1, "max_tokens must be at least 1"),
        ([prompt(60)], 100, 1, f"exceed the engine's max_seq_len {MAX_SEQ_LEN}"),
        ([prompt(4)] * (MAX_BATCH_SIZE + 1), 4, 1, f"exceeds max_batch_size {MAX_BATCH_SIZE}"),
    ],
    ids=[
        "empty",
        "too-long",
        "token-beyond-vocab",
        "negative-token",
        "beam-width-2",
        "no-new-tokens",
        "beyond-max-seq-len",
        "too-many-rows",
    ],
)
def test_generate_and_the_scheduler_reject_the_same_inputs_with_the_same_message(
    runner, prompts, max_tokens, beam_width, message
):
    with pytest.raises(ValueError, match=message) as from_generate:
        runner.generate(prompts, max_new_tokens=max_tokens, num_beams=beam_width)
    with pytest.raises(ValueError) as from_parse:
        parse_job(
            inputs(prompts, max_tokens, beam_width=beam_width), runner, Recorder(), kv=BlockManager(10**6, 4, False)
        )
    assert str(from_parse.value) == str(from_generate.value)
    recorder = Recorder()
    assert Scheduler(runner).submit(inputs(prompts, max_tokens, beam_width=beam_width), recorder) is None
    assert recorder.events == [("error", str(from_generate.value))]


@pytest.mark.parametrize(
    ("triton_input", "value", "message"),
    [
        ("temperature", -1.0, "temperature must be >= 0, got -1.0"),
        ("temperature", float("nan"), "temperature must be >= 0, got nan"),
        ("runtime_top_p", 2.0, "top_p must be <= 1, got 2.0"),
        ("runtime_top_k", -5, "top_k must be >= 0, got -5"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
        ("min_length", -3, "min_length must be >= 0, got -3"),
        ("presence_penalty", float("inf"), "presence_penalty must be finite, got inf"),
        ("end_id", -7, "end_id must be -1 (never end) or a token of the vocabulary"),
    ],
)
def test_sampling_settings_tensorrt_llm_rejects_are_rejected_naming_the_setting(runner, triton_input, value, message):
    """The bounds of TensorRT-LLM's SamplingConfig (tabulated from its source), plus finiteness and the vocabulary:
    each answered with one error, never NaN log-probs or a silent default."""
    recorder = Recorder()
    assert Scheduler(runner).submit(inputs([prompt(4)], 4, **{triton_input: value}), recorder) is None
    assert len(recorder.errors()) == 1 and message in recorder.errors()[0]
    generate_name = {"runtime_top_k": "top_k", "runtime_top_p": "top_p"}.get(triton_input, triton_input)
    if generate_name in ("temperature", "top_k", "top_p", "repetition_penalty", "end_id"):
        with pytest.raises(ValueError, match=re.escape(message)):
            runner.generate([prompt(4)], max_new_tokens=4, **{generate_name: value})


def test_sampling_bounds_are_the_tabulated_upstream_ones_and_top_p_zero_means_unset(runner):
    from pipeline.targets.onnxruntime.runtime.sampling import SAMPLING_CHECKS

    assert SAMPLING_CHECKS["TopP"] == [[">", 0], ["<=", 1]] and SAMPLING_CHECKS["Temperature"] == [[">=", 0]]
    for top_p in (0.0, -1.0, 1.0):  # tensorrtllm_backend resets top_p <= 0 to "no top-p"
        runner.generate([prompt(4)], max_new_tokens=2, top_p=top_p, top_k=0)


def test_the_scheduler_alone_rejects_jobs_that_could_never_fit_the_kv_budget(runner):
    scheduler = Scheduler(runner, kv_budget=50, tokens_per_block=4)  # 12 blocks
    for prompts, max_tokens, blocks in (([prompt(30)], 30, 15), ([prompt(20), prompt(21, 1)], 10, 8 + 8)):
        runner.generate(prompts, max_new_tokens=max_tokens)  # the engine itself can run them
        recorder = Recorder()
        assert scheduler.submit(inputs(prompts, max_tokens), recorder) is None
        assert recorder.errors() == [
            f"needs {blocks} KV-cache blocks of 4 tokens (per row: prompt + max_tokens), more than the 12 of "
            "max_tokens_in_paged_kv_cache 48"
        ]
    assert scheduler.idle
