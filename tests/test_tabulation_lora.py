"""scripts/dev/tabulate_trtllm_lora.py on short inputs written here in the upstream syntax (C++, Python, markdown),
and the committed table it writes."""

import pytest

from pipeline.upstream import facts
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_lora")

HEADER = """
class LoraModule
{
    enum class ModuleType : SizeType32
    {
        kINVALID = -1,
        kATTN_Q = 1,
        kMLP_4H_TO_H = 6,
    };
    static ModuleType constexpr toModuleType(std::string_view const& name)
    {
        if (name == "attn_q")
            return ModuleType::kATTN_Q;
        else if (name == "mlp_4h_to_h")
            return ModuleType::kMLP_4H_TO_H;
        else
            return ModuleType::kINVALID;
    }
};
"""

MODULES = """
std::vector<LoraModule> LoraModule::createLoraModules(std::vector<std::string> const& names,
    SizeType32 hiddenSize, SizeType32 mlpHiddenSize, SizeType32 tpSize)
{
    auto const hidden = hiddenSize * tpSize;
    auto const mlpHidden = mlpHiddenSize * tpSize;
    for (auto const& moduleName : names)
    {
        auto const t = toModuleType(moduleName);
        switch (t)
        {
        case ModuleType::kATTN_Q:
        case ModuleType::kCROSS_ATTN_Q: modules.emplace_back(t, hidden, (2 * hidden), false, true, -1, 0); break;
        case ModuleType::kMLP_4H_TO_H:
            modules.emplace_back(t, mlpHidden,
                hidden, false, true, 1, -1);
            break;
        }
    }
    return modules;
}
"""

CONVERTER = """
import argparse

def save_val(val, dir, key, tp_num=None, write_npy=False):
    ext = "npy" if write_npy else "bin"
    suffix = ext if tp_num is None else f"{tp_num}.{ext}"
    if write_npy:
        np.save(dir / f"adapter.{key}.{suffix}", val)

hf_modules_to_trtllm_modules = {"q_proj": "attn_q", "down_proj": "mlp_4h_to_h"}

def convert_hf_model(model_dir, dtype, out_dir):
    rank = config.get("r")
    alpha = config.get("lora_alpha")
    use_rslora = config.get("use_rslora", False)
    if use_rslora:
        scale = alpha / np.sqrt(rank)
    else:
        scale = alpha / rank
    for layer_idx, layer_weights in all_weights.items():
        for hf_module, module_weights in layer_weights.items():
            for w, inout in ((module_weights["in"], "in"), (module_weights["out"], "out")):
                if inout == "out":
                    w = w * scale
            converted_config.append([hf_modules_to_module_id[hf_module], layer_idx, adapter_size])
    rows = [torch.nn.functional.pad(w, (0, 1)).unsqueeze(0) for w in converted_weights]
    converted_config = torch.tensor(converted_config).unsqueeze(0).numpy()
    save_val(rows, out_dir, "lora_weights", tp_num=None, write_npy=True)
    save_val(converted_config, out_dir, "lora_config", tp_num=None, write_npy=True)
    save_val(converted_config, out_dir, "lora_config_bin", tp_num=None)

parser = argparse.ArgumentParser()
parser.add_argument("--storage-type", type=str, default="float16", choices=["float32", "float16"])
"""

PEFT_CACHE = """
executor::PeftCacheConfig ModelInstanceState::getPeftCacheConfigFromParams()
{
    SizeType32 maxAdapterSize = 32;
    std::optional<float> deviceCachePercent = std::nullopt;
    std::string fieldName = "lora_cache_max_adapter_size";
    try
    {
        maxAdapterSize = model_state_->GetParameter<SizeType32>(fieldName);
    }
    catch (std::exception const& e)
    {
    }
    fieldName = "lora_cache_gpu_memory_fraction";
    try
    {
        deviceCachePercent = model_state_->GetParameter<float>(fieldName);
    }
    catch (std::exception const& e)
    {
    }
    return executor::PeftCacheConfig(maxAdapterSize, deviceCachePercent);
}
"""

DOC = """
## LoRA Cache

### prefetch lora cache during initializing the model instance

```bash
/tmp/lora_prefetch
├── 7
│   ├── a.npy
│   └── b.npy
└── 9
    ├── a.npy
    └── b.npy
```
"""

HELPER = """
from pydantic import BaseModel, Field

def get_default_trtllm_modules_to_hf_modules():
    return {"attn_q": "q_proj"}

class LoraConfig(BaseModel):
    lora_dir: List[str] = Field(default_factory=list)
    max_lora_rank: int = 64
    max_loras: Optional[int] = None
"""


