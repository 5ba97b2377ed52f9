"""Build-config validation: every invalid config names its file, line and field, with no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import BuildConfig, resolved_yaml
from pipeline.errors import ConfigError
from pipeline.models import BUILTIN_MODELS
from pipeline.validation import load_config
from tests.conftest import REPO, run_cli, write_config

INVALID = {
    "seq_shorter_than_input": ("build:\n  max_input_len: 512\n  max_seq_len: 256\n", "build.max_seq_len", 3),
    "fp8_weights_on_cpu": ("quantization:\n  weights: fp8\n", "quantization.weights", 2),
    "fp8_kv_on_cpu": ("quantization:\n  kv_cache: fp8\n", "quantization.kv_cache", 2),
    "fp8_fmha_without_fp8": (
        "target:\n  name: trtllm\n  trtllm_backend: tensorrt\nbuild:\n  use_fp8_context_fmha: true\n",
        "build.use_fp8_context_fmha",
        5,
    ),
    "kv_quant_without_paged": (
        "target:\n  name: trtllm\n  trtllm_backend: tensorrt\nquantization:\n  kv_cache: int8\nbuild:\n"
        "  kv_cache_type: continuous\n",
        "quantization.kv_cache",
        5,
    ),
    "continuous_kv_on_pytorch": (
        "target:\n  name: trtllm\nbuild:\n  kv_cache_type: continuous\n",
        "build.kv_cache_type",
        4,
    ),
    "pytorch_backend_before_1_0": (
        "target:\n  name: trtllm\n  trtllm_version: '0.19'\n",
        "target.trtllm_version",
        3,
    ),
    "tp_not_dividing_heads": ("target:\n  name: trtllm\nparallel:\n  tp_size: 2\n", "parallel.tp_size", 4),
    "pp_not_dividing_layers": ("target:\n  name: trtllm\nparallel:\n  pp_size: 4\n", "parallel.pp_size", 4),
    "awq_without_calibration": (
        "target:\n  name: trtllm\nquantization:\n  weights: int4\n  method: awq\n",
        "quantization.calibration",
        3,
    ),
    "gptq_at_8_bits_on_cpu": (
        "quantization:\n  weights: int8\n  method: gptq\n  calibration: {num_samples: 8}\n",
        "quantization.method",
        3,
    ),
    "gptq_without_calibration_on_cpu": (
        "quantization:\n  weights: int4\n  method: gptq\n",
        "quantization.calibration",
        1,
    ),
    "calibration_for_rtn_on_cpu": (
        "quantization:\n  weights: int8\n  calibration: {num_samples: 8}\n",
        "quantization.calibration",
        3,
    ),
    "calibration_text_missing": (
        "quantization:\n  weights: int4\n  group_size: 32\n  method: gptq\n  calibration: {text: no/such.txt}\n",
        "quantization.calibration.text",
        5,
    ),
    "gptq_options_for_rtn": ("quantization:\n  weights: int4\n  gptq: {desc_act: true}\n", "quantization.gptq", 3),
    "smoothquant_at_4_bits_on_cpu": (
        "quantization:\n  weights: int4\n  method: smoothquant\n  calibration: {num_samples: 8}\n",
        "quantization.method",
        3,
    ),
    "smoothquant_without_calibration_on_cpu": (
        "quantization:\n  weights: int8\n  method: smoothquant\n",
        "quantization.calibration",
        1,
    ),
    "smoothquant_options_for_rtn": (
        "quantization:\n  weights: int8\n  smoothquant: {alpha: 0.6}\n",
        "quantization.smoothquant",
        3,
    ),
    "smoothquant_alpha_above_one": (
        "quantization:\n  weights: int8\n  method: smoothquant\n  calibration: {num_samples: 8}\n"
        "  smoothquant: {alpha: 1.5}\n",
        "quantization.smoothquant.alpha",
        5,
    ),
    "smoothquant_on_the_optimum_graph": (
        "target:\n  onnx_graph: optimum\nquantization:\n  weights: int8\n  method: smoothquant\n"
        "  calibration: {num_samples: 8}\n",
        "quantization.method",
        5,
    ),
    "module_group_size_not_a_block": (
        "quantization:\n  weights: int8\n  module_group_sizes: {lm_head: 48}\n",
        "quantization.module_group_sizes.lm_head",
        3,
    ),
    "module_group_sizes_with_gptq": (
        "quantization:\n  weights: int4\n  method: gptq\n  calibration: {num_samples: 8}\n"
        "  module_group_sizes: {lm_head: 64}\n",
        "quantization.module_group_sizes",
        5,
    ),
    "compressed_tensors_of_a_float_model": (
        "quantization:\n  weights: int4\n  method: compressed-tensors\n",
        "quantization.method",
        3,
    ),
    "dequantizing_a_float_model": (
        "quantization:\n  checkpoint_quantization: dequantize\n",
        "quantization.checkpoint_quantization",
        2,
    ),
    "unknown_weights_value": ("quantization:\n  weights: int3\n", "quantization.weights", 2),
    "negative_batch": ("build:\n  max_batch_size: 0\n", "build.max_batch_size", 2),
    "beam_on_cpu": ("build:\n  max_beam_width: 4\n", "build.max_beam_width", 2),
    "reuse_without_paged_fmha": (
        "target:\n  name: trtllm\n  trtllm_backend: tensorrt\nbuild:\n  use_paged_context_fmha: false\nruntime:\n"
        "  enable_kv_cache_reuse: true\n",
        "runtime.enable_kv_cache_reuse",
        7,
    ),
    "num_tokens_below_input": ("build:\n  max_num_tokens: 256\n  max_input_len: 512\n", "build.max_num_tokens", 2),
    "bad_int4_group": ("quantization:\n  weights: int4\n  group_size: 100\n", "quantization.group_size", 3),
    "unsupported_trtllm_version": ("target:\n  name: trtllm\n  trtllm_version: '0.9'\n", "target.trtllm_version", 3),
    "seq_beyond_model_positions": ("build:\n  max_seq_len: 10000\n", "build.max_seq_len", 2),
    "hf_path_missing": ("model:\n  source: hf\n  path: no/such/dir\n", "model.path", 3),
    "wrong_type": ("runtime:\n  kv_cache_free_gpu_mem_fraction: lots\n", "runtime.kv_cache_free_gpu_mem_fraction", 2),
    "bad_int8_group": ("quantization:\n  weights: int8\n  group_size: 100\n", "quantization.group_size", 3),
    "group_without_weights": ("quantization:\n  group_size: 64\n", "quantization.group_size", 2),
    "int8_group_on_trtllm": (
        "target:\n  name: trtllm\nquantization:\n  weights: int8\n  group_size: 64\n",
        "quantization.group_size",
        5,
    ),
    "kv_reuse_on_optimum_graph": (
        "target:\n  onnx_graph: optimum\nruntime:\n  enable_kv_cache_reuse: true\n",
        "runtime.enable_kv_cache_reuse",
        4,
    ),
    "kv_pool_below_one_request": (
        "runtime:\n  max_tokens_in_paged_kv_cache: 1000\n",
        "runtime.max_tokens_in_paged_kv_cache",
        2,
    ),
    "max_utilization_on_cpu": (
        "runtime:\n  batch_scheduler_policy: max_utilization\n",
        "runtime.batch_scheduler_policy",
        2,
    ),
}

# Settings a target would silently ignore: each is a validate error naming the field and the target.
UNHONOURED = {
    "streaming_on_cpu": ("runtime:\n  streaming: false\n", "runtime.streaming", 2, "onnxruntime"),
    "cuda_graphs_on_cpu": ("runtime:\n  cuda_graph_mode: false\n", "runtime.cuda_graph_mode", 2, "onnxruntime"),
    "batching_strategy_on_cpu": ("runtime:\n  batching_strategy: V1\n", "runtime.batching_strategy", 2, "onnxruntime"),
    "plugin_on_cpu": ("build:\n  gemm_plugin: float16\n", "build.gemm_plugin", 2, "onnxruntime"),
    "tp_on_cpu": ("parallel:\n  tp_size: 1\n", "parallel.tp_size", 2, "onnxruntime"),
    "cpu_threads_on_trtllm": (
        "target:\n  name: trtllm\nruntime:\n  cpu_threads: 4\n",
        "runtime.cpu_threads",
        4,
        "trtllm",
    ),
    "onnx_graph_on_trtllm": ("target:\n  name: trtllm\n  onnx_graph: fused\n", "target.onnx_graph", 3, "trtllm"),
    "smoothquant_options_on_trtllm": (
        "target:\n  name: trtllm\n  trtllm_backend: tensorrt\nquantization:\n  weights: int8\n  method: smoothquant\n"
        "  calibration: {num_samples: 8}\n  smoothquant: {alpha: 0.6}\n",
        "quantization.smoothquant.alpha",
        8,
        "trtllm",
    ),
    "module_group_sizes_on_trtllm": (
        "target:\n  name: trtllm\nquantization:\n  weights: int4\n  group_size: 64\n"
        "  module_group_sizes: {lm_head: 128}\n",
        "quantization.module_group_sizes",
        6,
        "trtllm",
    ),
    "engine_plugin_on_pytorch_backend": (
        "target:\n  name: trtllm\nbuild:\n  gemm_plugin: float16\n",
        "build.gemm_plugin",
        4,
        "trtllm",
    ),
    "cuda_graph_cache_on_pytorch_backend": (
        "target:\n  name: trtllm\nruntime:\n  cuda_graph_cache_size: 4\n",
        "runtime.cuda_graph_cache_size",
        4,
        "trtllm",
    ),
}


@pytest.mark.parametrize("name", sorted(UNHONOURED))
def test_a_setting_the_target_would_ignore_is_refused(tmp_path, name):
    body, field, line, target = UNHONOURED[name]
    path = write_config(tmp_path / f"{name}.yaml", body)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    matching = [p for p in info.value.problems if f": {field}: is not honoured by target {target}" in p]
    assert matching and matching[0].startswith(f"{path}:{line}"), info.value.problems
    assert len(info.value.problems) == 1, info.value.problems  # no second, overlapping rule


def test_every_config_field_is_honoured_by_some_target():
    from pipeline.config import leaf_field_paths
    from pipeline.targets import TARGETS, honoured

    orphans = [f for f in leaf_field_paths(BuildConfig) if not any(honoured(f, t.honours) for t in TARGETS.values())]
    assert not orphans, f"fields no target reads: {orphans}"


def test_head_size_honours_head_dim():
    from pipeline.models import ModelFacts

    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 100,
        "max_position_embeddings": 64,
    }
    assert ModelFacts.from_hf_config(config).head_size == 64
    assert ModelFacts.from_hf_config({**config, "head_dim": 128}).head_size == 128


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_config_names_file_line_and_field(tmp_path, name):
    body, field, line = INVALID[name]
    path = write_config(tmp_path / f"{name}.yaml", body)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    matching = [p for p in info.value.problems if f": {field}: " in p]
    assert matching, info.value.problems
    assert matching[0].startswith(f"{path}:{line}"), matching[0]


def test_every_error_is_reported_not_just_the_first(tmp_path):
    path = write_config(
        tmp_path / "many.yaml",
        """
        quantization:
          weights: fp8
          kv_cache: fp8
        build:
          max_input_len: 512
          max_seq_len: 256
          max_beam_width: 2
    """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    fields = " ".join(info.value.problems)
    for field in ("quantization.weights", "quantization.kv_cache", "build.max_seq_len", "build.max_beam_width"):
        assert field in fields


@pytest.mark.parametrize(
    "typo,suggestion",
    [("max_batchsize", "max_batch_size"), ("tokens_per_blok", "tokens_per_block"), ("kv_cache_typ", "kv_cache_type")],
)
def test_unknown_key_gets_did_you_mean(tmp_path, typo, suggestion):
    path = write_config(tmp_path / "typo.yaml", f"build:\n  {typo}: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}:2: build.{typo}: unknown key")
    assert f"did you mean '{suggestion}'" in problem


def test_unknown_section_lists_known_sections(tmp_path):
    path = write_config(tmp_path / "section.yaml", "quantisation:\n  weights: int8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "did you mean 'quantization'" in info.value.problems[0]


def test_relative_model_path_resolves_against_config_file(tmp_path, tiny_llama):
    sub = tmp_path / "configs"
    sub.mkdir()
    path = write_config(sub / "tiny.yaml", "model:\n  source: hf\n  path: ../model\n")
    (tmp_path / "model").symlink_to(tiny_llama)
    cfg = load_config(path)
    assert cfg.resolve_path(cfg.model.path) == tiny_llama.resolve()
    assert cfg.model_facts().num_key_value_heads == 2


def test_overrides_apply_and_are_validated(tmp_path):
    path = write_config(tmp_path / "c.yaml", "build:\n  max_batch_size: 4\n")
    assert load_config(path, ["build.max_batch_size=16"]).build.max_batch_size == 16
    with pytest.raises(ConfigError):
        load_config(path, ["build.max_batch_size=-1"])


@pytest.mark.parametrize("config", sorted((REPO / "build_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(config, tmp_path):
    import yaml

    from tests.targets.test_trtllm import llama_shape

    model = yaml.safe_load(config.read_text()).get("model", {})
    overrides = []
    if (
        model.get("source") == "hf" and not Path(model["path"]).exists()
    ):  # a GPU example: the checkpoint is downloaded by the user
        overrides = [f"model.path={llama_shape(tmp_path, '70b' if '70b' in config.name else '8b')}"]
    adapters = (yaml.safe_load(config.read_text()).get("lora") or {}).get("adapters", [])
    if any(not (config.parent / a["path"]).exists() for a in adapters):  # trained here (make lora-adapters)
        listed = ", ".join(f"{{name: {a['name']}, path: {smollm2_adapter(tmp_path / a['name'])}}}" for a in adapters)
        overrides.append(f"lora.adapters=[{listed}]")
    cfg = load_config(config, overrides)
    assert isinstance(cfg, BuildConfig)
    assert "# default" in resolved_yaml(cfg) or cfg.model_fields_set


def smollm2_adapter(path: Path) -> Path:
    """A PEFT LoRA adapter directory of SmolLM2-135M's shapes (rank 8 on the first layer's q_proj), zeros."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": np.zeros((8, 576), np.float32),
            f"{prefix}.lora_B.weight": np.zeros((576, 8), np.float32),
        },
        str(path / "adapter_model.safetensors"),
    )
    return path


