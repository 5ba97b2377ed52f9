"""scripts/dev/tabulate_trtllm_engine_models.py on short inputs of our own in the upstream syntax, and the committed
pipeline/upstream/trtllm_engine_models.json against what the tensorrt backend looks up in it."""

import ast

from pipeline.upstream import facts
from tests.conftest import dev_script

TABLE = facts("trtllm_engine_models")

tab = dev_script("tabulate_trtllm_engine_models")

MODELS_INIT = """
from .shapes.config import SQUARE_ARCH

MODEL_MAP = {
    "RoundForCausalLM": RoundModel,
    SQUARE_ARCH: ShapeModel,
    "OvalForCausalLM": RoundModel,
}
"""

SHAPES_CONFIG = """
SQUARE_ARCH = "SquareForCausalLM"
OTHER = 3
"""

CONFIG_CLASS = """
class RoundConfig(PretrainedConfig):
    def __init__(self, *, edge_bias: bool = True, rim_bias: bool = False, radius: float = 1.5, **kwargs):
        super().__init__(**kwargs)

    @classmethod
    def from_hugging_face(cls, hf_config, dtype="auto"):
        round_kind = hf_config.model_type
        radius = 2 * hf_config.size
        return cls(round_kind=round_kind, radius=radius, dtype=dtype)
"""

DECODER_LAYER = """
class RoundDecoderLayer(Module):
    def __init__(self, config, layer_idx):
        self.attention = Attention(hidden=config.hidden, bias=config.edge_bias, dense_bias=False)
        self.mlp = ClsMLP(bias=self.config.rim_bias)
        if config.round_kind == "oval":
            pass
        elif config.round_kind == "circle":
            pass
"""

PRETRAINED_CONFIG = """
class PretrainedConfig:
    def __init__(self, architecture, dtype, hidden_size, **kwargs):
        self.architecture = architecture
        self.scale = kwargs.get("scale", 1.0)
        for key, value in kwargs.items():
            setattr(self, key, value)
"""

RELEASE_NOTES = """# Notes

## TensorRT-LLM Release 0.21.0
- Added Oval vision support.

## TensorRT-LLM Release 0.20.0
- Added Oval support.
- Added SquareThing support.

## TensorRT-LLM Release 0.19.0
- Fixed a bug.
"""

NAME_TO_TYPE = """
MODEL_NAME_TO_TYPE = {"Square": "square", "Round": "round", "Oval": "round"}
"""

CONFIG_WRITER = """
def convert_to_tensorrt_llm_config(model_config, decoder_type):
    if decoder_type in ["round", "pointy"]:
        pass
    elif decoder_type == "flat":
        pass
    elif is_layered:
        pass
    else:
        raise NotImplementedError("no")
"""


def test_model_map_with_module_constants_resolved():
    constants = tab.module_constants(ast.parse(SHAPES_CONFIG))
    assert tab.model_map(ast.parse(MODELS_INIT), constants) == {
        "RoundForCausalLM": "RoundModel",
        "SquareForCausalLM": "ShapeModel",
        "OvalForCausalLM": "RoundModel",
    }


def test_config_class_defaults_and_the_hf_attribute_a_key_is_taken_from():
    (cls,) = tab.classes(ast.parse(CONFIG_CLASS))
    assert tab.config_class(cls) == {
        "init_defaults": {"edge_bias": True, "rim_bias": False, "radius": 1.5},
        "from_hugging_face": {"round_kind": {"hf_config": "model_type"}},  # radius is computed: not a plain read
    }


def test_decoder_layer_biases_and_the_config_attributes_it_branches_on():
    (cls,) = tab.classes(ast.parse(DECODER_LAYER))
    assert tab.decoder_layer(cls) == {
        "attention": {"bias": {"config": "edge_bias"}, "dense_bias": False},
        "mlp": {"bias": {"config": "rim_bias"}},
        "compares": {"round_kind": ["circle", "oval"]},
    }


def test_pretrained_config_keeps_the_keys_it_does_not_name_as_attributes():
    assert tab.sets_unnamed_keys(ast.parse(PRETRAINED_CONFIG))
    named_only = PRETRAINED_CONFIG.replace("setattr(self, key, value)", "print(key)")
    assert not tab.sets_unnamed_keys(ast.parse(named_only))


