"""scripts/train_lora_adapters.py trains bit-for-bit the same adapter from the same inputs (issue #45: a retrained
adapter must pass the lora build's gate as the measured one did, not land on other rounding)."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
import torch

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("train_lora_adapters", REPO / "scripts" / "train_lora_adapters.py")
train_lora_adapters = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_lora_adapters)


@pytest.fixture
def torch_settings():
    """`deterministic` sets the process's threads and deterministic kernels: put them back for the other tests."""
    threads, checked = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(checked)


def test_same_inputs_train_the_same_bytes(tiny_llama, tmp_path, torch_settings):
    data = [([1, *range(3 + i, 13 + i)], [-100] * 6 + list(range(8 + i, 13 + i))) for i in range(6)]

    def trained(out, threads, seed=0):
        torch.set_num_threads(threads)  # the caller's: `train` sets its own
        train_lora_adapters.train(tiny_llama, out, "ahoy", data, log=lambda _: None, seed=seed)
        return hashlib.sha256((out / "ahoy" / "adapter_model.safetensors").read_bytes()).hexdigest()

    first = trained(tmp_path / "a", threads=2)
    assert trained(tmp_path / "b", threads=1) == first
    assert trained(tmp_path / "c", threads=2, seed=1) != first
