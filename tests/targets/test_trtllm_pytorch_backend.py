"""The trtllm target's PyTorch backend on CPU: the unified checkpoint checked against the release's PyTorch loader,
LLM-API options checked against the release's TorchLlmArgs, the Triton llmapi repository, and a clear stop (exit 4,
with the exact commands) where a GPU is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.errors import ConfigError
from pipeline.targets.trtllm import gpu_memory
from pipeline.targets.trtllm.backend import BACKENDS
from pipeline.targets.trtllm.guided import GUIDED_DECODING_BACKEND
from pipeline.targets.trtllm.llm_api_options import options_problems
from pipeline.targets.trtllm.llm_api_serving import OPTIONS_FILE
from pipeline.targets.trtllm.pytorch_backend import (
    cuda_graph_batch_sizes,
    options_yaml,
    release_features,
    release_options,
)
from pipeline.targets.trtllm.repo_checks import model_checks
from pipeline.targets.trtllm.triton_llmapi_model import llmapi_model
from pipeline.triton.validate import validate_repo
from pipeline.upstream import facts
from pipeline.validation import load_config
from tests.conftest import run_cli, slow_fixture, spawn_cli, write_config
from tests.runtime.test_multi_lora import make_adapter

RELEASES = ("1.0", "1.2")


def pytorch_config(tmp_path: Path, tiny_llama: Path, release: str, extra: str = "") -> Path:
    return write_config(
        tmp_path / f"pytorch-{release}.yaml",
        f"""
        model: {{source: hf, path: {tiny_llama}}}
        target: {{name: trtllm, trtllm_backend: pytorch, trtllm_version: "{release}"}}
        quantization: {{weights: fp8, kv_cache: fp8, calibration: {{num_samples: 4, seq_len: 32}}}}
        build: {{max_batch_size: 12, max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024}}
        runtime: {{enable_kv_cache_reuse: true, enable_chunked_context: true}}
        verify: {{eval_tokens: 256, max_perplexity_increase: 0.5}}
        {extra}
    """,
    )


@slow_fixture(scope="module")
def built(tmp_path_factory, tiny_llama, calibrated):
    """The tiny Llama built by the real CLI for 1.0 and 1.2: FP8 weights and KV cache, to the end."""
    out = {}
    for release in RELEASES:
        root = tmp_path_factory.mktemp(f"pytorch-{release}")
        config = pytorch_config(root, tiny_llama, release)
        calibrated(config, root / "out")
        result = run_cli("build", str(config), "--output", str(root / "out"))
        out[release] = (root / "out", result)
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_the_build_runs_to_the_end_without_a_gpu(built, release):
    output, result = built[release]
    assert result.returncode == 0, result.stderr[-3000:]
    engine = output / "engine"
    record = json.loads((engine / "config.json").read_text())
    assert (record["backend"], record["trtllm_version"]) == ("pytorch", release)
    assert (engine / "model" / "hf_quant_config.json").is_file()
    assert (engine / "model" / "tokenizer.json").is_file()
    assert not list(engine.glob("*.engine")), "the PyTorch backend has no engine to fake"
    assert not (output / "export" / "trtllm_checkpoint").exists(), "only the checkpoint it deploys is exported"


def test_a_runtime_knob_the_options_hold_rebuilds_them(built):
    output, _ = built["1.2"]
    config = next(output.parent.glob("pytorch-*.yaml"))
    result = run_cli(
        "plan", str(config), "runtime.kv_cache_free_gpu_mem_fraction=0.5", "--json", "--output", str(output)
    )
    assert result.returncode == 0, result.stderr
    status = {row["stage"]: row["status"] for row in json.loads(result.stdout)}
    assert status["export"] == "up to date" and status["engine"] == "will run", status


@pytest.mark.parametrize("release", RELEASES)
def test_every_generated_option_is_a_field_of_the_releases_torch_llm_args(built, release):
    output, _ = built[release]
    options = yaml.safe_load((output / "engine" / OPTIONS_FILE).read_text())
    assert options_problems(options, release) == []
    assert options["max_batch_size"] == 12
    assert options["kv_cache_config"]["dtype"] == "fp8"
    assert options["kv_cache_config"]["enable_block_reuse"] is True
    assert options["enable_chunked_prefill"] is True
    assert options["cuda_graph_config"]["batch_sizes"] == [1, 2, 4, 8, 12]
    assert options["scheduler_config"]["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"


@pytest.mark.parametrize("release", RELEASES)
def test_the_llmapi_repository_is_valid_for_its_release(built, release):
    output, _ = built[release]
    repo = output / "triton_repo"
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble", "tensorrt_llm"]
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists(), "model.py comes from NVIDIA's container"
    report = validate_repo(repo, model_checks(release))
    assert report.problems == []
    spec = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert spec["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert spec["model"] == str((output / "engine" / "model").resolve())
    upstream = {row["name"] for row in llmapi_model(release)["config"]["inputs"]}
    assert {t.name for t in report.models["tensorrt_llm"].input} == upstream


def test_validate_repo_catches_a_key_the_release_lacks(built, tmp_path):
    import shutil

    output, _ = built["1.2"]
    repo = tmp_path / "repo"
    shutil.copytree(output / "triton_repo", repo)
    model_yaml = repo / "tensorrt_llm" / "1" / "model.yaml"
    spec = yaml.safe_load(model_yaml.read_text())
    spec["kv_cache_config"]["no_such_knob"] = 1
    spec["triton_config"]["decoupled"] = "false"
    model_yaml.write_text(yaml.safe_dump(spec))
    problems = "\n".join(validate_repo(repo, model_checks("1.2")).problems)
    assert "no_such_knob" in problems and "1.2" in problems
    assert "triton_config.decoupled" in problems
    spec["model"] = str(tmp_path / "elsewhere")  # a hand-made repository: no release recorded by our build
    model_yaml.write_text(yaml.safe_dump(spec))
    assert "pass --trtllm-version" in "\n".join(validate_repo(repo, model_checks(None)).problems)


@pytest.mark.no_gpu
def test_serve_stops_with_exit_4_and_the_exact_commands(built):
    output, _ = built["1.2"]
    result = spawn_cli("serve", str(output / "triton_repo"))
    assert result.returncode == 4, result.stderr
    message = result.stdout + result.stderr
    assert "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in message
    assert f"trtllm-serve {(output / 'engine' / 'model').resolve()}" in message
    assert "/app/all_models/llmapi/tensorrt_llm/1/" in message


@pytest.mark.no_gpu
def test_run_stops_with_exit_4(built):
    output, _ = built["1.2"]
    result = run_cli("run", str(output / "engine"), "-p", "w1 w2")
    assert result.returncode == 4, result.stderr
    assert "PyTorch backend" in result.stdout + result.stderr


def test_plan_prints_the_serve_commands(tmp_path, tiny_llama):
    result = run_cli("plan", str(pytorch_config(tmp_path, tiny_llama, "1.2")), "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "trtllm-serve" in result.stdout and "26.07-trtllm-python-py3" in result.stdout


def test_engine_build_flags_are_refused_with_the_backend_that_reads_them(tmp_path, tiny_llama):
    path = pytorch_config(tmp_path, tiny_llama, "1.2", "")
    path.write_text(path.read_text().replace("max_num_tokens: 1024}", "max_num_tokens: 1024, gemm_plugin: float16}"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert "build.gemm_plugin" in problem and "target.trtllm_backend: tensorrt" in problem


def test_cuda_graph_batch_sizes_reach_max_batch_size():
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert cuda_graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_options_carry_every_setting_for_both_releases(tmp_path, tiny_llama):
    for release in RELEASES:
        cfg = load_config(pytorch_config(tmp_path, tiny_llama, release, "parallel: {tp_size: 2}"))
        options, problems = release_options(cfg)
        assert problems == []
        assert options["tensor_parallel_size"] == 2
        assert options["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        # kv_cache_config.tokens_per_block is an LLM-API option from 1.1 on (tabulated llm_args.py)
        (
            "build: {max_batch_size: 12, max_input_len: 256, max_seq_len: 512, max_num_tokens: 1024, "
            "tokens_per_block: 64}",
            "build.tokens_per_block",
            "TensorRT-LLM 1.0's LLM API has no option kv_cache_config.tokens_per_block",
        ),
        (
            "quantization: {weights: int8, method: smoothquant, calibration: {}}",
            "quantization.weights",
            "TensorRT-LLM 1.0's PyTorch backend cannot load W8A8_SQ_PER_CHANNEL",
        ),
        ("quantization: {weights: int8}", "quantization.weights", "TensorRT-LLM 1.0's PyTorch backend loads W8A16"),
    ],
)
def test_what_the_targeted_release_lacks_is_a_validate_error_naming_field_and_release(
    tmp_path, tiny_llama, extra, field, says
):
    path = pytorch_config(tmp_path, tiny_llama, "1.0")
    section = extra.split(":")[0]
    kept = [line for line in path.read_text().splitlines() if not line.startswith(f"{section}:")]
    path.write_text("\n".join([*kept, extra]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(f": {field}: " in p and says in p for p in info.value.problems), info.value.problems
    if field == "build.tokens_per_block":  # the same setting is an option in 1.2
        load_config(path, ["target.trtllm_version=1.2"])


# ---------------------------------------------------------------- feature pairs a release cannot run (issue #48)

FEATURE_RELEASES = ("1.0", "1.1", "1.2")
RUNTIME = "runtime: {enable_kv_cache_reuse: true, enable_chunked_context: true}"


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> Path:
    return make_adapter(
        tiny_llama, tmp_path_factory.mktemp("adapter") / "every", 3, r=4, target_modules=["q_proj", "v_proj"]
    )


def feature_config(tmp_path: Path, tiny_llama: Path, release: str, runtime: str = "", lora: Path | None = None):
    """The pytorch config of `release` with extra runtime settings and, given an adapter, a lora section."""
    path = pytorch_config(tmp_path, tiny_llama, release)
    text = path.read_text().replace(RUNTIME, RUNTIME[:-1] + (f", {runtime}}}" if runtime else "}"))
    if lora is not None:
        text += f"lora:\n  max_lora_rank: 4\n  adapters: [{{name: every, path: {lora}}}]\n"
    path.write_text(text)
    return path


@pytest.mark.parametrize("release", FEATURE_RELEASES)
def test_a_lora_config_gets_no_cuda_graphs_where_the_releases_graph_replay_carries_no_lora(
    tmp_path, tiny_llama, adapter, release, monkeypatch
):
    """LoRA with runtime.cuda_graph_mode left at its default: cuda_graph_config is null in the options file, and the
    memory plan reserves no graph pool; the same config without lora keeps its graphs."""
    assert not release_features(release)["lora_with_cuda_graph"]["supported"]
    cfg = load_config(feature_config(tmp_path, tiny_llama, release, lora=adapter))
    options, problems = release_options(cfg)
    assert problems == [] and options_problems(options, release) == []
    assert options["cuda_graph_config"] is None and options["lora_config"]["max_lora_rank"] == 4
    text = options_yaml(cfg, options)
    assert "\ncuda_graph_config: null\n" in text and yaml.safe_load(text) == options
    planned = []
    monkeypatch.setattr(
        gpu_memory, "plan_memory", lambda cfg, facts, cuda_graph_batch=0: planned.append(cuda_graph_batch)
    )
    BACKENDS["pytorch"].memory_plan(cfg, None)
    plain = load_config(pytorch_config(tmp_path, tiny_llama, release))
    BACKENDS["pytorch"].memory_plan(plain, None)
    assert planned == [0, plain.build.max_batch_size]
    assert release_options(plain)[0]["cuda_graph_config"]["batch_sizes"] == cuda_graph_batch_sizes(12)


@pytest.mark.parametrize("release", FEATURE_RELEASES)
def test_lora_with_cuda_graph_mode_set_true_is_refused_naming_release_source_and_fix(
    tmp_path, tiny_llama, adapter, release
):
    path = feature_config(tmp_path, tiny_llama, release, "cuda_graph_mode: true", lora=adapter)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = [p for p in info.value.problems if ": runtime.cuda_graph_mode: " in p]
    assert f"TensorRT-LLM {release}'s PyTorch backend runs no LoRA under CUDA graphs" in problem
    assert "cuda_graph_runner.py@" in problem and "set runtime.cuda_graph_mode: false" in problem
    assert "no tabulated release has it" in problem
    options, problems = release_options(load_config(path, ["runtime.cuda_graph_mode=false"]))  # the fix
    assert problems == [] and options["cuda_graph_config"] is None


SPECULATIVE = "speculative: {type: ngram, max_draft_len: 4}"


@pytest.mark.parametrize("release", FEATURE_RELEASES)
def test_guided_decoding_with_ngram_drafts_is_refused_where_the_release_refuses_the_pair(tmp_path, tiny_llama, release):
    """Guided decoding is always on; runtime.speculative is a validate problem on 1.0, whose executor creation
    raises for any speculative config with a guided decoder, and the options of 1.1 and 1.2 carry both."""
    path = feature_config(tmp_path, tiny_llama, release, SPECULATIVE)
    guided = facts("trtllm_pytorch_features")["releases"][release]["guided_with_speculative"]
    assert ("NGRAM" in guided["allowed_modes"]) == (release != "1.0")
    if release == "1.0":
        with pytest.raises(ConfigError) as info:
            load_config(path)
        (problem,) = [p for p in info.value.problems if ": runtime.speculative: " in p]
        assert f"TensorRT-LLM {release}'s PyTorch backend refuses a guided decoder with NGRAM" in problem
        assert "raises ValueError (BHbean/TensorRT-LLM py_executor_creator.py@22d1bd42)" in problem
        assert "remove runtime.speculative, or target TensorRT-LLM 1.1" in problem and "PR #6948" in problem
        return
    options, problems = release_options(load_config(path))
    assert problems == [] and options_problems(options, release) == []
    assert options["guided_decoding_backend"] == GUIDED_DECODING_BACKEND
    assert options["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}


def test_lora_is_deployed_only_behind_the_gateway_on_one_node_and_on_a_group(tmp_path, tiny_llama, adapter):
    """A deployment's pod (a group's leader as one pod) runs the gateway in front of trtllm-serve; without it
    trtllm-serve alone would face clients and load whatever lora_path a request names, so LoRA is refused there,
    naming the fix."""
    path = feature_config(tmp_path, tiny_llama, "1.2", lora=adapter)
    for shape in ([], ["parallel.tp_size=2", "deploy.gpus_per_node=1"]):
        assert load_config(path, shape).lora is not None  # the gateway (deploy.openai_gateway's default) in front
        with pytest.raises(ConfigError) as info:
            load_config(path, [*shape, "deploy.openai_gateway=false"])
        (problem,) = [p for p in info.value.problems if ": lora: " in p]
        assert "loads whatever lora_path a request names" in problem and "deploy.openai_gateway: true" in problem
