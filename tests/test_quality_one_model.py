"""The quality gate and the export's logits check hold one model at a time (issue #46): the reference's logits and
chat answers first, its logits kept on disk, the reference released, then the engine; with the figures that scoring
both models in turn per sequence, both loaded, gave. On a real tiny build (its int8 engine and the fp32 ONNX graph),
counting the ONNX Runtime sessions and transformers models alive at each step."""

from __future__ import annotations

import gc
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeline import quality
from pipeline.targets import get_target
from tests.conftest import write_config
from tests.test_quality import TINY_CHAT_TEMPLATE

CHAT_PROMPTS = len(json.loads(quality.CHAT_EVAL.read_text())["conversations"])


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory, tiny_llama):
    """(config, output) of the tiny Llama with a chat template, built through the engine stage, int8, the gate's
    thresholds off but the chat set scored (int8 round-to-nearest); 1,100 evaluation tokens: three windows."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from pipeline.build import build
    from pipeline.validation import load_config

    folder = tmp_path_factory.mktemp("one-model")
    model = folder / "model"
    shutil.copytree(tiny_llama, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    words = np.random.default_rng(0).integers(0, 250, size=1200)
    (folder / "eval.txt").write_text(" ".join(f"w{i}" for i in words))
    body = f"""
        model: {{source: hf, path: {model}}}
        quantization: {{weights: int8, method: rtn}}
        build: {{max_batch_size: 1, max_input_len: 512, max_seq_len: 1024, max_num_tokens: 512}}
        runtime: {{cpu_threads: 1}}
        verify: {{eval_text: eval.txt, eval_tokens: 1100, chat_max_new_tokens: 8, max_perplexity_increase: null,
                  max_kl_divergence: null, min_top1_agreement: null, min_chat_answer_match: 0.0}}
        """
    cfg = load_config(write_config(folder / "tiny.yaml", body))
    build(cfg, folder / "out", Console(file=io.StringIO()), until="engine")
    return cfg, folder / "out"


def alive(kind: type) -> int:
    """How many objects of `kind` this process holds (garbage included: `Loaded.release` collects its own)."""
    return sum(issubclass(type(o), kind) for o in gc.get_objects())


def recording(model: quality.Model, events: list, cache: Path) -> quality.Model:
    """`model` noting, after each of its forwards, greedy answers and its release: (its name, the call, the ONNX
    Runtime sessions alive, the reference logits files on disk)."""
    from onnxruntime import InferenceSession

    def note(call: str) -> None:
        events.append((model.name, call, alive(InferenceSession), len(list(cache.glob("reference-logits-*/*.npy")))))

    def logits(ids):
        out = model.logits(ids)
        note("logits")
        return out

    def greedy(*args):
        out = model.greedy(*args)
        note("greedy")
        return out

    def greedy_all(prompts, *args):
        out = model.greedy_all(prompts, *args)
        note("greedy")
        return out

    def release():
        model.release()
        note("release")

    return replace(model, logits=logits, greedy=greedy, release=release, greedy_all=model.greedy_all and greedy_all)


def interleaved_report(cfg, model: quality.Model, reference: quality.Model, hf_dir: Path, cache: Path) -> dict:
    """The report as `measure` computed it before it ran one model at a time: both models loaded, in turn per
    sequence (`quality.compare`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    text = (cfg._base_dir / cfg.verify.eval_text).read_text()
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.verify.eval_tokens], dtype=np.int64)
    windows = quality.text_windows(ids, quality.WINDOW, quality.WINDOW, quality.special_prefix(tokenizer))
    scores = quality.compare(reference.logits, model.logits, windows)
    reference_ppl, engine_ppl = np.exp(scores["reference_nll"].mean()), np.exp(scores["engine_nll"].mean())
    chat = quality.chat_reference(reference, tokenizer, model.end_id, cfg.verify.chat_max_new_tokens, cache)
    chat_scores = quality.compare(reference.logits, model.logits, chat.sequences())
    matches = [model.greedy(p, chat.max_new_tokens, chat.end_id) == a for p, a in zip(chat.prompts, chat.answers)]
    return {
        "eval_text": cfg.verify.eval_text,
        "eval_tokens": int(len(ids)),
        "reference_perplexity": round(float(reference_ppl), 4),
        "engine_perplexity": round(float(engine_ppl), 4),
        "perplexity_increase": round(float(engine_ppl / reference_ppl - 1), 5),
        **quality.drift(scores),
        "max_abs_logits_diff": float(f"{scores['abs_diff'].max():.4g}"),
        "chat_prompts": len(chat.prompts),
        "chat_tokens": len(chat_scores["kl"]),
        **quality.drift(chat_scores, "chat_"),
        "chat_answer_match": round(float(np.mean(matches)), 4),
    }


