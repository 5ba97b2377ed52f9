"""Unpacking pre-quantized checkpoints' integer packings into `QuantizedLinear`, with numpy and safetensors only.

Each packing stores the integer codes of one linear in int32 words, several codes to a word, the first code in the
lowest bits; the packings differ in the dimension they pack along, the order of codes in a word and how the zero
points are stored. Sources (repository, path, commit) of each fact:

  GPT = ModelCloud/GPTQModel gptqmodel/nn_modules/qlinear/__init__.py @ f4c327a17eb3e24524d5a97a3d682e3696ae6a28
  GPM = ModelCloud/GPTQModel gptqmodel/utils/model.py @ f4c327a17eb3e24524d5a97a3d682e3696ae6a28
  GPQ = ModelCloud/GPTQModel gptqmodel/quantization/gptq.py @ f4c327a17eb3e24524d5a97a3d682e3696ae6a28
  AWG = casper-hansen/AutoAWQ awq/modules/linear/gemm.py @ 88e4c76b20755db275574e6a03c83c84ba3bece5
  AWU = casper-hansen/AutoAWQ awq/utils/packing_utils.py @ 88e4c76b20755db275574e6a03c83c84ba3bece5
  CTP = neuralmagic/compressed-tensors src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py
        @ 2dd1b627950b4a068f2c1af19bc6f31b7fbb3316 (tag 0.12.2)
  CTB = the same repository, .../quantized_compressors/base.py @ ed3ac7c10cc533aa8535a28b803cb7cf46d3b7ee and ^ (the
        commit that began packing asymmetric zero points; before it they were saved unpacked, int8)
  CTI = the same repository, src/compressed_tensors/quantization/lifecycle/initialize.py @ 2dd1b627950b...

GPTQ (GPT `_register_gptq_buffers`, `pack_block`): per linear `qweight` int32 [in*bits/32, out] packed along the
  input dimension (input row k*n+j in bits j*bits.. of word row k, n = 32/bits); `qzeros` int32 [groups,
  out*bits/32] packed along the output dimension the same way; `scales` float16 [groups, out]; `g_idx` int32 [in]
  (i // group_size unless act-order; group_size -1 is one group of all inputs); optional `bias` [out]. With
  act-order, g_idx[i] = (rank of input i in the act order) // group_size (GPQ). checkpoint_format "gptq" (v1) stores
  each zero point minus one, by subtracting 0x11111111 (4 bits) or 0x01010101 (8 bits) from the whole packed word;
  loading adds it back the same way (GPM convert_gptq_v2_to_v1_format_module / convert_gptq_v1_to_v2_format_module);
  "gptq_v2" stores zero points as they are. Symmetric GPTQ stores the zero 2**(bits-1) like any other.
AWQ GEMM (AWG WQLinear_GEMM, 4 bits only): `qweight` int32 [in, out/8] packed along the output dimension, field i
  of word c holding output column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] (AWU AWQ_ORDER); `qzeros` int32 [groups, out/8] in
  the same order, the zero points as they are; `scales` float16 [groups, out]; no g_idx.
compressed-tensors pack-quantized (CTP): `weight_packed` int32 [out, ceil(in*bits/32)] packed along the input
  dimension in natural order, each code stored as its signed value plus 2**(bits-1), the last word zero-padded;
  `weight_shape` [2] = (out, in); `weight_scale` [out, groups] in the weight's dtype (CTI); asymmetric group/channel
  weights only: `weight_zero_point` int32 [ceil(out*bits/32), groups] packed along the output dimension with the
  same offset (CTP since 0.10.0; earlier int8 [out, groups], signed, unpacked: CTB); group act-order only:
  `weight_g_idx` int32 [in] (CTI). A symmetric scheme's zero is the signed 0, code 2**(bits-1).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipeline.errors import CheckpointError
from pipeline.nonfinite import nonfinite_tensor
from pipeline.prequantized import CheckpointQuantization, QuantizedLinear

WORD_BITS = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of an AWQ word holds column AWQ_ORDER[i] of its eight (AWU)
SCALE_DTYPES = (np.float16, np.float32)  # bfloat16 scales arrive here as float32 (see `StoredTensors`)
# The tensor whose name marks a module as quantized, per packing, and every tensor such a module may have.
MARKER = {"gptq_v1": "qweight", "gptq_v2": "qweight", "awq_gemm": "qweight", "pack_quantized": "weight_packed"}
MODULE_TENSORS = {
    "qweight": ("qweight", "qzeros", "scales", "g_idx", "bias"),
    "weight_packed": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "bias"),
}


def codes_per_word(bits: int) -> int:
    return WORD_BITS // bits


def unpack_fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint8 codes of int32 `words`, each word's codes (lowest bits first) laid out consecutively along `axis`."""
    n = codes_per_word(bits)
    unsigned = np.ascontiguousarray(words).view(np.uint32)
    fields = np.stack([(unsigned >> np.uint32(j * bits)) & np.uint32(2**bits - 1) for j in range(n)], axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= n
    return fields.reshape(shape).astype(np.uint8)


def _check(where: str, name: str, array: np.ndarray | None, shape: tuple, dtypes: tuple) -> np.ndarray:
    expected = " or ".join(np.dtype(d).name for d in dtypes)
    if array is None:
        raise CheckpointError(f"{where}{name} is missing: expected {expected} {list(shape)}")
    if array.dtype not in [np.dtype(d) for d in dtypes] or tuple(array.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}{name}: expected {expected} {list(shape)}, found {array.dtype.name} {list(array.shape)}"
        )
    return array


