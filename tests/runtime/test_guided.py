"""Guided decoding in the CPU runtime: every constrained output parses and validates, on the real SmolLM2 engine and
on a random-weight model with SmolLM2's vocabulary (which, unguided, never writes JSON at all), in batches, with and
without n-gram speculation; unconstrained rows beside guided ones keep exactly their own tokens."""

from __future__ import annotations

import functools
import json
import random
import re
import shutil
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from pipeline.targets.onnxruntime.runtime import guided as guided_module
from pipeline.targets.onnxruntime.runtime import scheduler as scheduler_module
from pipeline.targets.onnxruntime.runtime.guided import Grammars, Guide
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.scheduler import Scheduler
from pipeline.targets.onnxruntime.runtime.speculative import NGram
from tests.conftest import run_cli, slow_fixture, write_config
from tests.runtime.conftest import MAX_SEQ_LEN
from tests.runtime.test_scheduler import NO_END, Recorder, generate_alone, inputs, prompt

# Ten schemas a client might send, each bounding its strings and arrays so that a random model ends them too.
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "ok": {"type": "boolean"}},
     "required": ["city", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"cents": {"type": "integer", "minimum": 0, "maximum": 99999},
     "currency": {"const": "EUR"}}, "required": ["cents", "currency"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
                "additionalProperties": False}, {"type": "null"}]},
    {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]}, "note": {"type": ["string", "null"],
     "maxLength": 8}}, "required": ["day", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object",
     "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"],
     "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
]  # fmt: skip
MAX_TOKENS = 120  # room for the longest instance of any schema above
# No finite instance: "a" is required and is again such an object (issue #45's example).
ENDLESS_SCHEMA = '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}'
# 5,000 alternatives of 12 grammar symbols each (0.4 MB): past the 50,000 symbols of `guided.LIMITS`.
TOO_BIG_SCHEMA = json.dumps({"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                        "required": [f"p{i}"]} for i in range(5000)]})  # fmt: skip


def guided(kind: str, text: str = "") -> dict[str, np.ndarray]:
    return {
        "guided_decoding_guide_type": np.array([[kind.encode()]], dtype=object),
        "guided_decoding_guide": np.array([[text.encode()]], dtype=object),
    }


def run(runner: ModelRunner, jobs: list[dict], **scheduling) -> list[Recorder]:
    """Submit every job at once and step until all are answered (in-flight batching up to max_batch_size)."""
    scheduler = Scheduler(runner, **scheduling)
    recorders = [Recorder() for _ in jobs]
    for job, recorder in zip(jobs, recorders):
        scheduler.submit(job, recorder)
    while not all(r.finals() for r in recorders):
        scheduler.step()
    run.counters = scheduler.counters  # the last run's, for the tests that check what the scheduler did
    return recorders


@functools.cache
def tokenizer_of(engine_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_dir)


def text_of(runner: ModelRunner, tokens: list[int]) -> str:
    return tokenizer_of(runner.engine_dir).decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@slow_fixture(scope="module")
def random_model(tmp_path_factory, smollm2_build) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (the import's tokenizer.json as is), built by the CLI."""
    import torch
    import transformers

    work = tmp_path_factory.mktemp("random-smollm2-vocab")
    hf = work / "hf"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).eval().save_pretrained(hf, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_build / "import" / name, hf / name)
    yaml = write_config(
        work / "random.yaml",
        f"""
        model: {{source: hf, path: {hf}}}
        target: {{onnx_graph: fused}}
        build: {{max_batch_size: 8, max_input_len: 32, max_seq_len: 160, max_num_tokens: 16}}
        runtime: {{enable_chunked_context: true}}
        """,
    )
    result = run_cli("build", str(yaml), "--output", str(work / "out"), "--until", "engine")
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out" / "engine"


@pytest.mark.parametrize(
    "speculative", [None, NGram(max_draft_len=4, max_matching_ngram_size=2)], ids=["plain", "ngram"]
)
def test_two_hundred_seeded_requests_over_ten_schemas_all_validate(random_model, speculative):
    """Batches of up to 8 and single rows, greedy and sampled, prompts prefilled in pieces of 16 tokens between decode
    steps and half of them reusing a cached prefix: every output parses and validates against its schema. Unguided,
    this model's greedy output is not JSON for any of the prompts."""
    runner = ModelRunner.from_dir(random_model, num_threads=2, speculative=speculative)
    picks = random.Random(31)
    shared = [picks.randrange(3, 49152) for _ in range(16)]
    jobs, schemas = [], []
    for index in range(200):
        schema = SCHEMAS[index % len(SCHEMAS)]
        prompt = [picks.randrange(3, 49152) for _ in range(picks.randrange(2, 24))]
        prompt = [*shared, *prompt][:31] if index % 2 else prompt
        sampled = index % 2 == 1  # greedy rows draft under speculation; sampled rows do not
        sampling = {"temperature": 1.0, "runtime_top_k": 0, "random_seed": index} if sampled else {}
        jobs.append(inputs([prompt], MAX_TOKENS, **sampling) | guided("json_schema", json.dumps(schema)))
        schemas.append(schema)
    scheduling = {"chunked_context": True, "kv_cache_reuse": True, "tokens_per_block": 8}
    batched, single = run(runner, jobs[:180], **scheduling), []
    assert run.counters["prefill_chunks_total"] > 180 and run.counters["prefix_cache_hit_blocks_total"] > 0
    for job in jobs[180:]:  # one at a time: batch size 1
        single += run(runner, [job], **scheduling)
    for recorder, schema in zip(batched + single, schemas):
        assert not recorder.errors(), recorder.errors()
        jsonschema.validate(json.loads(text_of(runner, recorder.tokens())), schema)
    unguided = run(runner, [{k: v for k, v in job.items() if not k.startswith("guided")} for job in jobs[:10:2]])
    for recorder in unguided:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text_of(runner, recorder.tokens()))


@pytest.fixture(scope="module")
def smollm2(smollm2_build) -> ModelRunner:
    # batch_invariant: an unguided row's tokens may then be compared with those it gets alone (int8 activations give
    # a lone row other bits than rows taken in pairs; pipeline.targets.onnxruntime.runtime.kv_layouts)
    return ModelRunner.from_dir(smollm2_build / "engine", num_threads=2, batch_invariant=True)


def chat(runner: ModelRunner, question: str) -> list[int]:
    tokenizer = tokenizer_of(runner.engine_dir)
    messages = [{"role": "user", "content": question}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_a_mixed_batch_guides_its_guided_rows_and_leaves_the_others_their_own_tokens(smollm2):
    """The real model: a schema, any JSON object, a regex and a grammar in one batch with two unguided rows, whose
    tokens equal those they get alone."""
    person = SCHEMAS[0]
    free = [chat(smollm2, "Tell me about Paris in one sentence."), chat(smollm2, "Name a colour.")]
    ask = chat(smollm2, "Describe a person as JSON with a name and an age.")
    jobs = [
        inputs([ask], 60) | guided("json_schema", json.dumps(person)),
        inputs([free[0]], 40),
        inputs([ask], 60) | guided("json"),
        inputs([chat(smollm2, "Is the sky blue? Answer yes or no and why.")], 40)
        | guided("regex", r"(yes|no), because [a-z ,]{1,60}\."),
        inputs([free[1]], 40),
        inputs([chat(smollm2, "What colour is grass?")], 20)
        | guided("ebnf_grammar", 'root ::= "The answer is " colour "."\ncolour ::= "red" | "green" | "blue"'),
    ]
    recorders = run(smollm2, jobs)
    answers = [text_of(smollm2, r.tokens()) for r in recorders]
    jsonschema.validate(json.loads(answers[0]), person)
    assert isinstance(json.loads(answers[2]), dict)
    assert re.fullmatch(r"(yes|no), because [a-z ,]{1,60}\.", answers[3]), answers[3]
    assert answers[5] in {"The answer is red.", "The answer is green.", "The answer is blue."}
    alone = [run(smollm2, [inputs([prompt], 40)])[0].tokens() for prompt in free]
    assert [recorders[i].tokens() for i in (1, 4)] == alone


@pytest.mark.parametrize(
    "named, error",
    [
        ({"guided_decoding_guide_type": "yaml", "guided_decoding_guide": "a: 1"}, "'yaml' is not one of"),
        ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{not json"}, "not valid JSON"),
        ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": ""}, "needs its guided_decoding_guide"),
        (  # a schema keyword the grammar cannot enforce is named, never dropped
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"not": {"type": "string"}}'},
            'Unimplemented keys: ["not"]',
        ),
        ({"guided_decoding_guide": "[0-9]+"}, "without guided_decoding_guide_type"),
        (
            {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "(unclosed"},
            "guided_decoding_guide (regex)",
        ),
        ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "root ::= ("}, "does not parse"),
        (
            {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": ENDLESS_SCHEMA},
            "the output the guide forces is longer than max_seq_len",
        ),
        ({"guided_decoding_guide_type": "json", "min_length": 5}, "min_length with guided decoding"),
        ({"guided_decoding_guide_type": "json", "end_id": 7}, "end_id 7 with guided decoding"),
    ],
)
def test_a_guide_the_engine_cannot_follow_is_refused_naming_it(smollm2, named, error):
    prompt = chat(smollm2, "Hello")
    sent = {name: np.array([[value.encode() if isinstance(value, str) else value]]) for name, value in named.items()}
    recorder = run(smollm2, [inputs([prompt], 8) | sent])[0]
    assert len(recorder.errors()) == 1 and error in recorder.errors()[0], recorder.events


def test_bench_profile_times_decode_steps_with_a_schema_on_every_row(random_model):
    """What `bench profile` reports for guided decoding: every row masked on every step, none ended early (it
    raises then), on an engine whose vocabulary writes JSON."""
    from pipeline.bench.profile import guided_cost

    cost = guided_cost(random_model, threads=2, batch=2, input_len=8, output_len=12, spinning=False)
    assert cost["batch"] == 2 and cost["plain_step_ms"] > 0 and cost["guided_step_ms"] > 0


def test_a_guided_row_keeps_its_tokens_in_any_batch_of_a_batch_invariant_engine(smollm2_build):
    """runtime.batch_invariant holds with guides: each guided row's tokens alone equal its tokens beside others."""
    runner = ModelRunner.from_dir(smollm2_build / "engine", num_threads=2, batch_invariant=True)
    asks = ["Describe a person as JSON.", "Invent a person.", "Who wrote Hamlet? Reply in JSON."]
    guided_jobs = [inputs([chat(runner, ask)], 40) | guided("json_schema", json.dumps(SCHEMAS[0])) for ask in asks]
    together = run(runner, [*guided_jobs, inputs([chat(runner, "Name a colour.")], 40)])
    alone = [run(runner, [job])[0].tokens() for job in guided_jobs]
    assert [recorder.tokens() for recorder in together[:3]] == alone


# ---------------------------------------------------------------- compiling off the decode loop


def byte_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json of printable ASCII, one token a character (ids 3-97 after <unk>, <s>, </s>):
    llguidance reads it, not the tiny engines' word-level one, and its ids fit their vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(0x20, 0x7F):
        vocab[byte_level.pre_tokenize_str(chr(byte))[0][0]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = byte_level, decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def ascii_text(tokens: list[int]) -> str:
    return "".join(chr(token - 3 + 0x20) for token in tokens)


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def held_compiles(runner, tmp_path, monkeypatch):
    """The tiny engine with its guides on a byte-level tokenizer, every compile held until the gate returned opens:
    a compile as long as the test needs, on any machine."""
    grammars = Grammars(byte_tokenizer(tmp_path), runner.end_id, runner.vocab_size_padded, runner.max_seq_len)
    monkeypatch.setitem(runner.__dict__, "grammars", grammars)
    gate, compile_text = threading.Event(), guided_module.grammar
    monkeypatch.setattr(guided_module, "grammar", lambda guide: gate.wait(60) and compile_text(guide))
    yield gate
    gate.set()


def test_a_guide_compiling_holds_up_no_other_request(runner, held_compiles):
    """Issue #45: a request submitted right after a new guide (as Triton's `execute` takes them, one after the other)
    decodes every one of its tokens while that guide still compiles; the guided request follows once it is ready."""
    scheduler = Scheduler(runner)
    scheduler.start()
    waiting, other = Recorder(), Recorder()
    try:
        scheduler.submit(inputs([prompt(5)], 8) | guided("regex", "(yes|no)"), waiting)
        scheduler.submit(inputs([prompt(6, 1)], 24, end_id=NO_END, streaming=True), other)
        wait_for(other.finals)
        assert not held_compiles.is_set() and not waiting.events and len(scheduler.compiling) == 1
        assert other.tokens() == generate_alone(runner, prompt(6, 1), 24) and len(other.events) == 24
        held_compiles.set()
        wait_for(waiting.finals)
        assert not waiting.errors() and ascii_text(waiting.tokens()) in {"yes", "no"}, waiting.events
        wait_for(lambda: scheduler.idle)
    finally:
        held_compiles.set()
        scheduler.close()


def test_a_request_waiting_for_its_guide_stops_at_once_or_ends_cancelled_when_it_is_ready(runner, held_compiles):
    scheduler = Scheduler(runner)
    scheduler.start()
    stopped, cancelled = Recorder(), Recorder()
    job = inputs([prompt(5)], 8) | guided("regex", "[a-z]{3}")
    scheduler.submit(job, stopped, request_id="stopped")
    scheduler.submit(job, cancelled, request_id="cancelled", is_cancelled=lambda: True)
    scheduler.stop("stopped")
    assert stopped.events == [("final",)] and not cancelled.events and not scheduler.idle
    held_compiles.set()
    wait_for(lambda: scheduler.idle)
    assert stopped.events == [("final",)] and cancelled.events == [("final",)]
    scheduler.close()
    assert "inflight-batching" not in [thread.name for thread in threading.enumerate()]


def test_a_guide_not_compiled_within_the_bound_fails_naming_it_and_its_compile_is_kept(
    runner, held_compiles, monkeypatch
):
    monkeypatch.setattr(scheduler_module, "COMPILE_SECONDS", 0.2)
    scheduler = Scheduler(runner)
    scheduler.start()
    job, late, again = inputs([prompt(5)], 8) | guided("regex", "(yes|no)"), Recorder(), Recorder()
    try:
        scheduler.submit(job, late)
        wait_for(late.finals)
        assert late.errors() == [
            "guided_decoding_guide (regex): did not compile within 0.2 s; simplify it, or send it again later (its "
            "compile goes on, and the compiled guide is kept)"
        ]
        held_compiles.set()
        wait_for(runner.grammars.compile(Guide("regex", "(yes|no)")).done)
        scheduler.submit(job, again)
        wait_for(again.finals)
        assert not again.errors() and ascii_text(again.tokens()) in {"yes", "no"}, again.events
    finally:
        scheduler.close()


@pytest.mark.parametrize(
    "guide, error",
    [
        (
            Guide("json_schema", ENDLESS_SCHEMA),
            f"guided_decoding_guide (json_schema): the output the guide forces is longer than max_seq_len "
            f"{MAX_SEQ_LEN} (a guide with no finite instance, such as a required property that refers back to its "
            "own object, forces one without end); let its recursion end, e.g. make that property optional",
        ),
        (  # past the bound on a compile's work (`guided.LIMITS`)
            Guide("json_schema", TOO_BIG_SCHEMA),
            "guided_decoding_guide (json_schema): grammar size (number of symbols) too big (limit for this grammar: "
            "50000)",
        ),
        (  # llguidance's own error, on one line
            Guide("regex", "(unclosed"),
            'guided_decoding_guide (regex): at 1(8): invalid regex "(unclosed" (in regex): regex parse error: '
            "(unclosed ^ error: unclosed group 1 | start: /(unclosed/ ^",
        ),
    ],
)
def test_a_guide_that_cannot_compile_is_refused_in_one_line_without_the_parser_state(tmp_path, guide, error):
    """Issue #45: the endless schema's 400 carried 893 characters of llguidance's parser state, and only after its
    first token; it is refused when its guide compiles, saying why."""
    grammars = Grammars(byte_tokenizer(tmp_path), end_id=2, vocab_size=253, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError) as refused:
        grammars.matcher(guide)
    assert str(refused.value) == error
