"""ModelFacts.sliding_window is a window every layer has (transformers 4.57's per-layer rules), else None."""

from __future__ import annotations

import pytest

from pipeline.models import ModelFacts, layer_windows

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
# google/gemma-3-1b-it config.json: a pattern, no layer_types (every sixth layer attends to all)
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "sliding_window_pattern": 6}
# Qwen/Qwen2.5-7B-Instruct config.json: the window is saved but switched off
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
}


@pytest.mark.parametrize(
    ("config", "window"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, 4096),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
        ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 2047}, 2047),
        (GEMMA3_1B | {"num_hidden_layers": 26}, None),
        (GEMMA3_1B, 512),  # 4 layers with period 6: all four window
        ({"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "num_hidden_layers": 6}, None),  # 6 default
        (GEMMA3_1B | {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, None),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64, "layer_types": ["sliding_attention"] * 4}, 64),
        (QWEN25, None),
        (QWEN25 | {"use_sliding_window": True}, None),  # layers 28.. window: none of these 4
        (QWEN25 | {"use_sliding_window": True, "max_window_layers": 2}, None),  # layers 2, 3 window; 0, 1 do not
        (QWEN25 | {"use_sliding_window": True, "max_window_layers": 0}, 131072),  # every layer
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}, None),  # use_sliding_window False default
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": True}, None),  # 28
    ],
    ids=[
        "mistral",
        "mistral-null",
        "phi3",
        "gemma3-1b",
        "gemma3-pattern-beyond-layers",
        "gemma3-default-pattern",
        "gemma3-layer-types",
        "all-sliding-layer-types",
        "qwen2.5-off",
        "qwen2-on-beyond-layers",
        "qwen2-on-some-layers",
        "qwen2-on-every-layer",
        "qwen2-switch-default",
        "qwen2-max-window-layers-default",
    ],
)
def test_sliding_window_is_only_a_window_every_layer_has(config, window):
    assert ModelFacts.from_hf_config(BASE | config).sliding_window == window


def test_agrees_with_transformers_layer_types():
    """The same configs through transformers 4.57 itself: the same layer types; a window iff every one slides."""
    from transformers import AutoConfig

    shapes = [
        QWEN25,
        QWEN25 | {"use_sliding_window": True, "max_window_layers": 2},
        QWEN25 | {"use_sliding_window": True, "max_window_layers": 0},
        GEMMA3_1B,
        GEMMA3_1B | {"num_hidden_layers": 26},
        {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "num_hidden_layers": 6},
    ]
    for config in shapes:
        model_type = {"Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3_text"}[config["architectures"][0]]
        loaded = AutoConfig.for_model(model_type, **(BASE | config))
        windows = [kind == "sliding_attention" for kind in loaded.layer_types]
        assert layer_windows(BASE | config) == windows, config
        assert (ModelFacts.from_hf_config(BASE | config).sliding_window is not None) == all(windows), config
