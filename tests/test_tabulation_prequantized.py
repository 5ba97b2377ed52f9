"""scripts/dev/tabulate_trtllm_prequantized.py on short inputs written here in the upstream syntax, and the committed
table it writes."""

import pytest

from pipeline.upstream import facts
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_prequantized")

MODEL_CONFIG = """
class ModelConfig:

    @staticmethod
    def load_hf_quant_config(hf_quant_config, moe_backend):
        config = QuantConfig()
        if hf_quant_config.get("quant_method") == "fp8" and hf_quant_config.get("weight_block_size"):
            config.quant_algo = QuantAlgo.FP8_BLOCK_SCALES
        elif hf_quant_config.get("quant_method") == "compressed-tensors":
            helper(config, hf_quant_config)
        return config, None

    def other(self):
        return None
"""

SCHEMES = """
def _quant_config_from_config_group(
    group: Mapping[str, Any], fmt: str | None
) -> QuantConfig:
    weights = group["weights"]
    weights_quant_strategy = weights["strategy"]
    if weights["num_bits"] == 4 and weights.get("type") == "float":
        return QuantConfig(quant_algo=QuantAlgo.W4A16_MXFP4)
    inputs = group["input_activations"]
    inputs_quant_strategy = inputs["strategy"]
    if weights["num_bits"] == 8:
        if weights_quant_strategy == "channel":
            return QuantConfig(quant_algo=QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN)
    raise ValueError("no")
"""

CONVERTER = """
def precision_to_config(precision, group_size, quant_config):
    table = {'int4': QuantAlgo.W4A16, 'int4_gptq': QuantAlgo.W4A16_GPTQ}
    return table.get(precision)


def update_quant_config_from_hf(quant_config, hf_config, override_fields):
    block = hf_config.to_dict()
    if block['quantization_config'].get('quant_method') == 'awq':
        quant_config.quant_algo = QuantAlgo.W4A16_GPTQ
        quant_config.group_size = block['quantization_config'].get('group_size', 64)
        override_fields.update({"use_autoawq": True})
    elif block['quantization_config'].get('quant_method') == 'gptq':
        ordered = block['quantization_config'].get('desc_act', False)
        if ordered:
            raise ValueError("act order")
        quant_config.quant_algo = QuantAlgo.W8A16_GPTQ
    return quant_config, override_fields
"""

LOADER = """
def load_weights_from_gptq(path, config):
    handle = safe_open(path)
    gptq_prefix = "model."
    gptq_suffix_list = [".qweight", ".qzeros", ".scales"]
    gptq_key_list = ["embed_tokens.weight", "self_attn.", "_proj", "mlp.down_proj"]
    sep = "."
    OFFSET = 0
    USE_GPTQ_FOR_LLAMA = 1

    def load(key):
        return handle.get_tensor(gptq_prefix + key)

    for layer in range(3):
        prefix = "layers" + sep + str(layer) + sep
        for suf in gptq_suffix_list:
            for comp in ["q", "v"]:
                load(prefix + gptq_key_list[1] + comp + gptq_key_list[2] + suf)
        parts = [load(prefix + gptq_key_list[3] + suf) for suf in gptq_suffix_list]
    load(gptq_key_list[0])
"""

ARGUMENTS = """
def parse_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument('--model_dir', type=str, default=None)
    parser.add_argument('--output_dir', type=str, default='out', help='where')
    parser.add_argument('--dtype', type=str, default='auto', choices=['auto', 'float16'])
    parser.add_argument('--tp_size', type=int, default=1)
    parser.add_argument('--pp_size', type=int, default=1)
    parser.add_argument('--workers', type=int, default=1)
    parser.add_argument('--level', '-l', nargs='?', const='x', default=Mode.DEFAULT)
    parser.add_argument('--use_weight_only', action="store_true", default=False)
    return parser.parse_args()


def convert_and_save_hf(args):
    quant_config = args_to_quant_config(args)
    try:
        config = AutoConfig.from_pretrained(args.model_dir)
        quant_config, extra = update_quant_config_from_hf(quant_config, config, {})
    except:
        pass
"""


