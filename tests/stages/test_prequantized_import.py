"""Already-quantized checkpoints on the onnxruntime target (pipeline/prequantized.py): `validate` names what it
detects and refuses a config that would quantize it again; a build keeps the checkpoint's codes in the engine bit for
bit (read back from the engine's MatMulNBits initializers) and decodes greedily as transformers does on the float
weights those codes stand for. The checkpoints are written here from the tiny Llama
(tests/prequantized_checkpoints.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.numpy import load_file

from pipeline.targets.onnxruntime import ONNX_NAME
from pipeline.targets.onnxruntime.graph import fused_parts
from pipeline.targets.onnxruntime.quantize import fuse, module_name
from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner
from tests.conftest import run_cli, write_config
from tests.prequantized_checkpoints import rtn_linears, write_checkpoint

# (packing, bits, group_size, desc_act, symmetric, method): act-order GPTQ, AWQ, per-channel symmetric 8-bit
CASES = [
    ("gptq_v1", 4, 32, True, False, "gptq"),
    ("awq_gemm", 4, 32, False, False, "awq"),
    ("pack_quantized", 8, -1, False, True, "compressed-tensors"),
]
PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30 w40 w50 w60", "w7"]


@pytest.fixture(scope="module", params=CASES, ids=[case[0] for case in CASES])
def checkpoint(request, tiny_llama, tmp_path_factory):
    packing, bits, group_size, desc_act, symmetric, method = request.param
    state = load_file(tiny_llama / "model.safetensors")
    linears = rtn_linears(state, bits, group_size, symmetric, desc_act)
    out = tmp_path_factory.mktemp(packing)
    write_checkpoint(tiny_llama, out / "model", linears, packing, bits, group_size, desc_act, symmetric)
    return out / "model", linears, request.param


def quantization(case, **changes) -> str:
    _, bits, group_size, _, _, method = case
    fields = {"weights": f"int{bits}", "method": method, "group_size": group_size, **changes}
    return "{" + ", ".join(f"{key}: {value}" for key, value in fields.items()) + "}"


def config(path: Path, model: Path, quantization: str) -> Path:
    return write_config(
        path,
        f"""
        model: {{source: hf, path: {model}}}
        quantization: {quantization}
        build: {{max_input_len: 64, max_seq_len: 128}}
        verify: {{eval_tokens: 256, max_perplexity_increase: 0.5}}
        """,
    )


def test_validate_names_the_checkpoint_quantization_and_refuses_another(checkpoint, tmp_path):
    model, _, case = checkpoint
    result = run_cli("validate", str(config(tmp_path / "keep.yaml", model, quantization(case))))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the checkpoint is {case[5]} int{case[1]}" in result.stdout
    assert "the engine keeps its weights as they are" in result.stdout

    result = run_cli("validate", str(config(tmp_path / "again.yaml", model, "{weights: int4, method: rtn}")))
    assert result.returncode != 0
    assert f"the checkpoint is already {case[5]} int{case[1]}" in result.stdout + result.stderr
    assert f"set weights: int{case[1]}, method: {case[5]}, group_size: {case[2]}" in result.stdout + result.stderr

    dequantized = "{weights: int4, method: rtn, group_size: 32, checkpoint_quantization: dequantize}"
    result = run_cli("validate", str(config(tmp_path / "anew.yaml", model, dequantized)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported as the float weights its codes stand for" in result.stdout


def engine_codes(engine_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
    """{graph matmul module: (codes [N, K], scales [N, blocks], zero points [N, blocks], input order or None)} read
    back from the engine's MatMulNBits nodes."""
    model = onnx.load(str(engine_dir / ONNX_NAME))
    weights = {i.name: numpy_helper.to_array(i, str(engine_dir)) for i in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        rows, columns, bits = attrs["N"], attrs["K"], attrs["bits"]
        packed = weights[node.input[1]].reshape(rows, -1)
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, -1) if bits == 4 else packed
        blocks = weights[node.input[1]].shape[1]
        scales = weights[node.input[2]].reshape(rows, blocks)
        zeros = np.full((rows, blocks), 2 ** (bits - 1), np.uint8)
        if len(node.input) > 3 and node.input[3]:
            zp = weights[node.input[3]].reshape(rows, -1)
            zeros = (np.stack([zp & 15, zp >> 4], axis=-1).reshape(rows, -1) if bits == 4 else zp)[:, :blocks]
        gather = producers.get(node.input[0])
        order = weights[gather.input[1]] if gather is not None and gather.op_type == "Gather" else None
        out[module_name(node.name.removesuffix(f"_Q{bits}"))] = (codes[:, :columns], scales, zeros, order)
    return out


