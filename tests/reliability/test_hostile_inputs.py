"""What a hostile (or careless) user hands `validate` and `deploy`: files that are no files, YAML that explodes,
checkpoints whose sizes lie, values of megabytes. Each is refused at once, with file, field and fix, and no
traceback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from pipeline.config import DeploySection
from pipeline.errors import ConfigError
from pipeline.models import checkpoint_problems
from pipeline.validation import load_config
from tests.conftest import run_cli, spawn_cli, write_config

# A CLI start (imports, the config, the checks) takes seconds on a loaded machine; a hang or a minute-long parse is
# what these tests catch.
PROMPT_SECONDS = 30


def timed_cli(*args: str):
    start = time.monotonic()
    result = spawn_cli(*args, timeout=120)  # a subprocess: a hang is caught by the timeout
    return result, time.monotonic() - start


def test_a_fifo_as_the_gguf_path_is_refused_at_once(tmp_path):
    """The reproduction as found: `validate` blocked for ever reading the GGUF header from the FIFO."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: gguf\n  path: {fifo}\n")
    result, seconds = timed_cli("validate", str(config))
    assert result.returncode == 2 and seconds < PROMPT_SECONDS, (seconds, result.stdout + result.stderr)
    message = " ".join(result.stderr.split())
    assert f"{config}:3: model.path: {fifo} is a FIFO (named pipe), not a regular file" in message, message
    assert "Traceback" not in result.stderr


def unix_socket(tmp_path: Path) -> Path:
    """A Unix socket's file (the socket closes; its file stays a socket)."""
    path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))  # pytest's tmp_path stays within the 108 bytes a socket's path may have
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("source", "make", "what"),
    [
        ("gguf", lambda tmp: Path("/dev/zero"), "is a character device, not a regular file"),
        ("gguf", lambda tmp: tmp, "is a directory, not a regular file"),
        ("gguf", unix_socket, "is a socket, not a regular file"),
        ("hf", lambda tmp: (os.mkfifo(tmp / "fifo"), tmp / "fifo")[1], "is a FIFO (named pipe), not a directory"),
        ("hf", lambda tmp: Path("/dev/zero"), "is a character device, not a directory"),
        ("gguf", lambda tmp: (os.symlink("loop", tmp / "loop"), tmp / "loop")[1], "is a symlink loop"),
        ("hf", lambda tmp: (os.symlink("loop", tmp / "loop"), tmp / "loop")[1], "is a symlink loop"),
        ("gguf", lambda tmp: tmp / "missing.gguf", "does not exist"),
    ],
    ids=["dev-zero", "directory", "socket", "fifo-as-hf", "dev-zero-as-hf", "loop-gguf", "loop-hf", "missing"],
)
def test_a_model_path_that_is_no_regular_file_is_named_for_what_it_is(tmp_path, source, make, what):
    path = make(tmp_path)
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: {source}\n  path: {path}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert any(p.startswith(f"{config}:3: model.path: ") and what in p for p in info.value.problems), info.value


@pytest.mark.timeout(60)
def test_a_fifo_config_json_in_the_checkpoint_is_not_opened(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    (problem,) = checkpoint_problems("hf", tmp_path)
    assert f"{tmp_path / 'config.json'} is a FIFO (named pipe), not a regular file" in problem


@pytest.mark.timeout(60)
def test_a_config_file_that_is_no_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    for path, what in ((fifo, "is a FIFO (named pipe)"), (Path("/dev/zero"), "is a character device")):
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert what in info.value.problems[0]


def alias_bomb(levels: int) -> str:
    """`levels` anchors inside one typed field, each a list of nine aliases of the one before: 9**levels strings."""
    lists = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lists += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "verify:\n  eval_text: [" + ", ".join(lists) + "]\n"


def test_a_yaml_alias_bomb_is_refused_before_anything_reads_it(tmp_path):
    """A 2.4 KB file made `validate` print 104 MB: every error repeated the expanded value, x9 per level."""
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb(9))
    assert config.stat().st_size < 2600
    result, seconds = timed_cli("validate", str(config))
    assert result.returncode == 2 and seconds < PROMPT_SECONDS, (seconds, result.stderr[:2000])
    assert len(result.stdout + result.stderr) < 2000, result.stderr[:2000]
    assert "at most 10,000 may come from aliases" in " ".join(result.stderr.split())


