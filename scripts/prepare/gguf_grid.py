"""The integer grids of a GGUF file's own tensors, read from the file, for the exact int4 variant.

A GGUF block type stores each value of a block as ``scale · code + offset`` with an integer code: Q4_0 ``d·(q − 8)``,
Q4_1 ``d·q + m``, Q4_K ``(d·sc)·q − dmin·m`` with a 6-bit ``sc`` and ``m`` per sub-block of 32 (4-bit codes); Q5_0
``d·(q − 16)``, Q5_1 ``d·q + m``, Q5_K as Q4_K (5-bit codes); Q6_K ``(d·sc)·(q − 32)`` with an 8-bit ``sc`` per
sub-block of 16 (6-bit codes); Q8_0 ``d·q`` (8-bit codes). Those are ``MatMulNBits`` blocks: codes and scales as they
are, the offset as a zero point plus a residual (block_quantization.py). Quantizing the dequantized weights again from
each block's min and max finds the same grid only where a block uses both its lowest and its highest code: Q4_1 blocks
do by construction, Q4_0 and Q4_K blocks often do not (a Q4_0 file kept greedy tokens on 1 prompt of 42 that way). So
the grid is read from the file.

The 5-, 6- and 8-bit codes go into two 4-bit ``MatMulNBits`` whose sum is the matrix (block_quantization.halves):
onnxruntime's 8-bit kernel with fp32 arithmetic (accuracy_level 1, what exactness needs) ran 20x slower than an fp32
MatMul here, two 4-bit ones 2.5x (docs/models.md). Float tensors (F16, BF16, F32) and the codebook types (IQ*) are on
no integer grid: their matrices stay fp32.

Tensors are matched to the graph's matrices by the values of their rows, not by names: the Hugging Face loader permutes
Llama's q and k rows, and the fused graph packs q, k and v (gate and up) into one matrix.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
# type: (bytes per block, code bits) of the wider types, whose codes are read through gguf's own dequantize
WIDE = {"Q5_0": (22, 5), "Q5_1": (24, 5), "Q5_K": (176, 5), "Q6_K": (210, 6), "Q8_0": (34, 8)}
ON_GRID = FOUR_BIT + tuple(WIDE)
BLOCK = 32  # the 4-bit types' block (Q4_K: sub-block) along a row


@dataclass
class Grid:
    """Rows of a tensor as ``scales[r, b] · codes[r, k] + offsets[r, b]`` for k in block b = k // block."""

    scales: np.ndarray  # float32 [rows, cols / block]
    codes: np.ndarray  # uint8 [rows, cols], 0..15 (4 bits) or 0..255 (5, 6 or 8 bits)
    offsets: np.ndarray  # float32 [rows, cols / block]
    bits: int = 4

    @property
    def block(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def layout(self) -> tuple[int, int]:
        """What a run of columns must share to be one ``MatMulNBits`` (or one pair of them)."""
        return (4 if self.bits == 4 else 8), self.block

    def values(self) -> np.ndarray:
        rows, cols = self.codes.shape
        blocks = self.codes.reshape(rows, cols // self.block, self.block).astype(np.float32)
        return (self.scales[..., None] * blocks + self.offsets[..., None]).reshape(rows, cols)


def decode(kind: str, data: np.ndarray, cols: int) -> Grid:
    """The grid of a tensor's raw blocks (uint8, [rows, bytes per row]) of a type with one."""
    rows = data.shape[0]
    if kind in WIDE:
        return _decode_wide(kind, data, cols)
    if kind in ("Q4_0", "Q4_1"):
        header = 2 if kind == "Q4_0" else 4
        blocks = data.reshape(-1, header + BLOCK // 2)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        offsets = -8 * d if kind == "Q4_0" else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        packed = blocks[:, header:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # low nibbles: the block's first half
        return Grid(d.reshape(rows, -1), codes.reshape(rows, cols), offsets.reshape(rows, -1))
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of codes
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        packed = blocks[:, 16:].reshape(-1, 4, 1, 32)  # each 32 bytes: sub-block 2j in low nibbles, 2j+1 in high
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)
        scales, offsets = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
        return Grid(scales.reshape(rows, -1), codes.reshape(rows, cols), offsets.reshape(rows, -1))
    raise ValueError(f"{kind} has no integer grid here ({', '.join(ON_GRID)} have)")


def _decode_wide(kind: str, data: np.ndarray, cols: int) -> Grid:
    """The scales and offsets from the blocks' headers; the codes from gguf's own dequantized values, which are
    ``scale · code + offset`` to the last bit or two, so that no bit layout is written twice."""
    from gguf import GGMLQuantizationType
    from gguf.quants import Q4_K, dequantize

    size, bits = WIDE[kind]
    rows = data.shape[0]
    blocks = data.reshape(-1, size)

    def half(start: int) -> np.ndarray:  # an fp16 field of each block, [blocks, 1]
        return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)

    if kind == "Q8_0":
        scales, offsets = half(0), -128 * half(0)
    elif kind == "Q5_0":
        scales, offsets = half(0), -16 * half(0)
    elif kind == "Q5_1":
        scales, offsets = half(0), half(2)
    elif kind == "Q5_K":  # Q4_K's header: d, dmin and 6-bit scales and mins of 8 sub-blocks of 32
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scales, offsets = half(0) * sc.astype(np.float32), -(half(2) * m.astype(np.float32))
    else:  # Q6_K: 16 signed 8-bit scales of sub-blocks of 16, then d
        scales = half(208) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        offsets = -32 * scales
    scales, offsets = scales.reshape(rows, -1), offsets.reshape(rows, -1)
    values = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, scales.shape[1], -1)
    steps = np.divide(values - offsets[..., None], scales[..., None], out=np.zeros_like(values),
                      where=scales[..., None] != 0)
    codes = np.clip(np.round(steps), 0, 2 ** bits - 1).astype(np.uint8).reshape(rows, cols)
    return Grid(scales, codes, offsets, bits)


