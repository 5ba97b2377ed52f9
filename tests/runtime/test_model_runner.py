"""The CPU ModelRunner against transformers, on an fp32 engine built by the real pipeline from a tiny Llama."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.targets.onnxruntime.runtime.sampling import to_words_list
from tests.conftest import REPO, run_cli, slow_fixture, write_config

PROMPTS = ["w1 w5 w9 w33", "w7", "w100 w2 w3 w4 w5 w6 w7 w8 w9", "w42 w43"]


@slow_fixture(scope="module", params=["fused", "optimum"])
def tiny_engine(request, tmp_path_factory, tiny_llama):
    """Both graph layouts: the fused one (SharedCache) and optimum-onnx's (ConcatCache)."""
    work = tmp_path_factory.mktemp(f"tiny-engine-{request.param}")
    config = write_config(
        work / "tiny.yaml",
        f"model:\n  source: hf\n  path: {tiny_llama}\ntarget:\n  onnx_graph: {request.param}\n"
        "build:\n  max_batch_size: 4\n  max_input_len: 64\n  max_seq_len: 128\n  max_num_tokens: 64\n",
    )
    result = run_cli("build", str(config), "--output", str(work / "out"), "--until", "engine")
    assert result.returncode == 0, result.stdout + result.stderr
    return work / "out" / "engine"


@pytest.fixture(scope="module")
def runner(tiny_engine):
    return ModelRunner.from_dir(tiny_engine, num_threads=1)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        tiny_llama
    )


def encode(tokenizer, prompts):
    return [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        out = model.generate(
            ids[None],
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids[None]),
        )
    return out[0].tolist()


def test_greedy_equals_transformers_alone_and_in_a_ragged_batch(runner, hf):
    model, tokenizer = hf
    ids = encode(tokenizer, PROMPTS)
    expected = [hf_greedy(model, i, 12) for i in ids]
    for single, want in zip(ids, expected):
        row = runner.generate([single], max_new_tokens=12, end_id=-1)[0, 0].tolist()
        assert row[: len(want)] == want and set(row[len(want) :]) == {-1}  # padded with end_id to max_seq_len
    out = runner.generate(ids, max_new_tokens=12, end_id=-1, return_dict=True)
    assert out["output_ids"].shape == (4, 1, runner.max_seq_len)
    for row, want in enumerate(expected):
        assert out["sequence_lengths"][row, 0] == len(want)
        assert out["output_ids"][row, 0, : len(want)].tolist() == want


def test_prompts_beyond_max_num_tokens_together_are_prefilled_in_pieces_and_still_exact(runner, hf):
    model, tokenizer = hf
    prompts = [
        " ".join(f"w{(7 * row + i) % 200}" for i in range(20 + 3 * row)) for row in range(4)
    ]  # 4 x ~25 > 64 tokens
    ids = encode(tokenizer, prompts)
    assert sum(len(i) for i in ids) > runner.max_num_tokens
    out = runner.generate(ids, max_new_tokens=6, end_id=-1, return_dict=True)
    for row, prompt in enumerate(ids):
        want = hf_greedy(model, prompt, 6)
        assert out["output_ids"][row, 0, : len(want)].tolist() == want


@pytest.mark.parametrize("graph", ["fused", "optimum"])
def test_chunked_context_prefills_long_prompts_in_max_num_tokens_pieces_exactly(
    tmp_path, tiny_llama, hf, graph, cli_build
):
    config = write_config(
        tmp_path / "chunked.yaml",
        f"model:\n  source: hf\n  path: {tiny_llama}\ntarget:\n  onnx_graph: {graph}\n"
        "build:\n  max_input_len: 64\n  max_seq_len: 128\n  max_num_tokens: 8\n"
        "runtime:\n  enable_chunked_context: true\n",
    )
    result = cli_build(str(config), "--output", str(tmp_path / "out"), "--until", "engine")
    assert result.returncode == 0, result.stdout + result.stderr
    runner = ModelRunner.from_dir(tmp_path / "out" / "engine", num_threads=1)
    model, tokenizer = hf
    ids = encode(tokenizer, [" ".join(f"w{(3 * i) % 200}" for i in range(30)), "w5 w6 w7"])  # 30 tokens: 4 chunks of 8
    out = runner.generate(ids, max_new_tokens=5, end_id=-1, return_dict=True)
    for row, prompt in enumerate(ids):
        want = hf_greedy(model, prompt, 5)
        assert out["output_ids"][row, 0, : len(want)].tolist() == want