def test_aliases_that_expand_little_are_fine_and_a_recursive_one_is_refused(tmp_path):
    modest = write_config(
        tmp_path / "modest.yaml",
        """
        quantization:
          weights: int4
          group_size: 64
          exclude_modules: &kept [lm_head]
          int8_modules: *kept
        """,
    )
    assert load_config(modest).quantization.int8_modules == ["lm_head"]
    recursive = write_config(tmp_path / "recursive.yaml", "quantization:\n  exclude_modules: &a [*a]\n")
    with pytest.raises(ConfigError) as info:
        load_config(recursive)
    assert "an alias refers to a node that contains it" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        load_config(modest, [f"quantization.exclude_modules={alias_bomb(6).split('eval_text: ')[1]}"])
    assert "at most 10,000 may come from aliases" in info.value.problems[0]


def test_echoed_values_and_the_list_of_errors_are_bounded(tmp_path):
    name = "x" * 100_000
    config = write_config(tmp_path / "c.yaml", f"model:\n  name: {name}\ntriton:\n  ensemble_name: {name}/\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert len(info.value.problems) == 2 and all(len(p) < 1000 for p in info.value.problems), info.value
    assert all("(100,001 characters)" in p or "(100,000 characters)" in p for p in info.value.problems)
    many = write_config(tmp_path / "many.yaml", f"quantization:\n  exclude_modules: {list(range(500))}\n")
    with pytest.raises(ConfigError) as info:
        load_config(many)
    assert len(info.value.problems) == 51 and info.value.problems[-1] == "... and 450 more problem(s) not listed"
    assert str(info.value).startswith(f"{many}: 500 problem(s)")


def test_a_50_mb_config_is_refused_without_being_parsed(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name: {'x' * 50_000_000}\n")
    result, seconds = timed_cli("validate", str(config))
    assert result.returncode == 2 and seconds < PROMPT_SECONDS, seconds
    assert len(result.stderr) < 1000 and "is 50,000,016 bytes; a build config is at most 262,144" in result.stderr


def test_a_million_node_selector_keys_are_refused_in_seconds(tmp_path):
    keys = {f"k{i}": "v" for i in range(1_000_000)}
    start = time.monotonic()
    with pytest.raises(ValueError, match="at most 100 items"):
        DeploySection.model_validate({"node_selector": keys})
    assert time.monotonic() - start < 2
    config = tmp_path / "c.yaml"
    config.write_text("deploy:\n  node_selector:\n" + "".join(f"    {k}: v\n" for k in keys))
    result, seconds = timed_cli("validate", str(config))
    assert result.returncode == 2 and seconds < PROMPT_SECONDS and "a build config is at most" in result.stderr


@pytest.mark.parametrize(
    ("override", "field", "rule"),
    [
        (f"deploy.namespace={'n' * 64}", "deploy.namespace", "is not a DNS-1123 label"),
        ("deploy.namespace=a.b", "deploy.namespace", "is not a DNS-1123 label"),
        ('deploy.node_selector={"bad key": v}', "deploy.node_selector.bad key.[key]", "is not a label key"),
        ('deploy.node_selector={"a/b/c": v}', "deploy.node_selector.a/b/c.[key]", "is not a DNS-1123 subdomain"),
        (f"deploy.node_selector={{{'k' * 64}: v}}", f"deploy.node_selector.{'k' * 64}.[key]", "is not a label name"),
        ('deploy.node_selector={gpu: "-a100"}', "deploy.node_selector.gpu", "is not a label value"),
        (f"deploy.node_selector={{gpu: {'v' * 64}}}", "deploy.node_selector.gpu", "is not a label value"),
        ('deploy.tolerations=[{key: "nvidia.com/gpu!"}]', "deploy.tolerations.0.key", "is not a label key"),
        ('deploy.tolerations=[{key: a, value: "x y"}]', "deploy.tolerations.0.value", "is not a label value"),
    ],
)
def test_deploy_names_and_labels_breaking_the_kubernetes_rules_are_refused(tmp_path, override, field, rule):
    config = write_config(tmp_path / "c.yaml", "deploy:\n  replicas: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, [override])
    (problem,) = info.value.problems
    assert f": {field}: " in problem and rule in problem, problem


def test_good_kubernetes_names_and_labels_pass(tmp_path):
    config = write_config(
        tmp_path / "c.yaml",
        f"""
        deploy:
          namespace: {"n" * 63}
          node_selector: {{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, kubernetes.io/os: linux, empty: ""}}
          tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
        """,
    )
    assert load_config(config).deploy.node_selector["empty"] == ""


@pytest.fixture
def tiny_copy(tmp_path, tiny_llama):
    """A writable copy of the tiny Llama checkpoint: (directory, its config.json's contents)."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    return model, json.loads((model / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 2.5}, "num_hidden_layers is 2.5, not a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0, not a positive integer"),
        ({"hidden_size": -64}, "hidden_size is -64, not a positive integer"),
        ({"intermediate_size": 9e9}, "intermediate_size is 9000000000.0, not a positive integer"),
        ({"vocab_size": True}, "vocab_size is True, not a positive integer"),
    ],
    ids=["fractional-layers", "zero-heads", "negative", "float", "bool"],
)
def test_config_json_sizes_must_be_positive_integers(tiny_copy, tmp_path, change, message):
    """Without --debug, 2.5 layers was a TypeError traceback and 0 heads a division by zero (trtllm) or 'valid'."""
    model, hf_config = tiny_copy
    (model / "config.json").write_text(json.dumps({**hf_config, **change}))
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    for target in ("onnxruntime", "trtllm"):
        result = run_cli("validate", str(config), f"target.name={target}")
        error = " ".join(result.stderr.split())
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"model.path: {model / 'config.json'}: {message}" in error, error


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"vocab_size": 10**9},
            "vocab_size 1000000000 and hidden_size 64 disagree with the weights: model.embed_tokens.weight in "
            "model.safetensors is [253, 64]",
        ),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000 but model.safetensors hold tensors of 2 layers"),
        (
            {"intermediate_size": 9 * 10**9},
            "hidden_size 64 and intermediate_size 9000000000 disagree with the weights: "
            "model.layers.0.mlp.down_proj.weight in model.safetensors is [64, 128]",
        ),
        ({"head_dim": 10**6}, "its sizes make 1,536,065,344 parameters (the memory plan's count) but"),
    ],
    ids=["vocab", "layers", "intermediate", "head-dim"],
)
def test_config_json_sizes_must_agree_with_the_safetensors_headers(tiny_copy, tmp_path, change, message):
    """`validate` said "valid" and the import then tried to allocate terabytes."""
    model, hf_config = tiny_copy
    (model / "config.json").write_text(json.dumps({**hf_config, **change}))
    config = write_config(tmp_path / "c.yaml", f"model:\n  source: hf\n  path: {model}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    expected = f"{config}:3: model.path: {model / 'config.json'}: {message}"
    assert any(p.startswith(expected) and "fix config.json" in p for p in info.value.problems), info.value


def tiny_gguf(path: Path, block_count: int = 2, layers: int = 2, vocab: int = 32, hidden: int = 8) -> Path:
    """A llama GGUF whose header says `block_count` and `vocab`, holding `layers` layers of a [32, 8] embedding."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_context_length(64)
    writer.add_vocab_size(vocab)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header_sizes_must_agree_with_its_tensor_infos(tmp_path):
    assert checkpoint_problems("gguf", tiny_gguf(tmp_path / "ok.gguf")) == []
    layers = tiny_gguf(tmp_path / "layers.gguf", block_count=1_000_000)
    (problem,) = checkpoint_problems("gguf", layers)
    assert problem.startswith(f"{layers}: llama.block_count is 1000000 but layers.gguf hold tensors of 2 layers")
    vocab = tiny_gguf(tmp_path / "vocab.gguf", vocab=10**9)
    (problem,) = checkpoint_problems("gguf", vocab)
    expected = "llama.vocab_size 1000000000 and llama.embedding_length 8 disagree with the weights: token_embd.weight"
    assert f"{expected} is [32, 8]; its header contradicts its tensors: convert the model again" in problem
    zero = tiny_gguf(tmp_path / "zero.gguf", block_count=0)
    assert checkpoint_problems("gguf", zero) == [
        f"{zero}: not a valid GGUF: llama.block_count is 0, not a positive integer"
    ]
