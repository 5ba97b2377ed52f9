"""model.dtype on the trtllm target: `auto` follows the checkpoint as stored (bfloat16 kept, float32 to float16),
except where a feature takes only float16 (the engine workflow's LoRA); an explicit dtype is kept."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from pipeline.targets.trtllm.dtypes import checkpoint_dtype, deployed_dtype


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
