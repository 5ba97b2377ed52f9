"""LoRA on the trtllm target: the converted request tensors against PEFT's own merge (a tiny Llama, random adapters with
non-zero B), the generated trtllm-build flags, tensorrt_llm model and LLM-API options of 0.19 and 1.2 against the
tabulated facts of each release, and the refusals."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline import peft_adapters
from pipeline.errors import ConfigError
from pipeline.models import facts_from_hf_dir
from pipeline.stages import triton_repo
from pipeline.targets.trtllm import lora_conversion
from pipeline.targets.trtllm.backend import BACKENDS
from pipeline.targets.trtllm.llm_api_serving import OPTIONS_FILE
from pipeline.targets.trtllm.pytorch_backend import release_options
from pipeline.targets.trtllm.reference import with_lora
from pipeline.targets.trtllm.repo_checks import model_checks
from pipeline.targets.trtllm.tensorrt_backend import trtllm_build_command
from pipeline.targets.trtllm.triton_cpp_backend import backend_facts, template
from pipeline.targets.trtllm.triton_llmapi_model import LLMAPI_RELEASES, llmapi_model, model_yaml_problems
from pipeline.triton.validate import validate_repo
from pipeline.upstream import facts
from pipeline.validation import load_config
from tests.conftest import run_cli, slow_fixture, write_config
from tests.runtime.test_multi_lora import make_adapter, merged
from tests.serving.test_repo import read_config, trtllm_engine_record

ADAPTERS = {
    "every": {"r": 4, "lora_alpha": 8, "target_modules": list(peft_adapters.LINEAR_MODULES)},
    # per-module rank and alpha, rsLoRA: what the engine workflow's tensors carry, folded in by us
    "patterned": {
        "r": 4,
        "lora_alpha": 6,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"q_proj": 8},
        "alpha_pattern": {"down_proj": 20},
    },
}
PROMPT = torch.tensor([[1, 5, 9, 30, 41, 77, 120, 3]])


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("trtllm-lora")
    return {name: make_adapter(tiny_llama, work / name, 7 + i, **s) for i, (name, s) in enumerate(ADAPTERS.items())}


def base_model(tiny_llama: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


# ---------------------------------------------------------------- the conversion, numerically


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_request_tensors_read_back_as_the_runtime_slices_them_are_peft_merged_deltas(tiny_llama, adapters, name):
    """lora_weights / lora_config in float16, read back by the tabulated layout (module dims from createLoraModules,
    A [r, in] then B [out, r]): B·A of every row is the weight change PEFT's own merge_and_unload makes."""
    adapter = peft_adapters.load(adapters[name])
    weights, config = lora_conversion.request_tensors(adapter, "float16")
    rows = len(adapter.weights)
    assert weights.dtype == np.float16 and weights.shape[:2] == (1, rows)
    assert config.dtype == np.int32 and config.shape == (1, rows, 3)
    ids = facts("trtllm_lora")["request"]["module_ids"]
    assert {int(c[0]) for c in config[0]} == {ids[m] for m in lora_conversion.trtllm_modules(adapter.modules)}
    ranks = {int(c[2]) for c in config[0]}
    assert ranks == ({4, 8} if name == "patterned" else {4})  # rank_pattern: the row's own adapter size

    deltas = lora_conversion.read_request(weights, config, facts_from_hf_dir(tiny_llama))
    assert set(deltas) == set(adapter.weights)
    base = dict(base_model(tiny_llama).named_parameters())
    peft_merged = dict(merged(tiny_llama, adapters[name]).named_parameters())
    worst = 0.0
    for (layer, module), (a, b) in deltas.items():
        block = "self_attn" if module in peft_adapters.ATTENTION_MODULES else "mlp"
        key = f"model.layers.{layer}.{block}.{module}.weight"
        expected = (peft_merged[key] - base[key]).detach().numpy()
        worst = max(worst, float(np.abs(b @ a - expected).max() / np.abs(expected).max()))
    assert worst < 2e-3, worst  # float16 rounding of A and B


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_reference_with_the_converted_adapter_gives_peft_merged_logits(tiny_llama, adapters, name):
    """The CPU reference's LoRA (x·A·B beside the base weight, as the plugin adds it) from the converted tensors,
    float32 and float16, against the logits of PEFT's merged model."""
    adapter = peft_adapters.load(adapters[name])
    with torch.no_grad():
        expected = merged(tiny_llama, adapters[name])(PROMPT).logits
        base = base_model(tiny_llama)(PROMPT).logits
        for dtype, tolerance in (("float32", 1e-4), ("float16", 5e-3)):
            deltas = lora_conversion.read_request(
                *lora_conversion.request_tensors(adapter, dtype), facts_from_hf_dir(tiny_llama)
            )
            logits = with_lora(base_model(tiny_llama), deltas)(PROMPT).logits
            assert (logits - expected).abs().max() < tolerance, dtype
    assert (base - expected).abs().max() > 0.1  # the adapter changes the logits


