"""ONNX initializers kept on disk while a graph is written or rewritten, so that no stage holds a model's weights.

`onnx.save(..., save_as_external_data=True)` needs every tensor in memory first (the export held three copies of
the weights that way, 12-16 bytes per parameter). Here each initializer is written to its data file as it is made,
and a rewritten graph (the engine stage's quantization) reads one weight at a time from the file it came from. The
files come out as `onnx.save` writes them with `all_tensors_to_one_file=True, size_threshold=1024`: the tensors in
initializer order, the same external-data fields, so the bytes do not depend on which way a graph was written.
Written by hand because onnx has no incremental writer (`onnx.external_data_helper` only converts a loaded model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pipeline.safetensors_files import copy_bytes

SIZE_THRESHOLD = 1024  # onnx.save's size_threshold as the stages call it: smaller tensors stay inside the graph
_BYTES_OVERHEAD = sys.getsizeof(b"")  # onnx compares sys.getsizeof(raw_data), not its length, with the threshold


def external(nbytes: int) -> bool:
    """Whether `onnx.save` would move a tensor of `nbytes` to the data file."""
    return nbytes + _BYTES_OVERHEAD >= SIZE_THRESHOLD


def tensor_proto(name: str, array: np.ndarray):
    """A TensorProto of `array` (numpy_helper.from_array's fields) with no data: the caller places the bytes."""
    from onnx import TensorProto, helper

    proto = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    proto.dims.extend(array.shape)
    return proto


def point(proto, location: str, offset: int, length: int) -> None:
    """Make `proto` refer to `length` bytes at `offset` of `location`, with the fields and order onnx's
    `set_external_data` writes (it insists on the bytes being in memory first)."""
    proto.ClearField("raw_data")
    del proto.external_data[:]
    proto.data_location = proto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = proto.external_data.add()
        entry.key, entry.value = key, str(value)


class DataWriter:
    """Appends initializers to one external-data file as they are made."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "wb")

    def add(self, name: str, array: np.ndarray):
        """The initializer `name` holding `array`: its bytes in the data file when onnx.save would put them there."""
        array = np.ascontiguousarray(array)
        proto = tensor_proto(name, array)
        if not external(array.nbytes):
            proto.raw_data = array.tobytes()
            return proto
        offset = self.file.tell()
        self.file.write(memoryview(array).cast("B"))
        point(proto, self.path.name, offset, array.nbytes)
        return proto

    def close(self) -> None:
        self.file.close()


class Initializers:
    """The initializers of a graph loaded with `load_external_data=False`, read one at a time from their files, and
    the new ones a rewrite makes, written to a scratch file as they are made. The graph never holds a weight's
    bytes: protobuf (upb) keeps every byte string a message was given in the message's arena until the message is
    freed, so bytes set into the graph and cleared again still take memory (a rewrite that did so held every
    weight it had quantized)."""

    def __init__(self, model, base_dir: Path, scratch: Path):
        from onnx.external_data_helper import ExternalDataInfo, uses_external_data

        self.model = model
        self.where: dict[str, tuple[Path, int, int]] = {}  # name -> (file, offset, length) of its bytes
        for proto in model.graph.initializer:
            if uses_external_data(proto):
                info = ExternalDataInfo(proto)
                self.where[proto.name] = (base_dir / info.location, info.offset or 0, info.length)
        self.scratch_path = scratch
        self.scratch = open(scratch, "wb")

    def proto(self, name: str):
        return next(i for i in self.model.graph.initializer if i.name == name)

    def array(self, name: str) -> np.ndarray:
        """The values of initializer `name`, a writable copy (the files stay untouched)."""
        from onnx import helper, numpy_helper

        proto = self.proto(name)
        if name not in self.where:
            return numpy_helper.to_array(proto).copy()
        file, offset, length = self.where[name]
        dtype = helper.tensor_dtype_to_np_dtype(proto.data_type)
        values = np.fromfile(file, dtype=dtype, count=length // dtype.itemsize, offset=offset)
        return values.reshape(tuple(proto.dims))

    def put(self, name: str, array: np.ndarray) -> None:
        """Set initializer `name` (new, or replacing the old values) to `array`."""
        array = np.ascontiguousarray(array)
        proto = tensor_proto(name, array)
        if external(array.nbytes):
            self._write(proto, memoryview(array).cast("B"))
        else:
            proto.raw_data = array.tobytes()
        self._place(proto)

    def add(self, proto) -> None:
        """Add an initializer a library made (with its bytes in `raw_data`) to the graph, its bytes written out."""
        if proto.HasField("raw_data") and external(len(proto.raw_data)):
            pointer = type(proto)(name=proto.name, data_type=proto.data_type)
            pointer.dims.extend(proto.dims)
            self._write(pointer, proto.raw_data)
            proto = pointer
        self._place(proto)

    def scratch_graph(self, names):
        """A graph apart from the model's, holding the initializers among `names` with their values, for a library
        that reads a weight from a graph and adds its results there (ONNX Runtime's quantizers); `take_new` then
        moves what it added into the model's graph. Dropping it frees the bytes."""
        from onnx import GraphProto, numpy_helper

        graph = GraphProto()
        for name in names:
            if any(i.name == name for i in self.model.graph.initializer):
                graph.initializer.append(numpy_helper.from_array(self.array(name), name))
        return graph

    def take_new(self, graph, names) -> None:
        """`add` the initializers a library added to `graph` (a `scratch_graph` of `names`)."""
        for proto in graph.initializer:
            if proto.name not in names:
                self.add(proto)

    def _write(self, proto, data) -> None:
        offset = self.scratch.tell()
        self.scratch.write(data)
        self.where[proto.name] = (self.scratch_path, offset, self.scratch.tell() - offset)
        point(proto, self.scratch_path.name, offset, self.where[proto.name][2])

    def _place(self, proto) -> None:
        if not proto.external_data:
            self.where.pop(proto.name, None)
        existing = next((i for i in self.model.graph.initializer if i.name == proto.name), None)
        if existing is None:
            self.model.graph.initializer.append(proto)
        else:
            existing.CopyFrom(proto)  # a pointer or a small tensor: nothing big enters the graph's arena

    def save(self, out_path: Path) -> None:
        """Write the graph to `out_path` and its initializers, in order, to `out_path` + '.data', copying each from
        where it is; the scratch file is removed."""
        import onnx
        from onnx.external_data_helper import uses_external_data

        self.scratch.close()
        data_name = out_path.name + ".data"
        with open(out_path.parent / data_name, "wb") as data:
            for proto in self.model.graph.initializer:
                start = data.tell()
                if proto.HasField("raw_data") and external(len(proto.raw_data)):  # set by a library in the graph
                    data.write(proto.raw_data)
                elif uses_external_data(proto):
                    file, offset, length = self.where[proto.name]
                    with open(file, "rb") as source:
                        source.seek(offset)
                        copy_bytes(source, data, length)
                else:
                    continue
                point(proto, data_name, start, data.tell() - start)
        onnx.save(self.model, str(out_path))
        self.scratch_path.unlink(missing_ok=True)
