"""A graph's weights as external data: its initializers in one file beside it, `<graph file>.data`.

Held whole, a graph costs its size again at every step that copies it (the list of initializers, the graph
they are copied into, the serialisation the checker parses, the bytes `onnx.save` writes), and a protobuf
holds at most 2 GB. Here each weight goes to the data file the moment it is made, so the graph's proto
holds only names, shapes and offsets; a derived graph (INT8, INT4) reads its source's weights one at a time,
memory-mapped, and writes its own data file the same way. docs/onnx.md#export-within-memory has the
measurements.

Tensors under INLINE_BYTES stay inside the graph (onnx's own threshold for external data). Each external
tensor starts at a multiple of ALIGN bytes, so that it can be mapped in place. The location is the data
file's name, relative to the graph, as onnx and onnxruntime resolve it: both load such a graph from its
path with nothing else to say, and graphs written before, with their weights inside, load as they did.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

DATA_SUFFIX = ".data"
INLINE_BYTES = 1024  # smaller tensors stay inside the graph
ALIGN = 4096  # external tensors start at a multiple of this (a page), so they can be memory-mapped


def data_path(graph: Path) -> Path:
    """Where graph file `graph` keeps its weights."""
    return graph.with_name(graph.name + DATA_SUFFIX)


class DataFile:
    """Initializers written to `<graph>.data` as they are made; use as a context manager."""

    def __init__(self, graph: str | Path):
        self.path = data_path(Path(graph))
        self.written: set[str] = set()  # the tensors in the file, by name
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close() or the with block)

    def tensor(self, array: np.ndarray, name: str) -> TensorProto:
        """The initializer `name` holding `array`: its values appended to the data file (or inline, if small)."""
        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        self._file.write(b"\0" * (-self._file.tell() % ALIGN))
        offset = self._file.tell()
        self._file.write(array.data)
        self.written.add(name)
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=value)
        tensor.data_location = TensorProto.EXTERNAL
        return tensor

    def close(self) -> None:
        """Close the file; remove it if nothing went to it (every tensor was small)."""
        empty = self._file.tell() == 0
        self._file.close()
        if empty:
            self.path.unlink()

    def __enter__(self) -> DataFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def array_of(tensor: TensorProto, graph_dir: Path) -> np.ndarray:
    """An initializer's values: from inside the graph, or memory-mapped (read-only) from its data file in
    `graph_dir`, so that nothing is read before it is used."""
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = ExternalDataInfo(tensor)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(graph_dir / info.location, dtype=dtype, mode="r", offset=info.offset or 0,
                     shape=tuple(tensor.dims))


def load_graph(path: str | Path) -> onnx.ModelProto:
    """The graph without its external weights (read them with `array_of`)."""
    return onnx.load(str(path), load_external_data=False)


def copy_initializers(model: onnx.ModelProto, src_dir: Path, data: DataFile) -> None:
    """Point every initializer of `model` that still lives in another data file (in `src_dir`) at `data`
    instead, copying its values there one tensor at a time."""
    for i, tensor in enumerate(model.graph.initializer):
        if uses_external_data(tensor) and tensor.name not in data.written:
            model.graph.initializer[i].CopyFrom(data.tensor(array_of(tensor, src_dir), tensor.name))


def copy_graph(src: Path, dst: Path) -> Path:
    """Graph file `src` as `dst`, with its weights in `dst`'s own data file (a graph finds its data file by
    name, so a graph file copied alone would read another's, or none)."""
    model = load_graph(src)
    with DataFile(dst) as data:
        copy_initializers(model, Path(src).parent, data)
    onnx.save(model, str(dst))
    return Path(dst)