def test_the_request_files_are_what_the_runtime_loads_and_the_prefetch_folder_its_layout(adapters, tmp_path):
    table = facts("trtllm_lora")
    files = table["request"]["converter"]["files"]
    for name in ADAPTERS:
        (tmp_path / name).mkdir()
        lora_conversion.write_request_files(peft_adapters.load(adapters[name]), tmp_path / name, "float16")
    prefetch = lora_conversion.link_prefetch(tmp_path, {"every": 1, "patterned": 12})
    for task, name in ((1, "every"), (12, "patterned")):
        assert sorted(p.name for p in (prefetch / str(task)).iterdir()) == sorted(files.values())
        for file in files.values():
            assert os.path.samefile(prefetch / str(task) / file, tmp_path / name / file)
            with open(prefetch / str(task) / file, "rb") as f:  # the .npy type code the C++ loader parses
                np.lib.format.read_magic(f)
                descr = np.lib.format.read_array_header_1_0(f)[2].str
            assert descr.lstrip("<>|=") in table["request"]["npy_types"], (file, descr)
    for release in ("0.19", "1.2"):  # the folder layout the release's docs/lora.md draws
        assert table["releases"][release]["prefetch"]["files"] == sorted(files.values())
        assert all(folder.isdigit() for folder in table["releases"][release]["prefetch"]["task_folders"])


def test_the_runtimes_module_dims_are_the_models_and_the_two_module_maps_agree(tiny_llama):
    model = facts_from_hf_dir(tiny_llama)
    dims, shapes = lora_conversion.module_dims(model), peft_adapters.module_shapes(model)
    trt = lora_conversion.trtllm_modules(list(peft_adapters.LINEAR_MODULES))
    assert trt == ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    for hf, name in zip(peft_adapters.LINEAR_MODULES, trt):
        assert dims[name] == shapes[hf], hf
    for release in ("1.0", "1.1", "1.2"):  # lora_helper's TensorRT-LLM -> HF default maps them back
        back = facts("trtllm_lora")["releases"][release]["llm_api"]["trtllm_modules_to_hf_modules"]
        assert [back[name] for name in trt] == list(peft_adapters.LINEAR_MODULES), release


# ---------------------------------------------------------------- generated configs


def lora_yaml(
    tmp_path: Path, base: Path, adapter: Path, backend: str, release: str, extra: str = "", dtype: str = "auto"
) -> Path:
    return write_config(
        tmp_path / f"lora-{backend}-{release}.yaml",
        f"""
        model: {{source: hf, path: {base}, dtype: {dtype}}}
        target: {{name: trtllm, trtllm_backend: {backend}, trtllm_version: "{release}"}}
        lora:
          max_lora_rank: 8
          adapters: [{{name: every, path: {adapter}}}]
        {extra}
        """,
    )


