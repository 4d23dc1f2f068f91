"""A GGUF file's tensors (name, type, shape, data) read from its header, stepping over its metadata unparsed.

gguf's GGUFReader builds every metadata field when it opens a file, the tokenizer's vocabulary and merges among them
(about 100k strings for SmolLM2: 3-4 s on a 2-core machine). The variants' checks and builds need only the tensors
(source_grid.py, gguf_grid.py): this reads their table in milliseconds, and gives each tensor's data as GGUFReader
does, a view of the mapped file (a quantized type's raw blocks as uint8 [..., bytes per row], another type's values).
Loading a model still goes through transformers and GGUFReader (gguf_reader.py), which need the metadata.

The layout (GGUF versions 2 and 3, little-endian): magic, version, tensor count and field count; the fields (a key,
a value type, a value; strings and arrays carry their lengths); each tensor's name, dimensions (innermost first), type
and offset; its data from the next multiple of general.alignment on."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALARS = {kind: struct.Struct(layout) for kind, layout in {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}.items()}
_VALUE_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer, self.offset = buffer, 0

    def unpack(self, layout: struct.Struct) -> int:
        (value,) = layout.unpack_from(self.buffer, self.offset)
        self.offset += layout.size
        return value

    def string(self) -> str:
        length = self.unpack(_U64)
        self.offset += length
        return bytes(self.buffer[self.offset - length:self.offset]).decode("utf-8")

    def skip_string(self) -> None:
        length = self.unpack(_U64)  # first: `offset += unpack()` would add to the offset from before the read
        self.offset += length

    def value(self, kind: int):
        """A field's value: read when it is a scalar (general.alignment is one), stepped over otherwise."""
        if kind == GGUFValueType.STRING:
            return self.skip_string()
        if kind == GGUFValueType.ARRAY:
            item, count = self.unpack(_U32), self.unpack(_U64)
            if item == GGUFValueType.STRING:
                for _ in range(count):
                    self.skip_string()
            elif item == GGUFValueType.ARRAY:
                for _ in range(count):
                    self.value(GGUFValueType.ARRAY)
            else:
                self.offset += count * _SCALARS[GGUFValueType(item)].size  # count read above
            return None
        return self.unpack(_SCALARS[GGUFValueType(kind)])


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """The file's tensors in the order of its table."""
    buffer = np.memmap(path, mode="r", dtype=np.uint8)
    cursor = _Cursor(buffer)
    if cursor.unpack(_U32) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version = cursor.unpack(_U32)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (byte-swapped, or unknown): versions 2 and 3 are read")
    tensor_count, field_count = cursor.unpack(_U64), cursor.unpack(_U64)
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(field_count):
        key = cursor.string()
        value = cursor.value(cursor.unpack(_U32))
        if key == "general.alignment":
            alignment = int(value)
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        shape = tuple(cursor.unpack(_U64) for _ in range(cursor.unpack(_U32)))
        table.append((name, GGMLQuantizationType(cursor.unpack(_U32)), shape, cursor.unpack(_U64)))
    start = -(-cursor.offset // alignment) * alignment
    return [_tensor(buffer, start + offset, name, kind, shape) for name, kind, shape, offset in table]


def _tensor(buffer: np.ndarray, offset: int, name: str, kind: GGMLQuantizationType,
            shape: tuple[int, ...]) -> GGUFTensor:
    dims = tuple(reversed(shape))  # numpy's order: the outermost first
    elements = int(np.prod(shape))
    if kind in _VALUE_TYPES:
        dtype = np.dtype(_VALUE_TYPES[kind])
        data = buffer[offset:offset + elements * dtype.itemsize].view(dtype).reshape(dims)
    else:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[-1] % block:
            raise ValueError(f"{name}: a row of {dims[-1]} values is not whole {kind.name} blocks of {block}")
        data = buffer[offset:offset + elements // block * block_bytes].reshape(*dims[:-1], -1)
    return GGUFTensor(name, kind, shape, data)