def test_release_notes_date_what_the_oldest_model_map_lacks_by_the_earliest_release():
    oldest = {"RoundForCausalLM": "RoundModel"}
    newest = oldest | {"OvalForCausalLM": "RoundModel", "SquareThingForCausalLM": "ShapeModel"}
    assert tab.added_in_release(RELEASE_NOTES, oldest, newest) == {
        "OvalForCausalLM": "0.20",  # not 0.21's vision support
        "SquareThingForCausalLM": "0.20",
    }


def test_modelopt_decoder_types_and_the_writer_branches():
    found = tab.modelopt_facts(NAME_TO_TYPE, CONFIG_WRITER)
    assert found["model_name_to_type"] == [("Square", "square"), ("Round", "round"), ("Oval", "round")]
    assert found["config_writer_decoder_types"] == ["round", "pointy", "flat"]
    assert found["config_writer_also_when"] == ["is_layered"]
    assert found["config_writer_otherwise_raises"] == "NotImplementedError"
    assert [s["commit"] for s in found["sources"]] == [tab.MODELOPT_COMMIT] * 2


# ---------------------------------------------------------------- the committed table


def test_every_model_map_is_cited_and_the_families_split_as_read():
    assert [m["source"]["commit"] for m in TABLE["model_map"]] == list(tab.MODEL_MAP_COMMITS)
    for version in TABLE["model_map"]:
        assert version["source"]["path"] == tab.MODELS_INIT
        classes = version["classes"]
        assert classes["MistralForCausalLM"] == classes["LlamaForCausalLM"] == "LLaMAForCausalLM"
        assert classes["Qwen2ForCausalLM"] == "QWenForCausalLM"
    oldest, *newer = TABLE["model_map"]
    assert "Gemma3ForCausalLM" not in oldest["classes"] and "Qwen3ForCausalLM" not in oldest["classes"]
    assert all(v["classes"]["Gemma3ForCausalLM"] == "GemmaForCausalLM" for v in newer)


def test_every_class_the_engine_backend_checks_is_tabulated():
    from pipeline.targets.trtllm.checkpoint import CHECKED_LAYOUTS

    for architecture in CHECKED_LAYOUTS:
        trtllm_class = TABLE["model_map"][0]["classes"][architecture]
        model = TABLE["model_classes"][trtllm_class]
        assert model["config_class"] in TABLE["config_classes"] and model["decoder_layer"] in TABLE["decoder_layers"]
        assert {"attn_bias", "mlp_bias"} <= set(TABLE["config_classes"][model["config_class"]]["init_defaults"])


def test_qwen_facts_the_checkpoint_check_uses():
    qwen = TABLE["config_classes"]["QWenConfig"]
    assert qwen["init_defaults"]["attn_bias"] is True and qwen["init_defaults"]["mlp_bias"] is False
    assert qwen["from_hugging_face"] == {"qwen_type": {"hf_config": "model_type"}}
    layer = TABLE["decoder_layers"]["QWenDecoderLayer"]
    assert layer["attention"] == {"bias": {"config": "attn_bias"}, "dense_bias": False}
    assert "qwen_type" in layer["compares"]
    assert TABLE["pretrained_config"]["unnamed_keys_become_attributes"]
    assert "sliding_window" not in TABLE["config_classes"]["LLaMAConfig"]["init_defaults"]


def test_modelopt_facts():
    mo = TABLE["modelopt"]
    assert mo["version"] == tab.MODELOPT_VERSION
    assert {"llama", "qwen"} <= set(mo["config_writer_decoder_types"])
    assert "phi3" not in mo["config_writer_decoder_types"] and "gemma3" not in mo["config_writer_decoder_types"]
    assert mo["config_writer_otherwise_raises"] == "NotImplementedError"


def test_the_release_an_entry_older_versions_lack_was_added_in():
    added = TABLE["added_in_release"]
    assert {arch: entry["release"] for arch, entry in added.items()} == {
        "Gemma3ForCausalLM": "0.19",
        "Qwen3ForCausalLM": "0.20",
    }
    assert all(entry["source"]["path"] == tab.RELEASE_NOTES[0] for entry in added.values())
