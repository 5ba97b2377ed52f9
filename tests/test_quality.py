"""The quality gate's measures (KL divergence, top-1 agreement, chat answer match) on tiny models, its fp32
references (the exported ONNX graph answers as transformers does; transformers' answers kept per checkpoint), and the
gate failing a real build's engine past a threshold, naming the field."""

from __future__ import annotations

import io
import json
import shutil
from functools import partial

import numpy as np
import pytest
import torch

from pipeline import quality, torch_models
from tests.conftest import write_config

# A chat template for the tiny word-level tokenizer (<s> and </s> are its special tokens; other words are w<n>)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, tiny_llama):
    """The tiny Llama with a chat template in its tokenizer, and the model loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def test_kl_divergence_matches_its_definition_and_top1_counts_agreeing_positions():
    p, q = np.log([[0.5, 0.5], [0.9, 0.1]]), np.log([[0.9, 0.1], [0.9, 0.1]])
    expected = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    assert quality.kl_divergence(p, q) == pytest.approx([expected, 0.0], abs=1e-12)
    ids = np.array([0, 1, 0, 1], dtype=np.int64)
    a = lambda x: np.array([[[0, 1.0], [1.0, 0], [1.0, 0], [0, 1.0]]])  # noqa: E731
    b = lambda x: np.array([[[0, 2.0], [0, 1.0], [3.0, 0], [0, 1.0]]])  # noqa: E731
    scores = quality.compare(a, b, [(ids, np.arange(3))])
    assert quality.drift(scores)["top1_agreement"] == pytest.approx(2 / 3, abs=1e-4)


def test_identical_models_drift_by_zero_and_a_perturbed_one_by_more(tiny_chat):
    _, model, _ = tiny_chat
    fp32 = torch_models.torch_logits_fn(model)
    ids = np.random.default_rng(0).integers(3, 250, size=100).astype(np.int64)
    windows = list(quality.text_windows(ids, 40, prefix=[1]))
    same = quality.compare(fp32, fp32, windows)
    assert quality.drift(same) == {"kl_divergence": 0.0, "kl_divergence_p99": 0.0, "top1_agreement": 1.0}

    noise = np.random.default_rng(1).normal(0, 0.5, size=model.config.vocab_size).astype(np.float32)
    perturbed = quality.drift(quality.compare(fp32, lambda x: fp32(x) + noise, windows))
    assert perturbed["kl_divergence"] > 1e-3 and perturbed["kl_divergence_p99"] >= perturbed["kl_divergence"]
    assert perturbed["top1_agreement"] < 1.0


def test_a_model_matches_its_own_chat_answers_and_is_scored_on_the_answers_only(tiny_chat):
    path, model, tokenizer = tiny_chat
    reference = quality.chat_reference(torch_models.transformers_reference(path), tokenizer, end_id=2, max_new_tokens=8)
    assert len(reference.prompts) == len(json.loads(quality.CHAT_EVAL.read_text())["conversations"])
    assert all(p[-1] == 1 and len(a) <= 8 for p, a in zip(reference.prompts, reference.answers))  # ends with <s>
    fp32 = torch_models.torch_logits_fn(model)
    answers_logits = [fp32(ids[None, :])[0, scored] for ids, scored in reference.sequences()]
    report = quality.chat_quality(answers_logits, fp32, reference, partial(torch_models.torch_greedy, model))
    assert report["chat_answer_match"] == 1.0 and report["chat_kl_divergence"] == 0.0
    assert report["chat_tokens"] == sum(len(a) for a in reference.answers)
    other = quality.chat_quality(answers_logits, fp32, reference, lambda prompt, n, end: [end])  # ends at once
    assert other["chat_answer_match"] == np.mean([a == [2] for a in reference.answers])


def test_transformers_answers_are_generated_once_per_checkpoint(tiny_chat, tmp_path):
    path, _, tokenizer = tiny_chat
    reference = torch_models.transformers_reference(path, checkpoint_hash="imported")
    first = quality.chat_reference(reference, tokenizer, 2, 8, tmp_path)
    generate = reference.greedy
    reference.greedy = lambda *_: pytest.fail("the stored answers were generated again")
    assert quality.chat_reference(reference, tokenizer, 2, 8, tmp_path).answers == first.answers
    reference.greedy = generate  # another length is another set of answers
    assert len(quality.chat_reference(reference, tokenizer, 2, 4, tmp_path).answers[0]) <= 4
    assert len(list((tmp_path / "chat-answers").iterdir())) == 2


def test_fp32_engine_matches_fp32_answers_and_the_gate_names_the_field_it_fails(tiny_chat, tmp_path):
    """A real build's engine stage records the report; a threshold past it fails the gate, naming the field."""
    from rich.console import Console

    from pipeline.build import build
    from pipeline.quality import gate_problem
    from pipeline.targets import get_target
    from pipeline.validation import load_config

    path, _, _ = tiny_chat
    body = f"""
        model: {{source: hf, path: {path}}}
        quantization: {{weights: none}}
        build: {{max_batch_size: 1, max_input_len: 256, max_seq_len: 512, max_num_tokens: 256}}
        runtime: {{cpu_threads: 1}}
        verify: {{eval_tokens: 128, chat_max_new_tokens: 8, max_kl_divergence: 0.001, min_top1_agreement: 0.99,
                  min_chat_answer_match: 1.0}}
        """
    cfg = load_config(write_config(tmp_path / "tiny.yaml", body))
    out = tmp_path / "out"
    build(cfg, out, Console(file=io.StringIO()), until="engine")
    metrics = json.loads((out / "build.lock.json").read_text())["stages"]["engine"]["metrics"]
    assert metrics["chat_answer_match"] == 1.0 and metrics["chat_prompts"] == 30  # ModelRunner reproduces fp32
    assert metrics["kl_divergence"] < 1e-6 and metrics["chat_kl_divergence"] < 1e-6
    assert gate_problem(cfg, metrics) is None
    # the reference was the exported fp32 graph, run by the ModelRunner: its answers are transformers'
    _, onnx = get_target("onnxruntime").scored(cfg, out, out / "engine", print)
    end_id, n = onnx.end_id, cfg.verify.chat_max_new_tokens
    _, _, tokenizer = tiny_chat
    transformers = torch_models.transformers_reference(path)
    transformers_answers = quality.chat_reference(transformers, tokenizer, end_id, n).answers
    assert quality.chat_reference(onnx, tokenizer, end_id, n).answers == transformers_answers

    problem = gate_problem(cfg, {**metrics, "chat_answer_match": 0.9, "kl_divergence": 0.01})
    assert "chat_answer_match 0.9 is below verify.min_chat_answer_match 1" in problem
    assert "kl_divergence 0.01 exceeds verify.max_kl_divergence 0.001" in problem and "milder quantization" in problem
    no_chat = {k: v for k, v in metrics.items() if not k.startswith("chat_")}
    assert "verify.min_chat_answer_match is set but nothing measured chat_answer_match" in gate_problem(cfg, no_chat)
