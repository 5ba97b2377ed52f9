"""model.dtype on the trtllm target: `auto` follows the checkpoint as stored (bfloat16 kept, float32 to float16),
except where a feature takes only float16 (the engine workflow's LoRA); an explicit dtype is kept."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from pipeline.targets.trtllm.dtypes import AUTO, SAFETENSORS_FLOATS, checkpoint_dtype, deployed_dtype
from pipeline.targets.trtllm.unified_export import repair_config
from pipeline.upstream import facts, releases


def checkpoint(directory, dtype):
    directory.mkdir()
    # mostly `dtype`, with a small float32 norm and an int tensor, as real checkpoints mix them
    save_file(
        {
            "embed.weight": torch.zeros(64, 16, dtype=dtype),
            "norm.weight": torch.ones(16, dtype=torch.float32),
            "positions": torch.arange(8, dtype=torch.int64),
        },
        directory / "model.safetensors",
    )
    return directory


def config(dtype="auto", lora=None, backend="pytorch"):
    return SimpleNamespace(
        model=SimpleNamespace(dtype=dtype), lora=lora, target=SimpleNamespace(trtllm_backend=backend)
    )


@pytest.mark.parametrize(
    "stored, deployed",
    [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float16")],
)
def test_auto_follows_the_checkpoint(tmp_path, stored, deployed):
    hf = checkpoint(tmp_path / "hf", stored)
    assert checkpoint_dtype(hf) == str(stored).removeprefix("torch.")
    assert deployed_dtype(config(), hf) == deployed
    assert deployed_dtype(config(backend="tensorrt"), hf) == deployed  # no LoRA: the engine keeps bfloat16 too


def test_engine_lora_needs_float16_and_an_explicit_dtype_is_kept(tmp_path):
    hf = checkpoint(tmp_path / "hf", torch.bfloat16)
    assert deployed_dtype(config(lora=object(), backend="tensorrt"), hf) == "float16"
    assert deployed_dtype(config(lora=object(), backend="tensorrt")) == "float16"  # known before import
    assert deployed_dtype(config(lora=object(), backend="pytorch"), hf) == "bfloat16"
    assert deployed_dtype(config("float32"), hf) == "float32"
    with pytest.raises(ValueError, match="follows the checkpoint"):
        deployed_dtype(config())


# ---------------------------------------------------------------- against TensorRT-LLM's own behaviour, per release

DTYPE = facts("trtllm_dtype")["releases"]
ENGINE_RELEASES = [r for r in releases("trtllm_dtype") if DTYPE[r]["engine"]]
PYTORCH_RELEASES = [r for r in releases("trtllm_dtype") if DTYPE[r]["pytorch"]]
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_checkpoint(directory, dtype: str):
    """A tiny imported checkpoint stored in `dtype` whose config.json names it, as transformers writes it."""
    checkpoint(directory, TORCH[dtype])
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "torch_dtype": dtype}))
    return directory


def pytorch_model_dtype(config_json: dict, release: str) -> str:
    """The dtype TensorRT-LLM `release`'s PyTorch backend runs a checkpoint in, by the tabulated ModelConfig
    property: the pretrained config attribute it reads (here: config.json's key of that name, as every transformers
    parses it), or its fallback when that is absent."""
    read = DTYPE[release]["pytorch"]["model_dtype"]
    return config_json.get(read["pretrained_config_attribute"]) or read["fallback"]


@pytest.mark.parametrize("release", ENGINE_RELEASES)
@pytest.mark.parametrize("stored", sorted(TORCH))
def test_auto_deploys_what_the_releases_engine_converter_infers_from_the_checkpoint(tmp_path, release, stored):
    hf = hf_checkpoint(tmp_path / "hf", stored)
    engine = DTYPE[release]["engine"]
    assert engine["converter"]["dtype_default"] == "auto"  # the converter infers unless told
    source = json.loads((hf / "config.json").read_text()).get(engine["converter"]["source_dtype"]["attribute"])
    inferred = engine["infer_dtype"]["auto"][source or "absent"]
    assert deployed_dtype(config(backend="tensorrt"), hf) == inferred
    # the dtype deployed is one the release's converter takes by name, and keeps
    assert engine["infer_dtype"]["explicit"][deployed_dtype(config(backend="tensorrt"), hf)] == inferred


@pytest.mark.parametrize("release", PYTORCH_RELEASES)
@pytest.mark.parametrize("stored", sorted(TORCH))
def test_the_pytorch_backend_runs_the_deployed_checkpoint_in_the_deployed_dtype(tmp_path, release, stored):
    hf = hf_checkpoint(tmp_path / "hf", stored)
    deployed = deployed_dtype(config(backend="pytorch"), hf)
    assert deployed == AUTO[stored]
    # the unified checkpoint is exported in the deployed dtype; transformers 4.57 names it `dtype` alone, and
    # repair_config adds the `torch_dtype` the backend reads
    unified = tmp_path / "unified"
    checkpoint(unified, TORCH[deployed])
    (unified / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": deployed}))
    assert "config.json:torch_dtype" in repair_config(unified)
    assert pytorch_model_dtype(json.loads((unified / "config.json").read_text()), release) == deployed
    # the backend maps no dtype itself: it would run the imported float32 checkpoint as float32
    assert pytorch_model_dtype(json.loads((hf / "config.json").read_text()), release) == stored


@pytest.mark.parametrize("release", PYTORCH_RELEASES)
def test_a_float16_checkpoint_whose_config_names_no_dtype_would_run_in_bfloat16(release):
    # why the export must name its dtype in config.json (unified_export.repair_config writes `torch_dtype`)
    assert pytorch_model_dtype({}, release) == "bfloat16"


def test_the_auto_mapping_is_every_tabulated_releases_and_covers_what_checkpoint_dtype_reads():
    assert set(AUTO) == set(SAFETENSORS_FLOATS.values())
    for release in ENGINE_RELEASES:
        auto = DTYPE[release]["engine"]["infer_dtype"]["auto"]
        assert {stored: auto[stored] for stored in AUTO} == AUTO, release