def test_module_ids_join_the_names_with_the_enum_values():
    assert tab.module_ids(HEADER) == {"attn_q": 1, "mlp_4h_to_h": 6}


def test_module_dimensions_read_every_case_of_a_multi_line_emplace():
    dims = tab.module_dimensions(MODULES)
    assert dims["locals"] == {"hidden": "hiddenSize * tpSize", "mlpHidden": "mlpHiddenSize * tpSize"}
    q = {"in_dim": "hidden", "out_dim": "2 * hidden", "in_dim_first": False, "out_dim_first": True}
    assert (
        dims["by_module"]["kATTN_Q"]
        == dims["by_module"]["kCROSS_ATTN_Q"]
        == q
        | {
            "in_tp_split_dim": -1,
            "out_tp_split_dim": 0,
        }
    )
    assert dims["by_module"]["kMLP_4H_TO_H"]["in_dim"] == "mlpHidden"
    assert tab.modules_by_name(HEADER, dims).keys() == {"attn_q", "mlp_4h_to_h"}


def test_an_emplace_of_another_shape_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="emplace_back"):
        tab.module_dimensions(MODULES.replace("(t, hidden, (2 * hidden),", "(t, hidden,"))


def test_the_converter_gives_layout_scale_and_files():
    facts_ = tab.converter(CONVERTER)
    assert facts_["hf_modules"] == {"q_proj": "attn_q", "down_proj": "mlp_4h_to_h"}
    assert facts_["config_columns"] == ["module_id", "layer_idx", "adapter_size"]
    assert facts_["row_parts"] == ["in", "out"] and facts_["scaled_part"] == "out"
    assert facts_["scale"] == {"use_rslora": "lora_alpha / np.sqrt(r)", "default": "lora_alpha / r"}
    assert facts_["rows_padded_to_longest"] and facts_["leading_batch_dim"]
    assert facts_["files"] == {"lora_weights": "adapter.lora_weights.npy", "lora_config": "adapter.lora_config.npy"}
    assert (facts_["storage_types"], facts_["default_storage_type"]) == (["float32", "float16"], "float16")


def test_cache_parameters_with_their_absent_values_and_the_prefetch_tree():
    assert tab.cache_parameters(PEFT_CACHE) == {
        "lora_cache_max_adapter_size": {"type": "SizeType32", "default": 32},
        "lora_cache_gpu_memory_fraction": {"type": "float", "default": None},
    }
    assert tab.prefetch_layout(DOC) == {"task_folders": ["7", "9"], "files": ["a.npy", "b.npy"]}
    assert tab.prefetch_layout("## LoRA Cache\n") is None


def test_lora_config_fields_of_a_pydantic_class():
    helper = tab.lora_helper(HELPER)
    assert helper["kind"] == "pydantic" and helper["trtllm_modules_to_hf_modules"] == {"attn_q": "q_proj"}
    assert helper["fields"] == {
        "lora_dir": {"type": "List[str]", "default": {"factory": "list"}},
        "max_lora_rank": {"type": "int", "default": 64},
        "max_loras": {"type": "Optional[int]", "default": None},
    }


# ---------------------------------------------------------------- the committed table


def test_the_committed_table_cites_every_file_and_reads_the_release_sources():
    table = facts("trtllm_lora")
    assert {(s["path"], s["commit"]) for s in table["request"]["source"]} == set(tab.REQUEST_SOURCES.items())
    assert all(not s["pinned"] for s in table["request"]["source"])
    assert set(table["releases"]) == set(tab.RELEASES)
    for release, block in table["releases"].items():
        assert block["source"]["docs"]["commit"] == tab.RELEASES[release].backend_commit, release
        assert (block["llm_api"] is None) == (release not in tab.LLM_API), release


def test_the_prefetch_folder_is_read_from_0_19_on_and_the_cache_sizes_default_to_64_and_8():
    table = facts("trtllm_lora")["releases"]
    assert [r for r, block in table.items() if block["prefetch"] is None] == ["0.18"]
    for release, block in table.items():
        cache = block["cache_parameters"]
        assert ("lora_prefetch_dir" in cache) == (release != "0.18"), release
        assert cache["lora_cache_max_adapter_size"]["default"] == 64, release
        assert cache["lora_cache_optimal_adapter_size"]["default"] == 8, release
        assert cache["lora_cache_gpu_memory_fraction"]["default"] is None, release  # left to the executor
