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
from pathlib import Path
from typing import Callable, Iterable

ALIGNMENT = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_COPY_CHUNK = 64 << 20


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(each tensor's header entry by name, the file offset its data offsets count from); ValueError for a header
    longer than the file."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > file.stat().st_size - 8:
            raise ValueError(f"{file}: its header is longer than the file")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def copy_tensors(
    out_file: Path, tensors: Iterable[tuple[str, Path]], check: Callable[[str, Path], None] = lambda n, f: None
) -> dict[str, dict]:
    """Write `tensors` (name, the safetensors file holding it) into one file, each tensor's bytes copied as they
    are, after `check(name, file)`; the widest dtypes first, then by name, so each tensor is aligned to its dtype.
    Returns the header written."""
    headers: dict[Path, tuple[dict, int]] = {}
    chosen = []
    for name, file in tensors:
        if file not in headers:
            headers[file] = read_header(file)
        chosen.append((name, file, headers[file][0][name]))
    chosen.sort(key=lambda item: (-ALIGNMENT.get(item[2]["dtype"], 1), item[0]))
    entries, offset = {}, 0
    for name, _, info in chosen:
        length = info["data_offsets"][1] - info["data_offsets"][0]
        entries[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + length]}
        offset += length
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(out_file, "wb") as out:
        out.write(len(header).to_bytes(8, "little") + header)
        for name, file, info in chosen:
            check(name, file)
            start, end = info["data_offsets"]
            with open(file, "rb") as source:
                source.seek(headers[file][1] + start)
                copy_bytes(source, out, end - start)
    return entries


def copy_bytes(source, target, length: int) -> None:
    """`length` bytes from the open file `source`, at its position, to `target`, a chunk at a time."""
    while length:
        chunk = source.read(min(length, _COPY_CHUNK))
        if not chunk:
            raise OSError(f"{source.name}: ends {length} bytes before the tensor it holds")
        target.write(chunk)
        length -= len(chunk)
