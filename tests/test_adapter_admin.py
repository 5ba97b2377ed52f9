"""The gateway's adapter routes' rules (`pipeline.serving.adapter_admin`), on a tiny Llama's real PEFT adapter: the cap
lora.max_cpu_loras, eviction of the least recently used idle adapter where lora.evict_idle_adapters allows it, and
the registry file the LLM model reads."""

from __future__ import annotations

import json

import pytest

from pipeline.adapter_registry import Registry
from pipeline.models import ModelFacts
from pipeline.peft_adapters import Fit
from pipeline.serving.adapter_admin import AdapterAdmin
from tests.runtime.test_multi_lora import make_adapter


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    return make_adapter(tiny_llama, allowed / "one", 3, r=2, lora_alpha=4, target_modules=["q_proj"])


def admin(tiny_llama, adapter, tmp_path, evict: bool) -> AdapterAdmin:
    """Three adapters at most, the build's `built` (task id 1) among them."""
    facts = ModelFacts.from_hf_config(json.loads((tiny_llama / "config.json").read_text()))
    fit = Fit(facts, 8, ["q_proj", "v_proj"])
    return AdapterAdmin(Registry(tmp_path / "registry.json"), fit, [adapter.parent], 3, {"built": 1}, evict)


def test_past_max_cpu_loras_a_load_is_refused_naming_the_ways_out(tiny_llama, adapter, tmp_path):
    served = admin(tiny_llama, adapter, tmp_path, evict=False)
    assert [served.add(name, str(adapter)) for name in ("x", "y")] == [2, 3]
    with pytest.raises(
        ValueError,
        match="3 adapters are served, lora.max_cpu_loras is 3: unload one .* or set lora.evict_idle_adapters",
    ):
        served.add("z", str(adapter))
    served.remove("x")
    assert served.add("z", str(adapter)) == 4  # a new task id: a client still naming 2 is refused, not served z
    assert json.loads((tmp_path / "registry.json").read_text()) == {
        "y": {"path": str(adapter), "task_id": 3},
        "z": {"path": str(adapter), "task_id": 4},
    }


def test_with_evict_idle_adapters_the_least_recently_used_idle_one_makes_room(tiny_llama, adapter, tmp_path):
    served = admin(tiny_llama, adapter, tmp_path, evict=True)
    served.add("x", str(adapter))
    served.add("y", str(adapter))
    with served.using("y"):
        pass
    with served.using("x"):  # x used last, and running: y goes
        served.add("z", str(adapter))
        assert sorted(served.served()) == ["built", "x", "z"]
        with served.using("z"), pytest.raises(ValueError, match="every adapter loaded while serving is running"):
            served.add("w", str(adapter))
    served.add("w", str(adapter))  # both idle now; x's request started before z's: x goes
    assert sorted(served.served()) == ["built", "w", "z"]
    assert sorted(Registry(tmp_path / "registry.json").read()) == ["w", "z"]  # the build's stay in the build


def test_a_forged_header_is_refused_by_the_gateway_before_a_tensor_is_read(tiny_llama, adapter, tmp_path):
    """A header declaring a [1048576, 576] float32 lora_A (2.4 GB) over a file of a few bytes: the gateway's load
    refuses it from the header and the file's size alone, reading no tensor, and registers nothing."""
    import resource
    import shutil
    import struct

    forged = adapter.parent / "forged"
    shutil.copytree(adapter, forged)
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    a_bytes, b_bytes = 1048576 * 576 * 4, 64 * 1048576 * 4
    header = {
        f"{layer}.lora_A.weight": {"dtype": "F32", "shape": [1048576, 576], "data_offsets": [0, a_bytes]},
        f"{layer}.lora_B.weight": {
            "dtype": "F32",
            "shape": [64, 1048576],
            "data_offsets": [a_bytes, a_bytes + b_bytes],
        },
    }
    text = json.dumps(header).encode().ljust(8 * (len(json.dumps(header)) // 8 + 1))
    (forged / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))
    served = admin(tiny_llama, adapter, tmp_path, evict=False)
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"forged/adapter_model\.safetensors: cannot read .*not fully covered"):
        served.add("forged", str(forged))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - high_water < 64 * 1024  # KiB: nothing was read
    assert sorted(served.served()) == ["built"] and not (tmp_path / "registry.json").exists()