def test_each_row_stops_on_its_own_end_id_and_stop_words(runner, hf):
    _, tokenizer = hf
    ids = encode(tokenizer, PROMPTS[:2])
    free = runner.generate(ids, max_new_tokens=10, end_id=-1, return_dict=True)["output_ids"]
    gen0 = free[0, 0, len(ids[0]) :].tolist()
    end_id = gen0[2]
    out = runner.generate(ids, max_new_tokens=10, end_id=end_id, pad_id=0, return_dict=True)
    for row in range(2):
        generated = free[row, 0, len(ids[row]) : len(ids[row]) + 10].tolist()
        kept = (
            generated.index(end_id) if end_id in generated else 10
        )  # like TensorRT-LLM, end_id is not part of the output
        assert out["sequence_lengths"][row, 0] == len(ids[row]) + kept

    gen1 = free[1, 0, len(ids[1]) : len(ids[1]) + 10].tolist()
    stop_word = gen1[3:5]
    out = runner.generate(ids, max_new_tokens=10, end_id=-1, stop_words_list=[[], [stop_word]], return_dict=True)
    assert out["sequence_lengths"][0, 0] == len(ids[0]) + 10
    assert out["output_ids"][1, 0, : out["sequence_lengths"][1, 0]].tolist()[-2:] == stop_word


def test_stop_words_accept_tensorrt_llm_offsets_format():
    assert to_words_list(np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]])) == [[[5, 6], [7]]]


def test_streaming_yields_every_step_and_ends_like_non_streaming(runner, hf):
    _, tokenizer = hf
    ids = encode(tokenizer, PROMPTS[:3])
    final = runner.generate(ids, max_new_tokens=6, end_id=-1, return_dict=True)
    steps = list(runner.generate(ids, max_new_tokens=6, end_id=-1, return_dict=True, streaming=True))
    assert len(steps) == 6
    assert [s["sequence_lengths"][0, 0].item() for s in steps] == [len(ids[0]) + k for k in range(1, 7)]
    assert torch.equal(steps[-1]["output_ids"], final["output_ids"])


def test_seeded_sampling_is_reproducible_and_seed_dependent(runner, hf):
    _, tokenizer = hf
    ids = encode(tokenizer, PROMPTS[:2])
    kwargs = dict(
        max_new_tokens=16, end_id=-1, top_k=50, top_p=0.95, temperature=1.5, output_log_probs=True, return_dict=True
    )
    a = runner.generate(ids, random_seed=7, **kwargs)
    b = runner.generate(ids, random_seed=7, **kwargs)
    c = runner.generate(ids, random_seed=8, **kwargs)
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert not torch.equal(a["output_ids"], c["output_ids"])
    assert a["log_probs"].shape == (2, 1, 16) and (a["log_probs"] <= 0).all()


def test_bad_words_are_never_generated(runner, hf):
    _, tokenizer = hf
    ids = encode(tokenizer, PROMPTS[:1])
    free = runner.generate(ids, max_new_tokens=8, end_id=-1)[0, 0, len(ids[0]) :].tolist()
    banned = runner.generate(ids, max_new_tokens=8, end_id=-1, bad_words_list=[[[free[0]]]])[
        0, 0, len(ids[0]) :
    ].tolist()
    assert free[0] not in banned


def test_invalid_inputs_get_clear_errors(runner, tiny_engine, tmp_path):
    with pytest.raises(ValueError, match="input 0 is empty"):
        runner.generate([torch.tensor([], dtype=torch.int64)], max_new_tokens=4)
    with pytest.raises(ValueError, match="more than max_input_len 8"):
        ModelRunner.from_dir(tiny_engine, max_input_len=8).generate([torch.arange(3, 20)], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len 128"):
        runner.generate([torch.arange(3, 10)], max_new_tokens=200)
    with pytest.raises(ValueError, match="exceeds max_batch_size 4"):
        runner.generate([torch.arange(3, 6)] * 5, max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds the engine's max_batch_size"):
        ModelRunner.from_dir(tiny_engine, max_batch_size=64)
    with pytest.raises(FileNotFoundError, match="build the engine first"):
        ModelRunner.from_dir(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_engine, broken)
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(RuntimeError, match="cannot load .*model.onnx"):
        ModelRunner.from_dir(broken)


def test_engine_config_records_limits_and_special_tokens(tiny_engine):
    config = json.loads((tiny_engine / "config.json").read_text())
    assert config["build_config"]["max_batch_size"] == 4 and config["build_config"]["end_id"] == 2
    assert config["pretrained_config"]["num_key_value_heads"] == 2


def test_run_batch_script_writes_jsonl_results(tiny_engine, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "w1 w2", "max_tokens": 3}\n{"prompt": "w5", "max_tokens": 5}\n{"prompt": "w9 w9 w9"}\n'
    )
    out = tmp_path / "results.jsonl"
    result = run_cli(
        "run", str(tiny_engine), "-i", str(prompts), "--max-tokens", "4", "--output-file", str(out), "-q", cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["w1 w2", "w5", "w9 w9 w9"]
    assert [r["completion_tokens"] <= m for r, m in zip(rows, (3, 5, 4))] == [True] * 3
    assert all(r["finish_reason"] in ("stop", "length") and r["ttft_s"] > 0 for r in rows)
    assert "3 prompts" in result.stdout and "tokens/s" in result.stdout


def test_bad_prompt_file_names_the_line(tiny_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    result = run_cli("run", str(tiny_engine), "-i", str(prompts))
    assert result.returncode == 1 and f"{prompts}:2" in result.stderr and "Traceback" not in result.stderr