@pytest.mark.parametrize("release", ["0.19", "1.2"])
def test_the_engine_workflow_builds_and_serves_lora_as_the_release_takes_it(tmp_path, tiny_llama, adapters, release):
    cfg = load_config(lora_yaml(tmp_path, tiny_llama, adapters["every"], "tensorrt", release))
    command = trtllm_build_command(cfg, Path("/ckpt"), Path("/engine"))
    start = command.index("--lora_target_modules")
    modules = command[start + 1 : start + 8]
    assert modules == lora_conversion.trtllm_modules(list(peft_adapters.LINEAR_MODULES))
    flags = dict(arg.split("=", 1) for arg in command[1:start] + command[start + 8 :])
    table = facts("trtllm_build_flags")["flags"]
    for flag, value in (("--lora_plugin", "float16"), ("--max_lora_rank", "8")):
        assert flags[flag] == value and "absent_from" not in table[flag], flag
        assert table[flag]["choices"] is None or value in table[flag]["choices"], flag
    assert table["--lora_target_modules"]["nargs"] == "+" and "--lora_dir" not in flags  # modules given, not inferred
    assert set(modules) <= set(facts("trtllm_lora")["request"]["module_ids"])  # the choices: LORA_MODULE_IDS' keys
    assert BACKENDS["tensorrt"].engine_reads(cfg) == lora_conversion.ENGINE_FIELDS

    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, f"{release}.0")
    triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    assert not validate_repo(tmp_path / "repo", model_checks(release)).problems
    llm = read_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    params = {key: value.string_value for key, value in llm.parameters.items()}
    assert params["lora_cache_max_adapter_size"] == params["lora_cache_optimal_adapter_size"] == "8"
    assert Path(params["lora_prefetch_dir"]) == engine.parent / "lora" / lora_conversion.PREFETCH_DIR
    lora_params = {key for key in params if key.startswith("lora_")}
    assert lora_params <= set(backend_facts(release)["optional_parameters"])
    assert {"lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes"}.isdisjoint(params)  # release defaults
    declared = {row["name"]: row for row in template(release)["inputs"]}
    inputs = {tensor.name: tensor for tensor in llm.input}
    for name in lora_conversion.REQUEST_INPUTS:
        assert list(inputs[name].dims) == declared[name]["dims"] and inputs[name].optional, name


def test_an_engine_without_lora_keeps_every_lora_parameter_at_the_releases_default(tmp_path, tiny_llama):
    cfg = load_config(
        write_config(tmp_path / "plain.yaml", 'target: {name: trtllm, trtllm_backend: tensorrt, trtllm_version: "1.2"}')
    )
    assert "--lora_plugin" not in " ".join(trtllm_build_command(cfg, Path("/c"), Path("/e")))
    engine = trtllm_engine_record(tmp_path / "engine", tiny_llama, "1.2.0")
    triton_repo.write(cfg, engine, tmp_path / "repo", log=lambda _: None)
    llm = read_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert not [key for key in llm.parameters if key.startswith("lora_")]


@pytest.mark.parametrize("release", ["1.0", "1.1", "1.2"])
def test_the_llm_api_options_carry_lora_config_as_the_releases_loraconfig_takes_it(
    tmp_path, tiny_llama, adapters, release
):
    cfg = load_config(lora_yaml(tmp_path, tiny_llama, adapters["every"], "pytorch", release, "  max_loras: 2"))
    options, problems = release_options(cfg)
    assert problems == []
    assert options["lora_config"] == {
        "lora_target_modules": lora_conversion.trtllm_modules(list(peft_adapters.LINEAR_MODULES)),
        "max_lora_rank": 8,
        "max_loras": 2,
        "max_cpu_loras": 2,
    }
    fields = facts("trtllm_lora")["releases"][release]["llm_api"]["fields"]
    assert set(options["lora_config"]) <= set(fields) and "lora_dir" in fields
    assert lora_conversion.lora_config_problems(options["lora_config"], release) == []
    assert set(lora_conversion.LLM_API_FIELDS) <= set(BACKENDS["pytorch"].engine_reads(cfg))


def test_the_llmapi_model_yaml_carries_lora_config_and_no_llmapi_model_takes_an_adapter(tmp_path, tiny_llama, adapters):
    cfg = load_config(lora_yaml(tmp_path, tiny_llama, adapters["every"], "pytorch", "1.2"))
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / OPTIONS_FILE).write_text(yaml.safe_dump(release_options(cfg)[0]))
    llm, _ = BACKENDS["pytorch"].triton_models(cfg, engine, {})
    spec = yaml.safe_load(llm.texts["model.yaml"])
    assert spec["lora_config"]["max_lora_rank"] == 8 and not model_yaml_problems(spec, "1.2")
    for release in LLMAPI_RELEASES:  # only trtllm-serve's lora_request selects an adapter
        assert not [row["name"] for row in llmapi_model(release)["config"]["inputs"] if "lora" in row["name"]]


# ---------------------------------------------------------------- refusals


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(path)
    return str(error.value)