def test_validate_cli_prints_resolved_config_with_defaults():
    result = run_cli("validate", "build_configs/smollm2-135m-cpu.yaml")
    assert result.returncode == 0, result.stderr
    assert "kv_cache_free_gpu_mem_fraction: 0.9  # default" in result.stdout
    assert "name: onnxruntime" in result.stdout


def test_validate_cli_lists_errors_without_traceback(tmp_path):
    path = write_config(tmp_path / "bad.yaml", "build:\n  max_batchsize: 4\nquantization:\n  weights: fp8\n")
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "did you mean 'max_batch_size'" in result.stderr
    assert f"{path}:4: quantization.weights" in result.stderr


def test_unreadable_or_malformed_yaml_is_a_config_error(tmp_path):
    bad = write_config(tmp_path / "bad.yaml", "build: [unclosed\n")
    for path in (bad, tmp_path / "missing.yaml"):
        result = run_cli("validate", str(path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_builtin_model_facts_match_the_gguf_header(smollm2_gguf):
    from pipeline.models import facts_from_gguf

    assert facts_from_gguf(smollm2_gguf) == BUILTIN_MODELS["smollm2-135m-instruct"].facts


@pytest.mark.parametrize(
    "name", ["../../evil", "/tmp/evil", "a/b", "a\\b", "..", ".", ".hidden", "-x", "", "a b", "x" * 129, "nul\0"]
)
def test_a_triton_model_name_must_be_one_plain_directory_name(tmp_path, name):
    path = write_config(tmp_path / "c.yaml", "triton:\n  preprocessing_name: tokenizer\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [f"triton.ensemble_name={json.dumps(name)}"])
    (problem,) = info.value.problems
    assert problem.startswith(f"{path} (overridden on the command line): triton.ensemble_name: {name!r} is not a valid")
    assert "use 1 to 128 letters, digits" in problem


def test_a_problem_with_a_section_the_command_line_filled_key_by_key_points_at_the_command_line(tmp_path):
    """runtime.speculative set through its keys and refused as a whole is the command line's, not a default."""
    path = REPO / "build_configs/smollm2-135m-fp8.yaml"
    overrides = ["runtime.speculative.type=ngram", "runtime.speculative.max_draft_len=4", 'target.trtllm_version="1.0"']
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path} (overridden on the command line): runtime.speculative: TensorRT-LLM 1.0's")


def test_triton_model_names_may_use_dots_dashes_and_underscores_and_must_differ(tmp_path):
    path = write_config(tmp_path / "c.yaml", "triton:\n  ensemble_name: llm-v1.2\n  bls_name: _bls\n")
    assert load_config(path).triton.ensemble_name == "llm-v1.2"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["triton.postprocessing_name=llm-v1.2"])
    (problem,) = info.value.problems
    assert "triton.postprocessing_name: 'llm-v1.2' is also triton.ensemble_name" in problem


def test_an_override_that_is_not_yaml_is_named(tmp_path):
    path = write_config(tmp_path / "c.yaml", "build:\n  max_batch_size: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["build.max_batch_size=[1,", "runtime.streaming=true"])
    assert info.value.path == "command line"
    (problem,) = info.value.problems
    assert problem.startswith("override 'build.max_batch_size=[1,': the value is not valid YAML (")
    result = run_cli("validate", str(path), "build.max_batch_size=[1,")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # rich markup must not swallow the bracketed example in the fix
    assert "quantization.exclude_modules=[lm_head]" in " ".join(result.stderr.split())


def test_an_invalid_value_set_in_the_file_is_located_at_its_line_not_called_a_default(tmp_path):
    """List items and mapping keys set in the file were reported at their section's line as "(default, not set in
    file)"; a dropped value's follow-up error ("Field required") was listed again."""
    path = write_config(
        tmp_path / "c.yaml",
        """
        quantization:
          exclude_modules:
            - lm_head
            - 7
        runtime:
          speculative: {type: lookahead, max_draft_len: 2}
        deploy:
          node_selector:
            "bad key": gpu
          tolerations:
            - key: nvidia.com/gpu
            - key: [1]
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.split(": ")[0:2] for p in info.value.problems] == [
        [f"{path}:4", "quantization.exclude_modules.1"],
        [f"{path}:6", "runtime.speculative.type"],
        [f"{path}:9", "deploy.node_selector.bad key.[key]"],
        [f"{path}:12", "deploy.tolerations.1.key"],
    ], info.value.problems
    assert "(default, not set in file)" not in str(info.value)


def test_a_source_tree_that_was_never_installed_is_named_not_an_empty_choice_of_targets():
    """Run from a checkout on PYTHONPATH (as on a GPU machine without pip access), the package's metadata declares
    no entry points; the config's target choice would be `Literal[()]`, which pydantic refuses with an assertion."""
    from pipeline.errors import PipelineError
    from pipeline.plugins import TARGETS_GROUP, declared

    assert [entry.name for entry in declared(TARGETS_GROUP)] == ["onnxruntime", "trtllm"]
    with pytest.raises(PipelineError, match=r"not installed.*pip install -e .*rather than putting it on PYTHONPATH"):
        declared("trtllm_pipeline.no_such_group")