def test_the_gate_releases_the_reference_before_the_engine_loads_with_the_same_figures(tiny_build, tmp_path):
    from onnxruntime import InferenceSession

    cfg, out = tiny_build
    gc.collect()
    before = alive(InferenceSession)
    engine, reference = get_target("onnxruntime").scored(cfg, out, out / "engine", print)
    assert alive(InferenceSession) == before  # nothing is loaded until it runs

    events: list = []
    recorded = recording(engine, events, tmp_path), recording(reference, events, tmp_path)
    report = quality.measure(cfg, *recorded, out / "import", tmp_path)

    first_engine = [name for name, *_ in events].index("engine")
    assert {name for name, *_ in events[:first_engine]} == {"fp32 ONNX graph"}
    assert {name for name, *_ in events[first_engine:]} == {"engine"}
    reference_calls = [call for _, call, *_ in events[:first_engine]]
    # the reference's answers decoded together (scoring.batched_greedy), then its logits of each
    assert reference_calls == ["logits"] * 3 + ["greedy"] + ["logits"] * CHAT_PROMPTS + ["release"]
    engine_calls = [call for _, call, *_ in events[first_engine:]]
    assert engine_calls == ["logits"] * (3 + CHAT_PROMPTS) + ["greedy"] * CHAT_PROMPTS + ["release"]
    # one ONNX Runtime session while either model runs; none of the gate's left after each release
    assert {sessions - before for _, call, sessions, _ in events if call != "release"} == {1}
    assert {sessions - before for _, call, sessions, _ in events if call == "release"} == {0}
    # the engine scores against the reference's logits on disk, one file per sequence, removed afterwards
    assert {files for _, _, _, files in events[first_engine:-1]} == {3 + CHAT_PROMPTS}
    assert not list(tmp_path.glob("reference-logits-*"))

    engine, reference = get_target("onnxruntime").scored(cfg, out, out / "engine", print)
    assert report == {
        "reference": "fp32 ONNX graph",
        **interleaved_report(cfg, engine, reference, out / "import", tmp_path),
    }
    assert report["kl_divergence"] > 0 and report["chat_prompts"] == CHAT_PROMPTS  # int8: a real drift
    gated = json.loads((out / "build.lock.json").read_text())["stages"]["engine"]["metrics"]
    assert {k: gated[k] for k in report} == report  # the build's gate, in the engine stage, measured the same


def test_the_export_check_frees_the_transformers_model_before_the_onnx_graph_loads(tiny_build, monkeypatch):
    from transformers import PreTrainedModel

    from pipeline.targets.onnxruntime import adapter, scoring

    _, out = tiny_build
    gc.collect()
    models_before = alive(PreTrainedModel)
    opened = scoring.ort_logits_fn
    models_alive_at_open = []

    def counting(onnx_path, threads=None):
        models_alive_at_open.append(alive(PreTrainedModel) - models_before)
        return opened(onnx_path, threads)

    monkeypatch.setattr(scoring, "ort_logits_fn", counting)
    prompts = ["w1 w2 w3 w4", "w7 w249 w0 w9 w9 w9 w100"]
    assert adapter.compare_logits(out / "import", out / "export" / "model.onnx", prompts) < 1e-4
    assert models_alive_at_open == [0]


def test_a_bfloat16_reference_is_the_checkpoint_run_by_transformers_in_bfloat16(tiny_build, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg, out = tiny_build
    bf16 = cfg.model_copy(update={"verify": cfg.verify.model_copy(update={"reference_dtype": "bfloat16"})})
    engine, reference = get_target("onnxruntime").scored(bf16, out, out / "engine", print)
    ids = np.arange(3, 40, dtype=np.int64)[None]
    checkpoint = AutoModelForCausalLM.from_pretrained(out / "import", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = checkpoint(torch.from_numpy(ids)).logits.float().numpy()
    del checkpoint
    np.testing.assert_array_equal(reference.logits(ids), expected)
    reference.release()

    report = quality.measure(bf16, engine, reference, out / "import", tmp_path)
    fp32 = json.loads((out / "build.lock.json").read_text())["stages"]["engine"]["metrics"]
    assert report["reference"] == "bfloat16 transformers model" and fp32["reference"] == "fp32 ONNX graph"
    assert report["engine_perplexity"] == fp32["engine_perplexity"]  # the same engine, against another reference
    assert report["reference_perplexity"] != fp32["reference_perplexity"]
    assert report["reference_perplexity"] == pytest.approx(fp32["reference_perplexity"], rel=0.02)
    assert report["chat_prompts"] == CHAT_PROMPTS