def test_the_engine_workflow_refuses_a_bfloat16_engine_0_18_and_max_loras(tmp_path, tiny_llama, adapters):
    adapter = adapters["every"]
    message = refused(lora_yaml(tmp_path, tiny_llama, adapter, "tensorrt", "1.2", dtype="bfloat16"))
    assert "1 problem" in message and "model.dtype: the engine would be bfloat16" in message
    assert "lora_weights TYPE_FP16" in message and "set model.dtype: float16" in message
    message = refused(lora_yaml(tmp_path, tiny_llama, adapter, "tensorrt", "0.18"))
    assert "1 problem" in message and "reads no lora_prefetch_dir" in message and "target 0.19" in message
    message = refused(lora_yaml(tmp_path, tiny_llama, adapter, "tensorrt", "1.2", "  max_loras: 2"))
    assert "1 problem" in message and "lora.max_loras: is not honoured" in message
    assert "target.trtllm_backend: pytorch" in message


def test_the_pytorch_backend_refuses_an_adapter_its_loader_would_scale_otherwise(tmp_path, tiny_llama, adapters):
    message = refused(lora_yaml(tmp_path, tiny_llama, adapters["patterned"], "pytorch", "1.2"))
    assert "1 problem" in message and "lora.adapters.0.path" in message and "alpha_pattern" in message
    assert "target.trtllm_backend: tensorrt" in message
    cfg = load_config(lora_yaml(tmp_path, tiny_llama, adapters["patterned"], "tensorrt", "1.2"))  # folded in there
    assert lora_conversion.config_problems(cfg) == []


# ---------------------------------------------------------------- the lora stage's hooks on a real export


@slow_fixture(scope="module")
def exported(tiny_llama, adapters, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama built by the CLI up to `export` (float16, no quantization) for each backend, with the lora
    stage's copy of the adapter `every` in `lora/every` (the engine stage, a GPU's, is what the lora stage follows)."""
    import shutil

    outputs = {}
    for backend, release in (("tensorrt", "1.2"), ("pytorch", "1.2")):
        root = tmp_path_factory.mktemp(f"export-{backend}")
        config = lora_yaml(root, tiny_llama, adapters["every"], backend, release)
        result = run_cli("build", str(config), "--output", str(root / "out"), "--until", "export")
        assert result.returncode == 0, result.stdout + result.stderr
        shutil.copytree(adapters["every"], root / "out" / "lora" / "every")
        outputs[backend] = config, root / "out"
    return outputs


@pytest.mark.parametrize("backend", ["tensorrt", "pytorch"])
def test_the_lora_stage_converts_and_scores_the_adapter_on_the_deployed_checkpoint(exported, backend):
    """convert_adapters writes what the backend's runtime loads, and scored_adapter's model (the checkpoint's
    reference forward with the adapter as that runtime takes it) agrees with PEFT's fp32 merge as closely as the
    float16 checkpoint does with the fp32 base."""
    from types import SimpleNamespace

    from pipeline.targets.trtllm.adapter import TrtllmTarget

    config, out = exported[backend]
    cfg = load_config(config)
    logged = []
    metrics = TrtllmTarget().convert_adapters(cfg, SimpleNamespace(out_dir=out / "lora", log=logged.append))
    files = facts("trtllm_lora")["request"]["converter"]["files"].values()
    if backend == "tensorrt":
        assert metrics["trtllm_lora_request_bytes"] > 0 and logged
        assert sorted(p.name for p in (out / "lora" / "prefetch" / "1").iterdir()) == sorted(files)
    else:  # the PyTorch backend reads the PEFT directory itself
        assert metrics == {} and not (out / "lora" / "prefetch").exists()
    model, reference = TrtllmTarget().scored_adapter(cfg, out, "every", out / "lora" / "every")
    ids = PROMPT.numpy().astype(np.int64)
    with_adapter, merged_logits = model.logits(ids), reference.logits(ids)
    base = base_model(cfg.resolve_path(cfg.model.path))(PROMPT).logits.detach().numpy()
    assert np.abs(merged_logits - base).max() > 0.1  # the adapter matters
    assert np.abs(with_adapter - merged_logits).max() < 0.01, np.abs(with_adapter - merged_logits).max()