def test_converter_arguments_and_where_the_quantization_comes_from():
    arguments = tab.converter_arguments(ARGUMENTS)
    assert arguments["dtype"] == {"choices": ["auto", "float16"], "default": "auto", "type": "str"}
    assert arguments["use_weight_only"] == {"action": "store_true", "default": False}
    assert arguments["level"] == {"const": "x", "default": {"named": "Mode.DEFAULT"}, "nargs": "?", "aliases": ["-l"]}
    assert tab.quantization_from_checkpoint(ARGUMENTS)
    flags_only = ARGUMENTS.replace("quant_config, extra = update", "extra = update")
    assert not tab.quantization_from_checkpoint(flags_only)
    source = {"path": "examples/x/convert_checkpoint.py"}
    converter = tab.converter(arguments, True, source)
    assert converter["script"] == source["path"] and list(converter["arguments"]) == list(tab.COMMAND_FLAGS)
    with pytest.raises(tab.UnrecognizedSource):
        tab.converter(arguments, False, source)
    with pytest.raises(tab.UnrecognizedSource):
        tab.converter({k: v for k, v in arguments.items() if k != "workers"}, True, source)


def test_pytorch_quant_methods_from_a_method_of_a_slice():
    assert tab.pytorch_quant_methods(MODEL_CONFIG) == ["fp8", "compressed-tensors"]


def test_compressed_tensors_schemes_say_which_need_activations():
    schemes = tab.compressed_tensors_schemes(SCHEMES)
    assert schemes == [
        {"quant_algo": "W4A16_MXFP4", "num_bits": 4, "type": "float", "needs_input_activations": False},
        {
            "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
            "num_bits": 8,
            "strategy": "channel",
            "needs_input_activations": True,
        },
    ]
    sources = {tab.MODEL_CONFIG: "mc", tab.QUANT_CONFIG_UTILS: "qcu"}
    verdicts = tab.pytorch_verdicts(["fp8", "compressed-tensors"], schemes, sources)
    assert not verdicts["gptq"]["loads"] and "'gptq'" in verdicts["gptq"]["lacks"]
    assert not verdicts["compressed-tensors"]["loads"] and verdicts["compressed-tensors"]["source"] == "qcu"


def test_engine_quant_methods_keys_defaults_and_refusals():
    methods = tab.engine_quant_methods(CONVERTER)
    assert methods["awq"] == {
        "quant_algo": "W4A16_GPTQ",
        "reads": {"group_size": {"default": 64, "sets": "group_size"}},
        "raises_when_true": [],
        "converter_options": {"use_autoawq": True},
    }
    assert methods["gptq"]["raises_when_true"] == ["desc_act"]
    assert tab.weight_only_precisions(CONVERTER) == {"int4": "W4A16", "int4_gptq": "W4A16_GPTQ"}


def test_gptq_loader_expands_the_module_names():
    loader = tab.gptq_loader(LOADER)
    assert loader == {
        "layer_prefix": "model.layers.{layer}.",
        "modules": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"],
        "tensor_suffixes": ["qweight", "qzeros", "scales"],
        "zero_point_offset": 1,
        "reads_g_idx": False,
    }
    sources = {tab.CONVERT_CHECKPOINT: "cc", tab.LLAMA_CONVERT: "lc"}
    verdicts = tab.engine_verdicts(tab.engine_quant_methods(CONVERTER), loader, sources)
    assert verdicts["gptq"]["requires"] == {"bits": 8, "desc_act": False, "packing": "gptq_v1"}
    assert verdicts["awq"]["requires"] == {"bits": 4, "packing": "awq_gemm"}
    assert not verdicts["compressed-tensors"]["loads"]


def test_unrecognized_source_is_an_error():
    with pytest.raises(tab.UnrecognizedSource):
        tab.pytorch_quant_methods("def load_hf_quant_config(c):\n    return c\n")


def test_committed_table():
    table = facts("trtllm_prequantized")
    for release in ("1.0", "1.1", "1.2"):
        assert not any(v["loads"] for v in table["releases"][release]["pytorch"].values())
    for release in ("0.19", "1.2"):
        engine = table["releases"][release]["tensorrt"]
        assert engine["gptq"]["loads"] and engine["awq"]["loads"] and not engine["compressed-tensors"]["loads"]
    assert table["releases"]["0.19"]["pytorch"] is None
    for source in table["tensorrt"]["source"] + table["pytorch"]["source"]:
        assert len(source["commit"]) == 40
    for release in ("0.18", "1.2"):
        for method in ("gptq", "awq"):
            converter = table["releases"][release]["tensorrt"][method]["converter"]
            assert converter["quantization_from_checkpoint_config"] and converter["script"].endswith(
                "convert_checkpoint.py"
            )
            assert converter["arguments"]["dtype"]["choices"] == ["auto", "float16", "bfloat16", "float32"]
    assert "int4_gptq" in table["tensorrt"]["converter_arguments"]["weight_only_precision"]["choices"]