def _matrix(where: str, name: str, array: np.ndarray | None, shape: str, dtypes: tuple) -> np.ndarray:
    """A 2-D tensor of one of `dtypes`, before its sizes can be checked against the others'."""
    if array is None or array.ndim != 2 or array.dtype not in [np.dtype(d) for d in dtypes]:
        found = "nothing" if array is None else f"{array.dtype.name} {list(array.shape)}"
        raise CheckpointError(
            f"{where}{name}: expected {' or '.join(np.dtype(d).name for d in dtypes)} {shape}, found {found}"
        )
    return array


def _groups(rows: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-rows // group_size)


def _g_idx(where: str, name: str, g_idx, rows: int, groups: int, group_size: int, required: bool, rows_from: str):
    """The checkpoint's g_idx, or None where it is absent or only says the contiguous groups; `rows_from` says which
    tensor gives the input count `rows`."""
    if g_idx is None:
        if required:
            raise CheckpointError(f"{where}{name} is missing: expected int32 [{rows}] (the checkpoint says act-order)")
        return None
    if g_idx.shape != (rows,):  # one entry per input row
        found = g_idx.shape[0] if g_idx.ndim == 1 else f"shape {list(g_idx.shape)}"
        raise CheckpointError(f"{where}{name}: expected {rows} entries (one per input row: {rows_from}), found {found}")
    g_idx = _check(where, name, g_idx, (rows,), (np.int32, np.int64)).astype(np.int32)
    if rows and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise CheckpointError(f"{where}{name}: values from {g_idx.min()} to {g_idx.max()}, expected 0 to {groups - 1}")
    size = rows if group_size == -1 else group_size
    return None if np.array_equal(g_idx, np.arange(rows) // size) else g_idx


def _bias(where: str, bias: np.ndarray | None, out: int) -> np.ndarray | None:
    return None if bias is None else _check(where, "bias", bias, (out,), SCALE_DTYPES)


def _unpack_gptq(t: dict, q: CheckpointQuantization, where: str) -> QuantizedLinear:
    n = codes_per_word(q.bits)
    qweight = _matrix(where, "qweight", t.get("qweight"), "[in*bits/32, out]", (np.int32,))
    scales = _matrix(where, "scales", t.get("scales"), "[groups, out]", SCALE_DTYPES)
    rows, out = qweight.shape[0] * n, scales.shape[1]  # the codes themselves say how many inputs there are
    packed = f"qweight int32 {list(qweight.shape)}"  # what gives the input count
    groups = _groups(rows, q.group_size)
    _check(where, "qweight", qweight, (rows // n, out), (np.int32,))
    _check(where, "scales", scales, (groups, out), SCALE_DTYPES)
    if out % n:
        raise CheckpointError(f"{where}scales: {out} outputs do not fill whole int32 words of {n} codes (qzeros)")
    qzeros = _check(where, "qzeros", t.get("qzeros"), (groups, out // n), (np.int32,))
    if q.packing == "gptq_v1":  # undo the whole-word "minus one" (GPM)
        one_each = sum(1 << (j * q.bits) for j in range(n))
        qzeros = (qzeros.view(np.uint32).astype(np.uint64) + one_each).astype(np.uint32).view(np.int32)
    return QuantizedLinear(
        codes=unpack_fields(qweight, q.bits, axis=0).T.copy(),
        scales=scales.T.copy(),
        zeros=unpack_fields(qzeros, q.bits, axis=1).T.copy(),
        g_idx=_g_idx(where, "g_idx", t.get("g_idx"), rows, groups, q.group_size, q.desc_act, packed),
        bits=q.bits,
        group_size=q.group_size,
        bias=_bias(where, t.get("bias"), out),
    )


def _unpack_awq(t: dict, q: CheckpointQuantization, where: str) -> QuantizedLinear:
    if q.bits != 4:
        raise CheckpointError(f"{where}AWQ's GEMM packing holds 4-bit codes only, the config says {q.bits}")
    qweight = _matrix(where, "qweight", t.get("qweight"), "[in, out/8]", (np.int32,))
    rows, out = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(rows, q.group_size)
    if q.group_size != -1 and rows % q.group_size:
        raise CheckpointError(f"{where}qweight: {rows} inputs are not whole groups of {q.group_size}")
    _check(where, "qweight", qweight, (rows, out // 8), (np.int32,))
    scales = _check(where, "scales", t.get("scales"), (groups, out), SCALE_DTYPES)
    qzeros = _check(where, "qzeros", t.get("qzeros"), (groups, out // 8), (np.int32,))
    if t.get("g_idx") is not None:
        raise CheckpointError(f"{where}g_idx: AWQ's GEMM packing has no act-order, found {list(t['g_idx'].shape)}")

    def natural(words):  # field i of each word is column AWQ_ORDER[i] of its eight
        fields = unpack_fields(words, 4, axis=1).reshape(words.shape[0], -1, 8)
        columns = np.empty_like(fields)
        columns[:, :, list(AWQ_ORDER)] = fields
        return columns.reshape(words.shape[0], -1)

    return QuantizedLinear(
        codes=natural(qweight).T.copy(),
        scales=scales.T.copy(),
        zeros=natural(qzeros).T.copy(),
        g_idx=None,
        bits=4,
        group_size=q.group_size,
        bias=_bias(where, t.get("bias"), out),
    )


def _unpack_compressed_tensors(t: dict, q: CheckpointQuantization, where: str) -> QuantizedLinear:
    n, offset = codes_per_word(q.bits), 2 ** (q.bits - 1)
    shape = _check(where, "weight_shape", t.get("weight_shape"), (2,), (np.int32, np.int64))
    out, rows = (int(v) for v in shape)
    words = -(-rows // n)
    groups = _groups(rows, q.group_size)
    packed = _check(where, "weight_packed", t.get("weight_packed"), (out, words), (np.int32,))
    scales = _check(where, "weight_scale", t.get("weight_scale"), (out, groups), SCALE_DTYPES)
    codes = unpack_fields(packed, q.bits, axis=1)[:, :rows]
    zero_point = t.get("weight_zero_point")
    if q.symmetric:
        if zero_point is not None and (zero_point.dtype != np.int8 or np.any(zero_point)):
            raise CheckpointError(
                f"{where}weight_zero_point: a symmetric scheme's zero points are int8 zeros, found "
                f"{zero_point.dtype.name} {list(zero_point.shape)}"
            )
        zeros = np.full((out, groups), offset, np.uint8)
    elif zero_point is not None and zero_point.dtype == np.int8:  # before compressed-tensors 0.10.0 (CTB)
        zeros = (_check(where, "weight_zero_point", zero_point, (out, groups), (np.int8,)) + offset).astype(np.uint8)
    else:
        zero_point = _check(where, "weight_zero_point", zero_point, (-(-out // n), groups), (np.int32,))
        zeros = unpack_fields(zero_point, q.bits, axis=0)[:out]
    return QuantizedLinear(
        codes=codes,
        scales=scales.copy(),
        zeros=zeros,
        g_idx=_g_idx(where, "weight_g_idx", t.get("weight_g_idx"), rows, groups, q.group_size, False, "weight_shape"),
        bits=q.bits,
        group_size=q.group_size,
        bias=_bias(where, t.get("bias"), out),
    )


UNPACKERS = {
    "gptq_v1": _unpack_gptq,
    "gptq_v2": _unpack_gptq,
    "awq_gemm": _unpack_awq,
    "pack_quantized": _unpack_compressed_tensors,
}


def unpack(tensors: dict[str, np.ndarray], q: CheckpointQuantization, module: str = "") -> QuantizedLinear:
    """One linear's tensors (names without the module prefix) as a QuantizedLinear; CheckpointError names the tensor
    (prefixed by `module`) and what was expected of it."""
    where = f"{module}." if module else ""
    if q.bits not in (4, 8) or q.packing not in UNPACKERS:
        raise CheckpointError(f"{module or 'linear'}: {q.packing} with {q.bits} bits cannot be unpacked")
    known = set(MODULE_TENSORS[MARKER[q.packing]])
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise CheckpointError(f"{where}{unknown[0]}: not a tensor of {q.packing} (expected {', '.join(sorted(known))})")
    return UNPACKERS[q.packing](tensors, q, where)


class StoredTensors(Mapping[str, np.ndarray]):
    """A directory's *.safetensors tensors (shards included) by name, each read from its file when looked up, as
    numpy (bfloat16, which numpy lacks, as float32 exactly, from its bits) and refused if not finite: a checkpoint
    of any size is read one tensor at a time."""

    def __init__(self, hf_dir: Path):
        from pipeline.safetensors_files import read_header

        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{hf_dir}: no *.safetensors files")
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            try:
                header, base = read_header(path)
            except (OSError, ValueError) as error:
                raise CheckpointError(f"{path}: unreadable safetensors file ({error})") from error
            self.where |= {name: (path, info, base) for name, info in header.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        path, info, base = self.where[name]
        try:
            if info["dtype"] == "BF16":
                start, end = info["data_offsets"]
                value = np.fromfile(path, np.uint16, count=(end - start) // 2, offset=base + start).astype(np.uint32)
                value <<= 16  # in place: a bfloat16 is the high half of the float32 it stands for
                value = value.view(np.float32).reshape(info["shape"])
            else:
                with safe_open(str(path), framework="np") as reader:
                    value = reader.get_tensor(name)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: unreadable safetensors file ({error})") from error
        _refuse_nonfinite(path, name, value)
        return value

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, name) -> bool:  # from the headers: Mapping's own would read the tensor
        return name in self.where

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype (F16, BF16, I32...), from its header."""
        return self.where[name][1]["dtype"]


class QuantizedLinears(Mapping[str, QuantizedLinear]):
    """A checkpoint's quantized linears by HF module name, each unpacked from its own tensors when looked up and
    kept by no one here: an engine placing them, or the import dequantizing them, holds one at a time."""

    def __init__(self, tensors: StoredTensors, q: CheckpointQuantization, hf_dir: Path):
        self.tensors, self.q, self.marker = tensors, q, MARKER[q.packing]
        suffix = f".{self.marker}"
        self.modules = sorted(name[: -len(suffix)] for name in tensors if name.endswith(suffix))
        self.known = frozenset(self.modules)
        if not self.modules:
            raise CheckpointError(f"{hf_dir}: no '*{suffix}' tensors, yet config.json says {q.describe()}")
        self.parts = {
            f"{module}.{part}"
            for module in self.modules
            for part in MODULE_TENSORS[self.marker]
            if f"{module}.{part}" in tensors
        }

    def __getitem__(self, module: str) -> QuantizedLinear:
        if module not in self.known:
            raise KeyError(module)
        own = {n: self.tensors[f"{module}.{n}"] for n in MODULE_TENSORS[self.marker] if f"{module}.{n}" in self.tensors}
        return unpack(own, self.q, module)

    def __iter__(self):
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __contains__(self, module) -> bool:
        return module in self.known


def _refuse_nonfinite(path: Path, name: str, values: np.ndarray) -> None:
    """A NaN or infinite scale makes every weight of its group so, and the quality gate's scores NaN after it: the
    tensor is named as it is read, before anything is built from it."""
    problem = nonfinite_tensor(name, values)
    if problem:
        raise CheckpointError(
            f"{path}: {problem}: the file is damaged or its quantizer diverged. Download the checkpoint again, or "
            "quantize the float model (quantization.weights with method rtn, gptq or awq) instead"
        )


def quantized_linears(hf_dir: Path, q: CheckpointQuantization) -> QuantizedLinears:
    """The quantized linears of all the directory's *.safetensors files (shards included) by HF module name, each
    unpacked when looked up."""
    return QuantizedLinears(StoredTensors(hf_dir), q, hf_dir)


def float32(tensors: StoredTensors, name: str) -> np.ndarray:
    """A stored tensor, in float32 if it is floating (as the float checkpoint holds it)."""
    value = tensors[name]
    return value.astype(np.float32, copy=False) if np.issubdtype(value.dtype, np.floating) else value


def write_dequantized(
    hf_dir: Path, q: CheckpointQuantization, out_file: Path, shapes: dict[str, list[int]], leave_out=frozenset()
) -> dict:
    """The float checkpoint the quantized one stands for, written to `out_file` one tensor at a time: each quantized
    module's weight (and bias) dequantized to float32, every other floating tensor in float32, under the names and
    `shapes` of transformers' model (HF name -> shape), stored tensors named in `leave_out` (a tied lm_head) left
    out. Returns the header written; CheckpointError names a tensor missing or not the model's."""
    from pipeline.safetensors_files import write_tensors

    linears = quantized_linears(hf_dir, q)
    tensors = linears.tensors
    made = {f"{module}.weight": (lambda m=module: linears[m].dequantize()) for module in linears}
    made |= {  # a linear's own bias, stored beside its codes, in float32 (`_bias` checks its shape on unpacking)
        f"{module}.bias": (lambda m=module: float32(tensors, f"{m}.bias"))
        for module in linears
        if f"{module}.bias" in tensors
    }
    made |= {name: (lambda n=name: float32(tensors, n)) for name in tensors if name not in linears.parts}
    made = {name: make for name, make in made.items() if name not in leave_out}
    missing, unexpected = sorted(set(shapes) - set(made)), sorted(set(made) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(
            f"{hf_dir}: after unpacking its {q.packing} tensors, "
            + "; ".join(
                f"{label} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                for label, names in (("missing", missing), ("unexpected", unexpected))
                if names
            )
        )
    floats = ("F64", "F32", "F16", "BF16")
    dtypes = {
        name: "F32" if name not in tensors or tensors.dtype(name) in floats else tensors.dtype(name) for name in made
    }
    try:
        return write_tensors(out_file, [(name, dtypes[name], shapes[name], make) for name, make in made.items()])
    except ValueError as exc:  # the codes describe another shape than config.json gives the model
        raise CheckpointError(
            f"{hf_dir}: {exc} by {hf_dir / 'config.json'}; the codes and the config disagree"
        ) from None