@pytest.fixture(scope="module")
def built(checkpoint, tmp_path_factory, cli_build):
    model, _, case = checkpoint
    out = tmp_path_factory.mktemp("built")
    result = cli_build(str(config(out / "keep.yaml", model, quantization(case))), "--output", str(out / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "out"


def test_the_engine_holds_the_checkpoint_codes_bit_for_bit(checkpoint, built):
    _, linears, case = checkpoint
    found = engine_codes(built / "engine")
    modules = {module for module in found if module != "lm_head"}
    assert len(modules) == 2 * 4  # qkv, o, gate_up, down in each of two layers; lm_head stays float
    assert "lm_head" not in found
    for module in modules:
        codes, scales, zeros, order = found[module]
        want = fuse(linears, fused_parts(module))
        if case[3]:  # act-order: the engine holds the rows in group order and gathers its input so
            np.testing.assert_array_equal(want.g_idx[order], np.sort(want.g_idx))
            want_codes = want.codes[:, order]
        else:
            assert order is None
            want_codes = want.codes
        np.testing.assert_array_equal(codes, want_codes)
        block = want.codes.shape[1] // scales.shape[1] if want.group_size == -1 else want.group_size
        group_of_block = np.arange(scales.shape[1]) * min(block, 128) // block
        np.testing.assert_array_equal(scales, want.scales[:, group_of_block].astype(np.float32))
        np.testing.assert_array_equal(zeros, want.zeros[:, group_of_block])


def greedy_pairs(engine_dir: Path, import_dir: Path):
    """(the engine's greedy continuation, transformers' on the imported float weights, transformers' top-2 logits at
    each position) for each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(import_dir)
    reference = AutoModelForCausalLM.from_pretrained(import_dir, dtype=torch.float32).eval()
    runner = ModelRunner.from_dir(engine_dir, num_threads=1)
    ids = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    out = runner.generate(ids, max_new_tokens=8, end_id=-1, return_dict=True)
    for row, prompt in enumerate(ids):
        with torch.no_grad():
            want = reference.generate(
                prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            top = reference(want).logits[0].topk(2, dim=-1)
        yield out["output_ids"][row, 0, : want.shape[1]].tolist(), want[0].tolist(), top, len(prompt)


def test_with_float_activations_greedy_tokens_equal_transformers_on_the_dequantized_weights(built, tmp_path):
    """The engine's MatMulNBits set to compute in float32 (accuracy_level 0) multiply the checkpoint's exact
    weights: greedy decoding is transformers' token for token."""
    engine = tmp_path / "engine"
    shutil.copytree(built / "engine", engine)
    model = onnx.load(str(engine / ONNX_NAME))
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept)
    onnx.save(model, str(engine / ONNX_NAME), save_as_external_data=True, location=ONNX_NAME + ".data")
    for got, want, _, _ in greedy_pairs(engine, built / "import"):
        assert got == want


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(built):
    """As built (int8 activations, MatMulNBits accuracy_level 4): token for token up to a near tie of transformers'
    top two logits (gap < 0.01), which int8 activations may settle the other way; the engine must then have picked
    the runner-up, and the tokens after it are not compared."""
    compared = 0
    for got, want, top, start in greedy_pairs(built / "engine", built / "import"):
        for position in range(start, len(want)):
            if got[position] != want[position]:
                gap = float(top.values[position - 1, 0] - top.values[position - 1, 1])
                assert gap < 0.01 and got[position] == top.indices[position - 1, 1], (position, gap)
                break
            compared += 1
    assert compared >= 12
