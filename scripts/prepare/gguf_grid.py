"""The 4-bit grids of a GGUF file's own tensors, read from the file, for the exact int4 variant.

A 4-bit GGUF block type stores each value of a block of 32 as ``scale · code + offset`` with a 4-bit code: Q4_0
``d·(q − 8)``, Q4_1 ``d·q + m``, Q4_K ``(d·sc)·q − dmin·m`` with a 6-bit ``sc`` and ``m`` per sub-block of 32. Those
are ``MatMulNBits`` blocks: codes and scales as they are, the offset as a zero point plus a residual
(block_quantization.py). Quantizing the dequantized weights again from each block's min and max finds the same grid
only where a block uses both its lowest and its highest code: Q4_1 blocks do by construction, Q4_0 and Q4_K blocks
often do not (a Q4_0 file kept greedy tokens on 1 prompt of 42 that way). So the grid is read from the file.

The 5-, 6- and 8-bit types and float tensors are on no 4-bit grid. ``MatMulNBits`` holds 8 bits, but its 8-bit kernel
with fp32 arithmetic (accuracy_level 1, what exactness needs) ran 10x slower than an fp32 MatMul here (docs/models.md),
so their matrices stay fp32: exact, not smaller.

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
BLOCK = 32  # the 4-bit types' block (Q4_K: sub-block) along a row


@dataclass
class Grid:
    """Rows of a tensor as ``scales[r, b] · codes[r, k] + offsets[r, b]`` for k in block b = k // 32."""

    scales: np.ndarray  # float32 [rows, cols / 32]
    codes: np.ndarray  # uint8 [rows, cols], 0..15
    offsets: np.ndarray  # float32 [rows, cols / 32]

    def values(self) -> np.ndarray:
        rows, cols = self.codes.shape
        blocks = self.codes.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
        return (self.scales[..., None] * blocks + self.offsets[..., None]).reshape(rows, cols)


def decode(kind: str, data: np.ndarray, cols: int) -> Grid:
    """The grid of a tensor's raw blocks (uint8, [rows, bytes per row]) of a 4-bit type."""
    rows = data.shape[0]
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
    raise ValueError(f"{kind} is not a 4-bit block type ({', '.join(FOUR_BIT)})")


@dataclass
class Match:
    """Where a [K, N] matrix's columns come from in the file: for each column the 4-bit grid row behind it, or None
    (a row of another type, counted in ``types``, or of no tensor of the file: ``missing``)."""

    rows: list[tuple[Grid, int] | None]
    types: Counter = field(default_factory=Counter)  # the types of the tensors its columns come from
    missing: int = 0

    @property
    def on_grid(self) -> np.ndarray:
        return np.array([row is not None for row in self.rows])

    @property
    def grid(self) -> Grid | None:
        """The whole matrix's grid, if every column has one."""
        return self.grid_of(slice(0, len(self.rows))) if self.on_grid.all() else None

    def grid_of(self, columns: slice) -> Grid:
        parts = self.rows[columns]
        return Grid(np.stack([g.scales[r] for g, r in parts]), np.stack([g.codes[r] for g, r in parts]),
                    np.stack([g.offsets[r] for g, r in parts]))

    def runs(self) -> list[tuple[slice, bool]]:
        """The columns in contiguous runs, each on a 4-bit grid or not (q and k apart from a 6-bit v, say)."""
        on_grid, runs, start = self.on_grid, [], 0
        for end in range(1, len(on_grid) + 1):
            if end == len(on_grid) or on_grid[end] != on_grid[start]:
                runs.append((slice(start, end), bool(on_grid[start])))
                start = end
        return runs


class FileGrids:
    """A GGUF file's layer tensors ("blk.*", 2-D), indexed by the values of their rows."""

    def __init__(self, path: Path):
        from gguf.quants import dequantize

        from scripts.prepare.gguf_reader import open_gguf

        self.path = Path(path)
        self.types: Counter = Counter()
        self._tensors = []  # (type name, raw data, cols)
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._grids: dict[int, Grid] = {}
        for tensor in open_gguf(path).tensors:
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
            if kind in FOUR_BIT:  # read once here, to fail on a misread file before any build
                grid = self._grids[index] = decode(kind, np.asarray(tensor.data).reshape(values.shape[0], -1), cols)
                error = np.abs(grid.values() - values).max(initial=0.0)
                if error > 1e-6 * max(np.abs(values).max(initial=0.0), 1e-30):
                    raise ValueError(f"{tensor.name} ({kind}) read as a grid differs from its values by {error:.3g}")

    def four_bit_tensors(self) -> int:
        return sum(self.types[kind] for kind in FOUR_BIT)

    def match(self, weight: np.ndarray) -> Match:
        """The file's rows behind each column of a [K, N] MatMul weight."""
        found = [self._rows.get(digest) for digest in _digests(np.ascontiguousarray(weight.T, np.float32))]
        types = Counter(self._tensors[f[0]][0] for f in found if f is not None)
        rows = [(self._grids[f[0]], f[1]) if f is not None and f[0] in self._grids else None for f in found]
        return Match(rows, types, sum(f is None for f in found))


def _digests(rows: np.ndarray):
    for row in rows:
        yield hashlib.blake2b(row.tobytes(), digest_size=16).digest()
