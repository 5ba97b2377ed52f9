"""The trtllm target on CPU: ModelOpt calibration, TensorRT-LLM checkpoints checked for conformance
and quality by a reference forward, and a clear stop where a GPU is needed (no engine is faked)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.targets.trtllm.checkpoint import check_checkpoint
from pipeline.validation import load_config
from tests.conftest import llama_shape, make_tiny_llama, run_cli, slow_fixture, trtllm_config

# (quantization YAML, parallel, quant_algo, kv_cache_quant_algo, max perplexity increase on the tiny model)
CASES = {
    "fp16-tp2-pp2": ("{weights: none}", "{tp_size: 2, pp_size: 2}", None, None),
    "fp8-fp8kv": ("{weights: fp8, kv_cache: fp8}", "{}", "FP8", "FP8"),
    "int8-smoothquant-fp8kv": (
        "{weights: int8, method: smoothquant, kv_cache: fp8, calibration: {num_samples: 8, seq_len: 64}}",
        "{}",
        "W8A8_SQ_PER_CHANNEL",
        "FP8",
    ),
    "int8-weight-only": ("{weights: int8}", "{}", "W8A16", None),
    "int4-awq": (
        "{weights: int4, method: awq, group_size: 32, calibration: {num_samples: 8, seq_len: 64}}",
        "{}",
        "W4A16_AWQ",
        None,
    ),
    "int4-rtn": ("{weights: int4, group_size: 32}", "{}", "W4A16_AWQ", None),
    "w4a8-awq": (
        "{weights: int4, method: w4a8_awq, group_size: 32, calibration: {num_samples: 8, seq_len: 64}}",
        "{}",
        "W4A8_AWQ",
        None,
    ),
    "fp8-recipe": (
        "{weights: fp8, kv_cache: fp8, modelopt_recipe: general/ptq/fp8_default-kv_fp8}",
        "{}",
        "FP8",
        "FP8",
    ),
    "fp8-tp2": ("{weights: fp8, kv_cache: fp8}", "{tp_size: 2}", "FP8", "FP8"),
    "int8-smoothquant-tp2": (
        "{weights: int8, method: smoothquant, calibration: {num_samples: 8, seq_len: 64}}",
        "{tp_size: 2}",
        "W8A8_SQ_PER_CHANNEL",
        None,
    ),
}


def gpu_config(tmp_path: Path, tiny_llama: Path, quantization: str, parallel: str = "{}") -> Path:
    return trtllm_config(tmp_path / "gpu.yaml", tiny_llama, quantization, parallel, release="0.19")


# W4A8 linears pad to a multiple of 128 (TensorRT-LLM quantization/layers.py): its case needs hidden size 128.
WIDE_CASES = {"w4a8-awq"}


@slow_fixture(scope="module")
def built(tmp_path_factory, tiny_llama, calibrated):
    """Every case built by the real CLI up to the engine stage, which must stop for want of a GPU."""
    wide_llama = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), hidden_size=128)
    results = {}
    for name, (quantization, parallel, _, _) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        model = wide_llama if name in WIDE_CASES else tiny_llama
        config = gpu_config(root, model, quantization, parallel)
        calibrated(config, root / "out")
        result = run_cli("build", str(config), "--output", str(root / "out"))
        results[name] = (root, result)
    return results


@pytest.mark.no_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_stage_stops_without_gpu_naming_the_command(built, case):
    root, result = built[case]
    assert result.returncode == 4, result.stdout + result.stderr  # target unavailable: no GPU, no trtllm-build
    message = " ".join(result.stderr.split())
    assert (
        "needs the trtllm-build command" in message
        and "/dev/nvidia0" in message
        and "trtllm-build --checkpoint_dir=" in message
    )
    assert not (root / "out" / "engine").exists()  # nothing half-written, no fake engine


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_and_repository_are_built_on_a_gpu(built, case):
    root, result = built[case]
    assert result.returncode == 0, result.stdout + result.stderr
    assert list((root / "out" / "engine").glob("rank*.engine"))
    assert run_cli("validate-repo", str(root / "out" / "triton_repo")).returncode == 0


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_is_exported_and_verified(built, case):
    root, _ = built[case]
    _, _, algo, kv_algo = CASES[case]
    checkpoint = root / "out" / "export" / "trtllm_checkpoint"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == algo and config["quantization"]["kv_cache_quant_algo"] == kv_algo
    assert (
        root / "out" / "export" / "hf_unified" / "config.json"
    ).is_file()  # the unified HF checkpoint, same calibration
    lock = json.loads((root / "out" / "build.lock.json").read_text())["stages"]["export"]["metrics"]
    assert lock["perplexity_increase"] < 0.5 and lock["top1_agreement"] > 0.5
    if algo is None:  # the unquantized checkpoint reproduces the HF logits (fp16 rounding only), across 4 ranks
        assert (
            lock["max_abs_logits_diff"] < 5e-3
            and lock["top1_agreement"] == 1.0
            and len(list(checkpoint.glob("rank*.safetensors"))) == 4
        )


def test_int4_round_to_nearest_checkpoint_is_repaired_to_what_tensorrt_llm_loads(built):
    from safetensors import safe_open

    root, _ = built["int4-rtn"]
    with safe_open(root / "out" / "export" / "trtllm_checkpoint" / "rank0.safetensors", "pt") as f:
        factor = f.get_tensor("transformer.layers.0.mlp.proj.prequant_scaling_factor")
    assert torch.equal(factor, torch.ones_like(factor))


def test_int8_weight_only_checkpoint_has_the_float_weights_tensorrt_llm_quantizes_itself(built, tmp_path):
    """TensorRT-LLM's weight_only_quantize_dict quantizes W8A16 weights that are not int8 and adds their
    per_channel_scale; int8 weights with ModelOpt's weights_scaling_factor would be left without one."""
    from safetensors import safe_open

    root, _ = built["int8-weight-only"]
    checkpoint = root / "out" / "export" / "trtllm_checkpoint"
    with safe_open(checkpoint / "rank0.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("transformer.layers.0.attention.qkv.weight").get_dtype() == "F16"
    assert not any(name.endswith(("weights_scaling_factor", "per_channel_scale")) for name in names)
    assert not (root / "out" / "quantize").exists()  # nothing to calibrate: the loader quantizes
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint, broken)
    name = "transformer.layers.0.mlp.fc.weight"
    _rewrite(broken / "rank0.safetensors", lambda t: t.update({name: t[name].to(torch.int8)}))
    problems = check_checkpoint(broken, root / "out" / "import", load_config(root / "gpu.yaml"))
    assert any(f"{name} is int8, but TensorRT-LLM's loader quantizes W8A16 weights itself" in p for p in problems)


