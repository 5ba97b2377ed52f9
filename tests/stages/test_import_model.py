"""Model import: local HF directories are checked file by file; GGUF imports reproduce transformers' logits."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct

import pytest
import torch

from pipeline.stages.import_model import check_hf_dir
from tests.conftest import make_tiny, run_cli, write_config


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_complete_checkpoint_has_no_problems(tiny_llama):
    assert check_hf_dir(tiny_llama) == []


def test_missing_tokenizer_is_named(tmp_path, tiny_llama):
    model = copy_model(tiny_llama, tmp_path / "m")
    (model / "tokenizer.json").unlink()
    assert check_hf_dir(model) == [f"{model}: no tokenizer (expected tokenizer.json or tokenizer.model)"]


def test_missing_shard_listed_in_index_is_named(tmp_path, tiny_llama):
    model = copy_model(tiny_llama, tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}})
    )
    assert any("model-00002-of-00002.safetensors which is missing" in p for p in check_hf_dir(model))


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    model = copy_model(tiny_llama, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (model / "config.json").write_text(json.dumps(config))
    assert any("architectures[0] is 'BertModel'" in p for p in check_hf_dir(model))


def test_tokenizer_larger_than_vocab_fails_the_stage(tmp_path, cli_build):
    """Weights and config.json agree on 100 rows (validate checks that), the tokenizer has 253 tokens."""
    model = make_tiny("LlamaForCausalLM", tmp_path / "m", vocab_size=100)
    config_file = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    result = cli_build(str(config_file), "--output", str(tmp_path / "out"))
    assert result.returncode == 3
    assert "vocab_size is 100" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "import").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_hf_import_copies_each_tensor_in_its_own_dtype_into_one_file(tmp_path, cli_build, tied):
    """A bf16 checkpoint in three shards, built with `model.dtype: float32` (the dtype the stages compute in): the
    import holds the same bf16 bytes in one model.safetensors (a tied lm_head left out, as save_pretrained does),
    and transformers loads it to the same logits as the original."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    source = make_tiny("LlamaForCausalLM", tmp_path / "fp32", tie_word_embeddings=tied)
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(bf16, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(source / name, bf16 / name)
    assert len(list(bf16.glob("*.safetensors"))) >= 3
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {bf16}\n  dtype: float32\n")
    result = cli_build(str(config), "--output", str(tmp_path / "out"), "--until", "import")
    assert result.returncode == 0, result.stderr
    imported_dir = tmp_path / "out" / "import"
    assert [f.name for f in imported_dir.glob("*.safetensors")] == ["model.safetensors"]
    originals = {}
    for file in bf16.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            originals |= {name: f.get_tensor(name) for name in f.keys()}
    with safe_open(imported_dir / "model.safetensors", "pt") as f:
        imported = {name: f.get_tensor(name) for name in f.keys()}
    assert ("lm_head.weight" in imported) is not tied
    assert imported.keys() <= originals.keys()
    for name, tensor in imported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, originals[name]), name
    lock = json.loads((tmp_path / "out" / "build.lock.json").read_text())
    metrics = lock["stages"]["import"]["metrics"]
    original = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    assert metrics["dtype"] == "bfloat16"
    assert metrics["parameters"] == sum(p.numel() for p in original.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(imported_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


def test_gguf_import_matches_transformers_loading_the_gguf(smollm2_build, smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imported_dir = smollm2_build / "import"
    imported = AutoModelForCausalLM.from_pretrained(imported_dir, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(imported_dir)
    ids = tokenizer(
        ["The quick brown fox jumps over the lazy dog.", "To be, or not to be"], return_tensors="pt", padding=True
    )
    with torch.no_grad():
        a = imported(**ids).logits
        b = direct(**ids).logits
    assert torch.equal(a, b)
    # the GGUF header's special tokens win over transformers' import defaults
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer("hi")["input_ids"][0] != tokenizer.bos_token_id
    assert not (imported_dir / "tokenizer.model").exists()


def gguf_with_junk(path):
    """A GGUF's magic, version 3 and plausible tensor/key counts, then random bytes where the header should be."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 272, 30) + random.Random(0).randbytes(4096))
    return path


@pytest.mark.parametrize("verb", ["validate", "build"])
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (gguf_with_junk, "the header ends early or its counts are corrupt"),
        (lambda p: p.write_bytes(random.Random(1).randbytes(4096)) and p, "GGUF magic invalid"),
    ],
    ids=["valid-magic-then-junk", "random-bytes"],
)
def test_a_malformed_gguf_is_named_by_validate_and_build(tmp_path, verb, make, what):
    gguf = make(tmp_path / "model.gguf")
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: gguf\n  path: {gguf}\n")
    result = run_cli(verb, str(config), *(["--output", str(tmp_path / "out")] if verb == "build" else []))
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert f"model.path: {gguf}: not a valid GGUF: {what}" in message and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_truncated_safetensors_is_named_with_its_cut_tensor_by_validate_and_build(tmp_path, tiny_llama):
    model = copy_model(tiny_llama, tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    for args in (["validate"], ["build", "--output", str(tmp_path / "out")]):
        result = run_cli(args[0], str(config), *args[1:])
        assert result.returncode == 2, result.stdout + result.stderr
        message = " ".join(result.stderr.split())
        assert re.search(
            rf"{re.escape(str(weights))}: not a valid safetensors file: truncated: tensor 'model\.[\w.]+' ends at data "
            r"byte \d+, the file holds \d+",
            message,
        ), message
        assert "Traceback" not in result.stderr
    assert check_hf_dir(model) and "truncated" in check_hf_dir(model)[0]


def test_a_tensor_shaped_unlike_the_config_fails_the_import_naming_file_and_tensor(tmp_path, tiny_llama, cli_build):
    from safetensors.numpy import load_file, save_file

    model = copy_model(tiny_llama, tmp_path / "m")
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :100].copy()
    save_file(tensors, weights, metadata={"format": "pt"})
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    assert run_cli("validate", str(config)).returncode == 0  # headers are fine; shapes need the model's layout
    result = cli_build(str(config), "--output", str(tmp_path / "out"), "--until", "import")
    assert result.returncode == 3, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert (
        f"{weights}: tensor model.layers.1.mlp.down_proj.weight has shape [64, 100], but {model / 'config.json'} "
        "makes it [64, 128]" in message
    )
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "import").exists()
