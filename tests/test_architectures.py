"""The architecture registry: what `validate` takes and refuses, per target, and what `architectures` lists."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.architectures import ARCHITECTURES, GGUF_ARCHITECTURES
from tests.conftest import TINY_FAMILIES, make_tiny, run_cli, write_config


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return make_tiny("Gemma3ForCausalLM", tmp_path_factory.mktemp("tiny-gemma3"))


def test_every_registered_architecture_has_a_tiny_checkpoint_and_a_fused_graph():
    from pipeline.targets.onnxruntime.graph import FAMILIES

    assert set(TINY_FAMILIES) == set(ARCHITECTURES) == set(FAMILIES)


def test_gguf_architectures_import_as_registered_ones():
    assert GGUF_ARCHITECTURES["llama"] == "LlamaForCausalLM"
    assert {GGUF_ARCHITECTURES[name] for name in ("qwen2", "qwen3", "gemma3", "phi3")} <= set(ARCHITECTURES)


def test_unregistered_architecture_is_refused_naming_target_and_supported_list(tmp_path, tiny_llama):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    path = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "model.path: architecture GPTNeoXForCausalLM is not supported (supported on target onnxruntime:" in message
    assert all(name in message for name in ARCHITECTURES), message


@pytest.mark.parametrize("arch", sorted(TINY_FAMILIES))
def test_cpu_target_takes_every_family(tmp_path, arch):
    from pipeline.validation import load_config

    model = make_tiny(arch, tmp_path / "m")
    cfg = load_config(write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n"))
    assert cfg.model_facts().architecture == arch


def test_a_family_the_target_cannot_build_is_refused_with_the_reason(tmp_path, tiny_gemma3):
    from pipeline.config import BuildConfig
    from pipeline.targets import TARGETS

    target = TARGETS["trtllm"]
    refused = [
        (variant, why_not)
        for variant in target.variants()
        if (
            why_not := target.architecture_support(BuildConfig(target={"name": "trtllm", **variant}))[
                "Gemma3ForCausalLM"
            ]
        )
    ]
    assert refused, "ModelOpt 0.47 has no TensorRT-LLM export for Gemma 3: the tensorrt backend must refuse it"
    variant, why_not = refused[0]
    settings = "".join(f"\n  {key}: '{value}'" for key, value in variant.items())
    path = write_config(
        tmp_path / "c.yaml",
        f"model:\n  source: hf\n  path: {tiny_gemma3}\ntarget:\n  name: trtllm{settings}\n",
    )
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "architecture Gemma3ForCausalLM is not supported on target trtllm:" in message, message
    assert " ".join(why_not.split()) in message and "(supported there: LlamaForCausalLM" in message


def test_architectures_command_lists_every_family_and_every_refusal():
    result = run_cli("architectures")
    assert result.returncode == 0, result.stderr
    for arch in ARCHITECTURES.values():
        assert arch.name in result.stdout and arch.traits in " ".join(result.stdout.split())