@pytest.fixture
def fp16_checkpoint(built, tmp_path) -> tuple[Path, Path, object]:
    root, _ = built["fp16-tp2-pp2"]
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "out" / "export" / "trtllm_checkpoint", copy)
    return copy, root / "out" / "import", load_config(root / "gpu.yaml")


def _rewrite(file: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


@pytest.mark.parametrize(
    ("tamper", "problem"),
    [
        (
            lambda c: _rewrite(c / "rank1.safetensors", lambda t: t.pop("transformer.layers.0.mlp.gate.weight")),
            "rank1.safetensors: missing transformer.layers.0.mlp.gate.weight (F16 [64, 64])",
        ),
        (
            lambda c: _rewrite(
                c / "rank0.safetensors", lambda t: t.update({"transformer.layers.0.attention.extra": torch.zeros(1)})
            ),
            "rank0.safetensors: stray tensor transformer.layers.0.attention.extra",
        ),
        (
            lambda c: _rewrite(
                c / "rank3.safetensors",
                lambda t: t.update({"lm_head.weight": torch.zeros(126, 64, dtype=torch.float16)}),
            ),
            "rank3.safetensors: lm_head.weight is F16 [126, 64], TensorRT-LLM expects F16 [127, 64]",
        ),
        (
            lambda c: _rewrite(
                c / "rank2.safetensors",
                lambda t: t.update({"transformer.ln_f.weight": t["transformer.ln_f.weight"].float()}),
            ),
            "rank2.safetensors: transformer.ln_f.weight is F32 [64], TensorRT-LLM expects F16 [64]",
        ),
        (
            lambda c: _edit_json(c / "config.json", rotary_base=500000.0),
            "config.json: rotary_base is 500000.0, the model's value is 10000.0",
        ),
        (
            lambda c: _edit_json(c / "config.json", norm_epsilon=1e-6),
            "config.json: norm_epsilon is 1e-06, the model's value is 1e-05",
        ),
        (
            lambda c: _edit_json(c / "config.json", mapping={"world_size": 4, "tp_size": 4, "pp_size": 1}),
            "config.json: mapping is",
        ),
        (
            lambda c: _edit_json(
                c / "config.json", quantization={"quant_algo": None, "kv_cache_quant_algo": None, "bits": 4}
            ),
            "quantization has keys TensorRT-LLM's QuantConfig does not take",
        ),
        (lambda c: (c / "rank3.safetensors").unlink(), "expected rank0..rank3.safetensors for world_size 4"),
    ],
)
def test_conformance_check_catches_what_the_exporter_could_get_wrong(fp16_checkpoint, tamper, problem):
    checkpoint, hf_dir, cfg = fp16_checkpoint
    assert check_checkpoint(checkpoint, hf_dir, cfg) == []
    tamper(checkpoint)
    problems = check_checkpoint(checkpoint, hf_dir, cfg)
    assert any(problem in p for p in problems), problems


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def build_flag_problems(command: list[str], table: dict) -> list[str]:
    """Flags of `command` absent from some version of the file that defines them (as tabulated from
    TensorRT-LLM's source), or given a value outside that flag's choices or type there."""
    problems = []
    for arg in command[1:]:
        flag, value = arg.split("=", 1)
        entry = table["flags"].get(flag)
        if entry is None:
            problems.append(f"{flag}: defined by no version of build.py or plugin.py tabulated")
            continue
        absent = entry.get("absent_from")
        if absent:
            problems.append(f"{flag}: absent from {entry['defined_in']} at {absent}")
        if entry["choices"] is not None and value not in entry["choices"]:
            problems.append(f"{flag}={value}: not one of {entry['choices']}")
        if entry["type"] == "int" and not value.lstrip("-").isdigit():
            problems.append(f"{flag}={value}: not an int")
    return problems


def build_variants() -> list[tuple[str, str]]:
    """(quantization, override) for every value of every enumerated or boolean build setting."""
    import typing

    from pipeline.config import BuildSection

    variants = []
    for name, field in BuildSection.model_fields.items():
        values = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
        values = (True, False) if field.annotation is bool else values
        variants += [("{weights: fp8}", f"build.{name}={str(v).lower()}") for v in values]
    return variants


def test_trtllm_build_flags_exist_in_the_targeted_release(tmp_path, tiny_llama):
    """Every flag we pass is defined by tensorrt_llm/commands/build.py or plugin.py (add_plugin_argument) in every
    version of them tabulated from TensorRT-LLM's source, and every value we can pass is within its choices."""
    from pipeline.errors import ConfigError
    from pipeline.targets.trtllm.tensorrt_backend import trtllm_build_command
    from pipeline.upstream import facts

    # settings the config only accepts together (no attention plugin / padding means the V1 batching)
    companions = ["build.kv_cache_type=continuous", "build.remove_input_padding=false", "runtime.batching_strategy=V1"]
    table, problems, built = facts("trtllm_build_flags"), {}, 0
    for quantization, override in build_variants():
        for overrides in ([override], [*companions, override]):
            try:
                cfg = load_config(gpu_config(tmp_path, tiny_llama, quantization), overrides)
            except ConfigError:
                continue  # a combination the config refuses is never emitted
            command = trtllm_build_command(cfg, Path("/ckpt"), Path("/engine"))
            problems |= {p: overrides for p in build_flag_problems(command, table)}
            built += 1
            break
    assert not problems, problems
    assert built == len(build_variants())  # every value of every setting was emitted at least once
    fp8 = load_config(
        gpu_config(tmp_path, tiny_llama, "{weights: fp8, kv_cache: fp8}"), ["build.use_fp8_context_fmha=true"]
    )
    flags = dict(arg.split("=", 1) for arg in trtllm_build_command(fp8, Path("/c"), Path("/e"))[1:])
    assert flags["--use_fp8_context_fmha"] == "enable" and flags["--kv_cache_type"] == "paged"


def test_validate_rejects_what_modelopt_cannot_do_here(tmp_path, tiny_llama):
    result = run_cli(
        "validate",
        str(gpu_config(tmp_path, tiny_llama, "{weights: int4, method: awq, group_size: 32, kv_cache: int8}")),
    )
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "awq needs calibration data" in message
    assert "ModelOpt 0.47 exports only FP8 (or NVFP4) KV-cache scales" in message
    bad = run_cli(
        "validate", str(gpu_config(tmp_path, tiny_llama, "{weights: fp8, modelopt_recipe: general/ptq/no_such_recipe}"))
    )
    assert bad.returncode == 2 and "no such recipe file or built-in recipe" in " ".join(bad.stderr.split())


@pytest.mark.parametrize(
    ("config", "size", "command"),
    [
        ("llama-3.1-8b-fp8-h100", "8b", "trtllm-serve"),
        ("llama-3.1-8b-int4-awq-l40s", "8b", "trtllm-serve"),
        ("llama-3.1-70b-fp8-tp4", "70b", "trtllm-serve"),
        ("smollm2-135m-fp8", None, "trtllm-serve"),
        ("smollm2-135m-int4-awq", None, "trtllm-build --checkpoint_dir="),  # the shipped engine example
    ],
)
def test_example_gpu_configs_fit_their_gpu_and_plan_prints_the_gpu_command(tmp_path, config, size, command):
    overrides = [f"model.path={llama_shape(tmp_path, size)}"] if size else ["target.gpu=L4"]
    result = run_cli("plan", f"build_configs/{config}.yaml", *overrides, "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert command in out and "full-length sequences" in out


def test_memory_plan_refuses_70b_fp16_on_one_80gb_gpu(tmp_path):
    result = run_cli(
        "validate",
        "build_configs/llama-3.1-70b-fp8-tp4.yaml",
        f"model.path={llama_shape(tmp_path, '70b')}",
        "quantization.weights=none",
        "quantization.kv_cache=none",
        "parallel.tp_size=1",
    )
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "target.gpu: does not fit one H100-80GB (79 GiB): weights 131.4 GiB" in message


def test_nvfp4_is_rejected_with_the_reason(tmp_path, tiny_llama):
    result = run_cli("validate", str(gpu_config(tmp_path, tiny_llama, "{weights: nvfp4}")))
    assert result.returncode == 2 and "fake-quant forward needs CUDA" in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("quantization", "multiple"),
    [("{weights: int8}", 128), ("{weights: int4, method: awq, group_size: 128, calibration: {}}", 256)],
)
def test_validate_names_linears_tensorrt_llm_would_pad(tmp_path, tiny_llama, quantization, multiple):
    """TensorRT-LLM's weight-only linears pad in/out features to 64 x tp (W8A16) or max(64, group) x tp (AWQ);
    the tiny model's hidden size 64 at tp 2 would need padding no exporter writes, so validate refuses it."""
    config = gpu_config(tmp_path, tiny_llama, quantization, "{tp_size: 2}")
    result = run_cli("validate", str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    assert "parallel.tp_size" in message and f"pads to a multiple of {multiple}" in message, message