@dataclass
class Match:
    """Where a [K, N] matrix's columns come from in the file: for each column the grid row behind it, or None (a row
    of a type without a grid, counted in ``types``, or of no tensor of the file: ``missing``)."""

    rows: list[tuple[Grid, int] | None]
    types: Counter = field(default_factory=Counter)  # the types of the tensors its columns come from
    missing: int = 0

    @property
    def grid(self) -> Grid | None:
        """The whole matrix's grid, if every column has one of the same layout."""
        runs = self.runs()
        return self.grid_of(runs[0][0]) if len(runs) == 1 and runs[0][1] is not None else None

    def grid_of(self, columns: slice) -> Grid:
        parts = self.rows[columns]
        return Grid(np.stack([g.scales[r] for g, r in parts]), np.stack([g.codes[r] for g, r in parts]),
                    np.stack([g.offsets[r] for g, r in parts]), max(g.bits for g, _ in parts))

    def runs(self) -> list[tuple[slice, tuple[int, int] | None]]:
        """The columns in contiguous runs, each of one grid layout (4-bit blocks of 32 for q and k, 6-bit blocks of
        16 for a Q6_K v, say) or of none (None)."""
        layouts = [row[0].layout if row is not None else None for row in self.rows]
        runs, start = [], 0
        for end in range(1, len(layouts) + 1):
            if end == len(layouts) or layouts[end] != layouts[start]:
                runs.append((slice(start, end), layouts[start]))
                start = end
        return runs


class FileGrids:
    """A GGUF file's layer tensors ("blk.*", 2-D), indexed by the values of their rows."""

    def __init__(self, path: Path):
        from gguf.quants import dequantize

        from scripts.prepare.gguf_tensors import read_tensors

        self.path = Path(path)
        self.types: Counter = Counter()
        self._tensors = []  # (type name, raw data, cols)
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._grids: dict[int, Grid] = {}
        for tensor in read_tensors(path):
            if not tensor.name.startswith("blk.") or len(tensor.shape) != 2:
                continue
            kind = tensor.tensor_type.name
            self.types[kind] += 1
            cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(-1, cols)
            index = len(self._tensors)
            self._tensors.append((kind, tensor.data, cols))
            for row, digest in enumerate(_digests(values)):
                self._rows.setdefault(digest, (index, row))
            if kind in ON_GRID:  # read once here, to fail on a misread file before any build
                grid = self._grids[index] = decode(kind, np.asarray(tensor.data).reshape(values.shape[0], -1), cols)
                error = np.abs(grid.values() - values).max(initial=0.0)
                if error > 1e-6 * max(np.abs(values).max(initial=0.0), 1e-30):
                    raise ValueError(f"{tensor.name} ({kind}) read as a grid differs from its values by {error:.3g}")

    def match(self, weight: np.ndarray) -> Match:
        """The file's rows behind each column of a [K, N] MatMul weight."""
        found = [self._rows.get(digest) for digest in _digests(np.ascontiguousarray(weight.T, np.float32))]
        types = Counter(self._tensors[f[0]][0] for f in found if f is not None)
        rows = [(self._grids[f[0]], f[1]) if f is not None and f[0] in self._grids else None for f in found]
        return Match(rows, types, sum(f is None for f in found))


def _digests(rows: np.ndarray):
    for row in rows:
        yield hashlib.blake2b(row.tobytes(), digest_size=16).digest()
