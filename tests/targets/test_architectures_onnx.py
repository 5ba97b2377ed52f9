"""The fused graph of every registered family, and optimum-onnx's fallback, against transformers: logits on a
prompt longer than the sliding window, and greedy decoding through the real ModelRunner continuing past it,
token for token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline import torch_models
from pipeline.bench.family_decode import make_engine
from pipeline.errors import BuildStepError, ConfigError
from pipeline.targets.onnxruntime import adapter as target
from pipeline.targets.onnxruntime import graph as fused_onnx
from pipeline.targets.onnxruntime import scoring
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from pipeline.validation import load_config
from tests.conftest import TINY_FAMILIES, TINY_SLIDING_WINDOW, make_tiny, write_config

PROMPT_LEN = 40  # > TINY_SLIDING_WINDOW: the window masks part of the prompt
NEW_TOKENS = 24


def randomized(hf_dir, seed: int = 1):
    """Give the parameters transformers initialises to constants (norm weights, biases) random values, so that
    a graph that drops or misreads one of them cannot match."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(hf_dir, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """architecture -> (checkpoint with random norms and biases, its transformers model), made once per session."""
    made = {}

    def checkpoint(arch: str):
        if arch not in made:
            hf_dir = make_tiny(arch, tmp_path_factory.mktemp(arch) / "hf", initializer_range=0.1)
            made[arch] = hf_dir, randomized(hf_dir)
        return made[arch]

    return checkpoint


@pytest.fixture(
    scope="module",
    params=[(arch, graph) for arch in TINY_FAMILIES for graph in ("fused", "optimum")],
    ids=lambda param: "-".join(param),
)
def family(request, checkpoints):
    """(architecture, graph, fp32 engine, transformers model): the fused graph, and optimum-onnx's (the fallback)."""
    arch, graph = request.param
    hf_dir, model = checkpoints(arch)
    engine = make_engine(hf_dir, hf_dir.parent / f"engine-{graph}", max_batch_size=2, max_seq_len=128, graph=graph)
    return arch, graph, engine, model


def prompts(count: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 250, length).tolist() for length in (PROMPT_LEN, 11)[:count]]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return out[0, len(prompt) :].tolist()


def runner_greedy(engine, batch: list[list[int]]) -> list[list[int]]:
    runner = ModelRunner.from_dir(engine, num_threads=1)
    out = runner.generate(batch, max_new_tokens=NEW_TOKENS, end_id=-1, return_dict=True)
    return [
        out["output_ids"][row, 0, len(prompt) : out["sequence_lengths"][row, 0]].tolist()
        for row, prompt in enumerate(batch)
    ]


def test_logits_match_transformers_past_the_sliding_window(family):
    arch, graph, engine, model = family
    ids = np.asarray(prompts(1), dtype=np.int64)
    reference = torch_models.torch_logits_fn(model)(ids)
    logits = scoring.ort_logits_fn(engine / "model.onnx", threads=1)(ids)
    assert np.abs(reference).max() > 0.5  # logits big enough for the comparison to mean something
    assert np.abs(logits - reference).max() < 1e-4, (arch, graph)
    if getattr(model.config, "sliding_window", None):
        assert PROMPT_LEN > TINY_SLIDING_WINDOW == model.config.sliding_window


def test_greedy_decode_through_the_runner_matches_transformers_generate(family):
    arch, graph, engine, model = family
    batch = prompts()  # two rows of different lengths, decoded together; the long one passes the window
    expected = [hf_greedy(model, prompt) for prompt in batch]
    assert [len(tokens) for tokens in expected] == [NEW_TOKENS] * 2
    assert runner_greedy(engine, batch) == expected, (arch, graph)


def test_chunked_prefill_across_the_window_matches_transformers_generate(family, tmp_path):
    """Prompts prefilled in pieces smaller than the window (an engine built with max_num_tokens 12)."""
    import shutil

    arch, graph, engine, model = family
    chunked = shutil.copytree(engine, tmp_path / "engine")
    config = json.loads((chunked / "config.json").read_text())
    config["build_config"]["max_num_tokens"] = 12
    (chunked / "config.json").write_text(json.dumps(config))
    batch = prompts()
    assert runner_greedy(chunked, batch) == [hf_greedy(model, prompt) for prompt in batch], (arch, graph)


def test_auto_picks_the_fused_graph_for_every_family(checkpoints):
    for arch in TINY_FAMILIES:
        assert target.choose_graph(checkpoints(arch)[0], "auto") == ("fused", None)


def test_supports_refuses_what_the_fused_graph_cannot_build_naming_the_fix(tmp_path):
    hf_dir = make_tiny(
        "Phi3ForCausalLM",
        tmp_path,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0] * 24,
            "long_factor": [2.0] * 24,
        },
        original_max_position_embeddings=1024,
    )
    assert "longrope" in fused_onnx.supports(hf_dir) and "exact up to 1024 tokens" in fused_onnx.supports(hf_dir)
    assert target.choose_graph(hf_dir, "auto") == ("optimum", fused_onnx.supports(hf_dir))
    with pytest.raises(BuildStepError, match=r"longrope.*set target.onnx_graph: optimum"):
        target.choose_graph(hf_dir, "fused")
    config_file = write_config(
        tmp_path / "c.yaml",
        f"model:\n  source: hf\n  path: {hf_dir}\ntarget:\n  onnx_graph: fused\nbuild:\n  max_seq_len: 2048\n",
    )
    with pytest.raises(ConfigError) as refused:  # at validate, before any export
        load_config(config_file)
    problems = " ".join(refused.value.problems)
    assert "target.onnx_graph: 'fused' but rope_scaling type 'longrope'" in problems
    assert "build.max_seq_len: 2048 exceeds 1024" in problems and "set build.max_seq_len: 1024" in problems
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "rope_scaling": None, "hidden_size": 64}))
    assert "rotary part of each head (24 of head_dim 32)" in fused_onnx.supports(hf_dir)
    gemma = make_tiny("Gemma3ForCausalLM", tmp_path / "gemma", attn_logit_softcapping=50.0)
    assert "attn_logit_softcapping" in fused_onnx.supports(gemma)
    fused_only = (
        "runtime: {batch_invariant: true, enable_kv_cache_reuse: true, speculative: {type: ngram, max_draft_len: 4}}"
    )
    with pytest.raises(ConfigError) as refused:  # auto falls back to optimum: the fused-only settings cannot hold
        load_config(write_config(tmp_path / "auto.yaml", f"model: {{source: hf, path: {gemma}}}\n{fused_only}\n"))
    assert len(refused.value.problems) == 3
    for field in ("batch_invariant", "enable_kv_cache_reuse", "speculative"):
        assert any(
            f"runtime.{field}: needs the fused graph, but this checkpoint gets the optimum graph (" in problem
            and f"remove runtime.{field}" in problem
            for problem in refused.value.problems
        ), refused.value.problems


def test_optimum_exports_gemma3_without_position_ids(checkpoints):
    """The graph the logits check and the ConcatCache runner above feed only the inputs it has."""
    hf_dir, _ = checkpoints("Gemma3ForCausalLM")
    engine = make_engine(hf_dir, hf_dir.parent / "engine-optimum", max_batch_size=2, max_seq_len=128, graph="optimum")
    inputs = {i.name for i in scoring.ort_session(engine / "model.onnx").get_inputs()}
    assert "attention_mask" in inputs and "position_ids" not in inputs
