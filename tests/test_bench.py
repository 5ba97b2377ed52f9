"""Benchmark statistics on synthetic timings, reports and `bench compare` (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from pipeline.bench import report
from pipeline.bench.serve import parse_metrics, server_deltas
from pipeline.bench.stats import percentiles, summarize
from pipeline.bench.workloads import workload_prompts
from tests.conftest import run_cli


def sample(ttft: float, itl: list[float], tokens: int, error: str | None = None) -> dict:
    return {"ttft_s": ttft, "itl_s": itl, "e2e_s": ttft + sum(itl), "output_tokens": tokens, "error": error}


def test_percentiles_interpolate_like_numpy_and_handle_empty_input():
    assert percentiles(list(range(1, 101))) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_goodput_counts_only_successful_requests_within_both_objectives():
    samples = [
        sample(0.1, [0.05] * 9, 10),  # meets both
        sample(0.1, [0.05] * 9, 10),  # meets both
        sample(3.0, [0.05] * 9, 10),  # TTFT too slow
        sample(0.1, [0.5] * 9, 10),  # ITL too slow
        sample(0.0, [], 0, error="boom"),
    ]  # failed
    s = summarize(samples, duration_s=2.0, slo_ttft_ms=1000, slo_itl_ms=100)
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["goodput"] == 1.0 and s["goodput_fraction"] == 0.4  # 2 good requests in 2 s, of 5
    assert s["request_throughput"] == 2.0 and s["output_token_throughput"] == 20.0
    assert s["ttft_ms"]["p50"] == 100.0 and s["itl_ms"]["p99"] == 500.0


def level(label: str, tput: float, ttft: float) -> dict:
    summary = summarize([sample(ttft, [0.02] * 4, 5)], 1.0, 1000, 100) | {"output_token_throughput": tput}
    return {"label": label, "summary": summary, "samples": []}


def test_compare_reports_ratios_side_by_side(tmp_path):
    a = {
        "kind": "serve",
        "name": "int8",
        "levels": [level("concurrency 1", 40.0, 0.1), level("concurrency 16", 160.0, 0.5)],
    }
    b = {
        "kind": "serve",
        "name": "fp32",
        "levels": [level("concurrency 1", 20.0, 0.2), level("concurrency 16", 80.0, 1.0)],
    }
    for name, data in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        report.write_json(tmp_path / name / "results.json", data)
    result = run_cli("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    assert "| concurrency 16 output tok/s | 160.00 | 80.00 | 0.50x |" in result.stdout
    assert "| concurrency 1 TTFT p50 ms | 100.00 | 200.00 | 2.00x |" in result.stdout
    offline = tmp_path / "c.json"
    offline.write_text(json.dumps({"kind": "offline", "rows": []}))
    mixed = run_cli("bench", "compare", str(tmp_path / "a"), str(offline))
    assert mixed.returncode == 1 and "cannot compare a serve run with a offline run" in mixed.stderr


def test_serve_table_and_plot_are_written(tmp_path):
    levels = [level("concurrency 1", 40.0, 0.1), level("concurrency 16", 160.0, 0.5)]
    shared = level("concurrency 1", 20.0, 0.2) | {
        "workload": "shared-prefix",
        "server": {"prefix_cache_hit_rate": 0.9, "prefix_reused_tokens": 960.0, "draft_acceptance": None},
    }
    table = report.serve_table([*levels, shared])
    assert "| synthetic | concurrency 16 | 1 | 0 | 1.00 | 160.00 | 4.00x |" in table
    assert "| shared-prefix | concurrency 1 | 1 | 0 | 1.00 | 20.00 | 1.00x |" in table  # its own first load
    assert table.splitlines()[-1].endswith("| 0.90 | 960.00 | n/a |")
    assert table.splitlines()[2].endswith("| n/a | n/a | n/a |")  # no server figures recorded
    report.plot_serve(levels, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A byte-level BPE tokenizer trained on a made-up play, with ChatML's special tokens and template: lossless
    decoding, like SmolLM2's, in milliseconds."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    names, words = ["THESEUS", "HERMIA", "PUCK"], "moon night dream forest lover wall lion sleep crown".split()
    text = "\n\n".join(
        f"{rng.choice(names)}.\n" + " ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(300)
    )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer, text


def prompts_of(workload: str, chat_tokenizer, seed: int = 0, count: int = 6) -> list[str]:
    tokenizer, text = chat_tokenizer
    return workload_prompts(
        workload, tokenizer, text, count, input_len=40, input_spread=0.25, prefix_len=200, passage_len=60, seed=seed
    )


@pytest.mark.parametrize("workload", ["synthetic", "shared-prefix", "grounded"])
def test_workload_prompts_are_deterministic_and_differ(workload, chat_tokenizer):
    prompts = prompts_of(workload, chat_tokenizer)
    assert prompts == prompts_of(workload, chat_tokenizer)  # the same seed gives the same load
    assert prompts != prompts_of(workload, chat_tokenizer, seed=1)
    assert len(set(prompts)) == len(prompts) == 6
    with pytest.raises(ValueError, match="choose from synthetic, shared-prefix, grounded"):
        prompts_of(workload + "-typo", chat_tokenizer)


def test_shared_prefix_prompts_share_the_system_prompt_in_token_ids(chat_tokenizer):
    tokenizer = chat_tokenizer[0]
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts_of("shared-prefix", chat_tokenizer)]
    shared = next(i for i in range(min(map(len, ids))) if len({row[i] for row in ids}) > 1)
    assert shared >= 200  # the policy and the text, 200 tokens, identical ids in every request
    assert all(len(row) - shared < shared / 3 for row in ids)  # then a short question of its own
    assert all(
        p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n")
        for p in prompts_of("shared-prefix", chat_tokenizer)
    )
    own = workload_prompts(
        "shared-prefix", tokenizer, "", 2, input_len=1, input_spread=0, prefix_len=1, passage_len=1, system="Be brief."
    )
    assert all(p.startswith("<|im_start|>system\nBe brief.<|im_end|>") for p in own)


def test_grounded_prompts_contain_their_passage(chat_tokenizer):
    tokenizer, text = chat_tokenizer
    for prompt in prompts_of("grounded", chat_tokenizer):
        user = prompt.split("<|im_start|>user\n", 1)[1]
        assert user.startswith("Passage:\n")
        passage, task = (
            user.removeprefix("Passage:\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n").rsplit("\n\n", 1)
        )
        assert passage in text and len(tokenizer.encode(passage)) == pytest.approx(60, abs=2)
        word = task.rsplit(" mentions ", 1)[-1].rstrip(".") if " mentions " in task else None
        assert word is None or word in passage.lower()


TRITON_METRICS = """\
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="ensemble",version="1"} 40
# HELP trtllm_pipeline_prefix_cache_hit_blocks_total KV blocks found in the prefix cache
# TYPE trtllm_pipeline_prefix_cache_hit_blocks_total counter
trtllm_pipeline_prefix_cache_hit_blocks_total{model="tensorrt_llm"} 30
trtllm_pipeline_prefix_cache_hit_blocks_total{model="tensorrt_llm_2"} 6
# HELP trtllm_pipeline_prefix_cache_queried_blocks_total KV blocks looked up
# TYPE trtllm_pipeline_prefix_cache_queried_blocks_total counter
trtllm_pipeline_prefix_cache_queried_blocks_total{model="tensorrt_llm"} 40
trtllm_pipeline_prefix_cache_queried_blocks_total{model="tensorrt_llm_2"} 8
# HELP trtllm_pipeline_prefix_cache_reused_tokens_total Prompt tokens not recomputed
# TYPE trtllm_pipeline_prefix_cache_reused_tokens_total counter
trtllm_pipeline_prefix_cache_reused_tokens_total{model="tensorrt_llm"} 1152
# HELP trtllm_pipeline_active_rows Sequences in the running batch after the last step
# TYPE trtllm_pipeline_active_rows gauge
trtllm_pipeline_active_rows{model="tensorrt_llm"} 3
"""


def test_server_metrics_are_parsed_and_reported_as_deltas_or_absent():
    after = parse_metrics(TRITON_METRICS)
    assert after["trtllm_pipeline_prefix_cache_hit_blocks_total"] == 36  # summed over the models' label sets
    assert after["nv_inference_count_total"] == 40 and after["trtllm_pipeline_active_rows"] == 3
    before = parse_metrics(
        "# TYPE trtllm_pipeline_prefix_cache_hit_blocks_total counter\n"
        'trtllm_pipeline_prefix_cache_hit_blocks_total{model="tensorrt_llm"} 6\n'
        "# TYPE trtllm_pipeline_prefix_cache_queried_blocks_total counter\n"
        'trtllm_pipeline_prefix_cache_queried_blocks_total{model="tensorrt_llm"} 8\n'
        'trtllm_pipeline_prefix_cache_reused_tokens_total{model="tensorrt_llm"} 128\n'
    )
    deltas = server_deltas(before, after)
    assert deltas["prefix_cache_hit_rate"] == 0.75  # (36 - 6) / (48 - 8)
    assert deltas["prefix_reused_tokens"] == 1024
    assert deltas["draft_acceptance"] is None  # no speculation counters exported
    assert server_deltas(after, after)["prefix_cache_hit_rate"] is None  # nothing queried in between
    assert set(server_deltas(None, None).values()) == {None}  # no metrics endpoint


def test_bench_serve_runs_against_the_real_server_and_writes_a_report(smollm2_build, tmp_path):
    result = run_cli(
        "bench",
        "serve",
        str(smollm2_build / "triton_repo"),
        "--concurrency",
        "1",
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--output-len",
        "8",
        "--workload",
        "synthetic",
        "--workload",
        "grounded",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "latest-serve" / "results.json").read_text())
    assert [(lv["workload"], lv["summary"]["errors"]) for lv in data["levels"]] == [
        ("synthetic", 0),
        ("synthetic", 0),
        ("grounded", 0),
        ("grounded", 0),
    ]
    assert all(
        s["output_tokens"] == 8 for lv in data["levels"] for s in lv["samples"]
    )  # ignore_eos: exactly max_tokens each
    # the scraped server counters over each level agree with what the client received
    assert [lv["server"]["generated_tokens"] for lv in data["levels"]] == [16, 16, 16, 16]
    assert (tmp_path / "latest-serve" / "throughput_vs_latency.png").is_file() and data["build"]["engine"]["metrics"]
    # the CPU every process of the server used over each level: the engine's model process did most of the work
    for level in data["levels"]:
        seconds = level["cpu"]["seconds"]
        assert set(seconds) == {
            "tritonserver",
            "bench process (OpenAI gateway)",
            "load generator",
            *(f"model {name}" for name in ("tensorrt_llm", "tensorrt_llm_bls", "preprocessing", "postprocessing")),
        }
        assert seconds["model tensorrt_llm"] > max(
            seconds[f"model {name}"] for name in ("preprocessing", "postprocessing")
        )
        assert seconds["load generator"] > 0  # its own process, which counts itself
        assert 0 < level["cpu"]["busy"] <= 1.1, level["cpu"]
    assert "| model tensorrt_llm CPU s |" in (tmp_path / "latest-serve" / "summary.md").read_text()


def test_offline_bench_runs_every_engine_on_the_same_workload_and_reports_ratios(tiny_llama, tmp_path, cli_build):
    import sys

    from pipeline.bench.peers import EngineSpec, PeerManifest
    from tests.conftest import write_config

    config = write_config(
        tmp_path / "tiny.yaml",
        f"model:\n  source: hf\n  path: {tiny_llama}\nverify:\n  eval_text: {tmp_path / 'text.txt'}\n",
    )
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 200}" for i in range(500)))
    out = tmp_path / "out"
    assert cli_build(str(config), "--output", str(out), "--until", "engine").returncode == 0
    # a peer whose worker cannot load (llama.cpp's bindings are not in this environment) is reported, not fatal
    broken = EngineSpec("llama.cpp Q8_0", "llama.cpp", "Q8_0", sys.executable, "pipeline.bench.peers.llamacpp", "x")
    PeerManifest([broken], unavailable={"openvino": "export failed"}).write(out)
    result = run_cli(
        "bench",
        "offline",
        str(config),
        "--output",
        str(out),
        "--batch",
        "2",
        "--shape",
        "16x4",
        "--repeats",
        "2",
        "--both-spinning",
        "--out",
        str(tmp_path / "bench"),
    )
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "bench" / "latest-offline" / "results.json").read_text())
    engines = {(r["engine"], r["batch"]) for r in results["rows"]}
    assert engines == {(name, 2) for name in ("transformers fp32", "ours fp32", "ours fp32, spinning threads")}
    assert all(len(r["raw_s"]) == 2 and r["peak_rss_mib"] > 0 and r["prefill_tok_s"] > 0 for r in results["rows"])
    assert {(r["ours"], r["peer"], r["batch"]) for r in results["ratios"]} == {
        (ours, "transformers fp32", 2) for ours in ("ours fp32", "ours fp32, spinning threads")
    }
    assert "No module named 'llama_cpp'" in results["peers_skipped"]["llama.cpp Q8_0"]
    # llama.cpp's own tools are timed beside its bindings only when `bench peers` built them
    assert "llama-bench, llama-batched-bench not built" in results["peers_skipped"]["llama.cpp Q8_0 (its tools)"]
    assert results["peers_skipped"]["openvino"] == "export failed"
    # ours scored as the quality gate scores it (the only engine here besides the reference's own transformers)
    assert [q["engine"] for q in results["quality"]] == ["ours fp32"]
    assert 0 <= results["quality"][0]["kl_divergence"] < 1 and results["quality"][0]["top1_agreement"] > 0.5
    assert (tmp_path / "bench" / "latest-offline" / "speed_and_quality.png").is_file()

    profiled = run_cli(
        "bench",
        "profile",
        str(config),
        "--output",
        str(out),
        "--batch",
        "2",
        "--shape",
        "16x6",
        "--out",
        str(tmp_path / "bench"),
        "--no-guided",  # the tiny model's word-level vocabulary cannot write JSON (test_guided measures it)
    )
    assert profiled.returncode == 0, profiled.stderr
    profile = json.loads((tmp_path / "bench" / "latest-profile" / "results.json").read_text())
    (step,) = profile["steps"]
    # the split adds up to the step, and the kernels by operator to the kernels (medians: within rounding)
    parts = step["decode_kernels_ms"] + step["decode_ort_around_kernels_ms"] + step["decode_python_ms"]
    assert step["decode_kernels_ms"] > 0 and abs(parts - step["decode_step_ms"]) < 0.5 * step["decode_step_ms"]
    assert "MatMul" in "".join(step["decode_kernels_by_op_ms"]) and 0 < step["prefill_kernels_share"] <= 1
    assert profile["machine"]["read_gb_s"] > 0 and profile["ceilings"]["decode_batch1_tok_s"] > 0
    assert profile["guided"] == []


def test_family_decode_bench_compares_families_with_llama_and_reuses_only_matching_builds(tmp_path):
    from pipeline.bench.family_decode import decode_speed_per_family

    tiny = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 128,
        "vocab_size": 300,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }

    def run(size):
        return decode_speed_per_family(
            tmp_path, ["Qwen3ForCausalLM"], [1], 8, 4, 2, 1, False, "none", log=lambda m: None, size=size
        )

    rows = run(tiny)
    assert [(r["architecture"], r["batch"]) for r in rows] == [("LlamaForCausalLM", 1), ("Qwen3ForCausalLM", 1)]
    assert rows[0]["ratio_to_llama"] == 1.0 and all(len(r["raw_tok_s"]) == 2 for r in rows)
    assert all(s > 0 for r in rows for s in r["raw_tok_s"])
    run({**tiny, "num_hidden_layers": 3})  # another size: new checkpoints, not the 2-layer ones
    assert len(list((tmp_path / "Qwen3ForCausalLM").glob("hf-" + "?" * 12))) == 2
