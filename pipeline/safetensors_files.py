"""Safetensors files read and written one tensor at a time: the import stage normalises a checkpoint of any size
with no more than one tensor in memory.

The safetensors library writes a file only from a dict of every tensor in memory (`save_file`), so the writer is
by hand; the format is an 8-byte little-endian header length, a JSON header (dtype, shape, data offsets per tensor),
then the tensors' bytes (huggingface/safetensors README.md "Format", commit 0034b77cb9403f7e498764de4a2a291d8bcbd9f1).
Its own serializer pads the header to 8 bytes with spaces and puts the widest dtypes first, then sorts by name, so
each tensor is aligned (safetensors/src/tensor.rs `prepare`, commit 45c8c2cbd1a86ce87866a584410984bcd9aa25fc).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable

_COPY_CHUNK = 64 << 20


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(each tensor's header entry by name, the file offset its data offsets count from); ValueError for a header
    longer than the file, or tensors that do not end where the file does (a truncated or padded file)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        length = file.stat().st_size
        if size > length - 8:
            raise ValueError(f"{file}: its header is longer than the file")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + size + end != length:  # as safetensors' own reader refuses it: "file not fully covered"
        raise ValueError(f"{file}: its tensors end at byte {8 + size + end:,} of a {length:,}-byte file (truncated?)")
    return header, 8 + size


def tensor_headers(directory: Path) -> dict[str, tuple[str, list[int]]]:
    """{name: (safetensors dtype, shape)} over every *.safetensors file of `directory`, from the headers only."""
    return {
        name: (entry["dtype"], list(entry["shape"]))
        for file in sorted(directory.glob("*.safetensors"))
        for name, entry in read_header(file)[0].items()
    }


# bytes per element of each safetensors dtype: also the alignment its data gets
ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
ELEMENT_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _header(entries: list[tuple[str, str, list[int], int]]) -> tuple[bytes, list[tuple[str, str, list[int], int]]]:
    """The file's header for (name, dtype, shape, bytes) entries, and the entries in the order their data follows:
    the widest dtypes first, then by name, so each tensor is aligned to its dtype; padded to 8 bytes."""
    ordered = sorted(entries, key=lambda entry: (-ELEMENT_BYTES.get(entry[1], 1), entry[0]))
    header, offset = {}, 0
    for name, dtype, shape, length in ordered:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


def copy_tensors(
    out_file: Path, tensors: Iterable[tuple[str, Path]], check: Callable[[str, Path], None] = lambda n, f: None
) -> dict[str, dict]:
    """Write `tensors` (name, the safetensors file holding it) into one file, each tensor's bytes copied as they
    are, after `check(name, file)`. Returns the header written."""
    headers: dict[Path, tuple[dict, int]] = {}
    source = {}
    for name, file in tensors:
        if file not in headers:
            headers[file] = read_header(file)
        source[name] = (file, headers[file][0][name])
    entries = [(n, i["dtype"], i["shape"], i["data_offsets"][1] - i["data_offsets"][0]) for n, (_, i) in source.items()]
    header, ordered = _header(entries)
    with open(out_file, "wb") as out:
        out.write(header)
        for name, *_ in ordered:
            file, info = source[name]
            check(name, file)
            start, end = info["data_offsets"]
            with open(file, "rb") as stored:
                stored.seek(headers[file][1] + start)
                copy_bytes(stored, out, end - start)
    written = json.loads(header[8:])
    return {name: written[name] for name in source}


# numpy's name of each safetensors dtype a made tensor may have (bfloat16 and the FP8 ones have none)
NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16"}
NUMPY_DTYPES |= {"I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}


def write_tensors(out_file: Path, tensors: list[tuple[str, str, list[int], Callable[[], object]]]) -> dict[str, dict]:
    """Write tensors made one at a time into one file: (name, safetensors dtype, shape, a function making the numpy
    array of that dtype and shape) each, made only when its bytes are written and dropped before the next is made.
    Returns the header written; ValueError names a tensor made with another dtype or shape than announced."""
    import numpy as np

    made = {name: (dtype, shape, make) for name, dtype, shape, make in tensors}
    entries = [(n, d, s, math.prod(s) * ELEMENT_BYTES[d]) for n, (d, s, _) in made.items()]
    header, ordered = _header(entries)
    with open(out_file, "wb") as out:
        out.write(header)
        for name, dtype, shape, _ in ordered:
            value = np.require(made[name][2](), requirements="C")
            if list(value.shape) != list(shape) or value.dtype != np.dtype(NUMPY_DTYPES[dtype]):
                raise ValueError(f"{name}: made {value.dtype} {list(value.shape)}, announced {dtype} {list(shape)}")
            if value.nbytes:
                out.write(memoryview(value.reshape(-1)).cast("B"))
            value = None  # one tensor at a time: dropped before the next is made
    written = json.loads(header[8:])
    return {name: written[name] for name in made}


def copy_bytes(source, target, length: int) -> None:
    """`length` bytes from the open file `source`, at its position, to `target`, a chunk at a time."""
    while length:
        chunk = source.read(min(length, _COPY_CHUNK))
        if not chunk:
            raise OSError(f"{source.name}: ends {length} bytes before the tensor it holds")
        target.write(chunk)
        length -= len(chunk)
