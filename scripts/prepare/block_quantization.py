"""Block-wise weight quantization in the layout of onnxruntime's ``MatMulNBits`` (com.microsoft), on the grid the
weights came from.

``MatMulNBits`` computes ``x · Ŵ`` with ``Ŵ[k, n] = scale[n, b] · (code[n, k] − zero_point[n, b])`` for blocks ``b`` of
``block_size`` consecutive ``k``; codes and zero points are integers.

- Asymmetric: per block, ``scale = (max − min) / (2^bits − 1)`` and ``code = round((w − min) / scale)``, so every value
  of the block is ``min + scale · code``. Weights that were already on such a grid (GGUF's Q4_1 stores ``w = d·q + m``
  with blocks of 32 along the input dimension) get back their own codes and scale. But the zero point must be an
  integer and ``min / scale`` is not, so ``Ŵ`` misses each block by a constant ``r = min + scale · zero_point``.
  ``residual`` holds the per-block means of ``W − Ŵ``; with it ``x · W = x · Ŵ + block_sums(x) · residual``, exactly
  (up to fp32 rounding) when ``W − Ŵ`` is constant in each block, and a least-squares correction otherwise.
  onnxruntime's own quantizer widens the range to include 0, which moves the grid: on the default model it shifts
  the codes themselves, and no per-block constant can repair that.
- Symmetric: ``scale = max|w| / (2^(bits−1) − 1)`` and zero point ``2^(bits−1)``: GGUF's Q8_0 (``w = d·q``) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class QuantizedMatrix:
    """A [K, N] weight as ``MatMulNBits`` inputs, plus the per-block residual [K / block_size, N]."""

    bits: int
    block_size: int
    packed: np.ndarray  # uint8 [N, blocks, block_size * bits / 8]: ``MatMulNBits`` input B
    scales: np.ndarray  # float32 [N, blocks]
    zero_points: np.ndarray | None  # uint8, packed like the codes, [N, ceil(blocks * bits / 8)]; None: symmetric
    residual: np.ndarray  # float32 [blocks, N]

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks, _ = self.packed.shape
        return blocks * self.block_size, n

    def codes(self) -> np.ndarray:
        return _unpack(self.packed.reshape(self.packed.shape[0], -1), self.bits).reshape(
            self.packed.shape[0], -1, self.block_size)

    def zero_point_values(self) -> np.ndarray:
        n, blocks = self.scales.shape
        if self.zero_points is None:
            return np.full((n, blocks), 2 ** (self.bits - 1), np.uint8)
        return _unpack(self.zero_points, self.bits)[:, :blocks]

    def dequantize(self) -> np.ndarray:
        """Ŵ [K, N] as ``MatMulNBits`` sees it (without the residual)."""
        codes = self.codes().astype(np.float32) - self.zero_point_values()[..., None].astype(np.float32)
        return (codes * self.scales[..., None]).reshape(self.scales.shape[0], -1).T

    def residual_spread(self, weight: np.ndarray) -> float:
        """The largest spread of ``W − Ŵ`` inside one block: 0 when ``Ŵ + residual`` is ``W``."""
        k, n = self.shape
        error = (weight - self.dequantize()).reshape(k // self.block_size, self.block_size, n)
        return float((error.max(1) - error.min(1)).max())


def quantize(weight: np.ndarray, bits: int, block_size: int = 32, symmetric: bool = False) -> QuantizedMatrix:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    k, n = weight.shape
    if k % block_size:
        raise ValueError(f"the input dimension {k} is not a multiple of the block size {block_size}")
    blocks = weight.astype(np.float32).T.reshape(n, k // block_size, block_size)
    top = 2 ** bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scales = np.abs(blocks).max(-1) / (half - 1)
        scales[scales == 0] = 1.0
        codes = np.clip(np.round(blocks / scales[..., None]), 1 - half, half - 1) + half
        zero_points = np.full(scales.shape, half)
    else:
        low = blocks.min(-1)
        scales = (blocks.max(-1) - low) / top
        scales[scales == 0] = 1.0
        codes = np.clip(np.round((blocks - low[..., None]) / scales[..., None]), 0, top)
        zero_points = np.clip(np.round(-low / scales), 0, top)
    scales = scales.astype(np.float32)
    dequantized = (codes - zero_points[..., None]).astype(np.float32) * scales[..., None]
    residual = (blocks - dequantized).mean(-1).T.astype(np.float32)
    packed = _pack(codes.astype(np.uint8).reshape(n, -1), bits).reshape(n, k // block_size, -1)
    return QuantizedMatrix(bits, block_size, packed, scales,
                           None if symmetric else _pack(zero_points.astype(np.uint8), bits), residual)


def from_grid(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray, block_size: int = 32) -> QuantizedMatrix:
    """A [K, N] weight given on its own 4-bit grid, column n's block b being ``scales[n, b] · codes[n, k] +
    offsets[n, b]`` (codes uint8 [N, K]): the codes and scales as they are, the offset as the nearest integer zero
    point plus a residual (0 where the offset is a whole number of steps, as in GGUF's Q4_0)."""
    zero_points = np.clip(np.round(_steps(offsets, scales)), 0, 15)
    return _four_bit(codes, scales, zero_points, offsets, block_size)


def halves(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
           block_size: int = 32) -> tuple[QuantizedMatrix, QuantizedMatrix]:
    """A [K, N] weight on its own grid of codes of up to 8 bits (GGUF's Q5_*, Q6_K, Q8_0), as the sum of two 4-bit
    matrices: the codes' high nibbles at 16 times the scale and the low nibbles at the scale, the integer zero point
    split the same way (``16·s·(h − z_h) + s·(l − z_l) = s·(q − z)``), the rest of the offset the low half's residual.
    Both are exact to fp32 rounding; onnxruntime runs two 4-bit kernels far faster than its exact 8-bit one."""
    zero_points = np.clip(np.round(_steps(offsets, scales)), 0, 255)
    high = _four_bit(codes >> 4, scales * 16, zero_points // 16, np.zeros_like(offsets), block_size, residual=False)
    low = _four_bit(codes & 15, scales, zero_points % 16, offsets, block_size, full_zero_points=zero_points)
    return high, low


def _steps(offsets: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.divide(-offsets, scales, out=np.zeros_like(offsets), where=scales != 0)


def _four_bit(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, offsets: np.ndarray, block_size: int,
              residual: bool = True, full_zero_points: np.ndarray | None = None) -> QuantizedMatrix:
    """The matrix of 4-bit codes [N, K] with these scales and integer zero points [N, blocks]; its residual is what
    the offsets leave after the zero point (``full_zero_points``, of the whole code, where this is a half)."""
    n, k = codes.shape
    whole = zero_points if full_zero_points is None else full_zero_points
    rest = (offsets.astype(np.float64) + scales.astype(np.float64) * whole).T.astype(np.float32)
    packed = _pack(codes.astype(np.uint8), 4).reshape(n, k // block_size, -1)
    return QuantizedMatrix(4, block_size, packed, scales.astype(np.float32), _pack(zero_points.astype(np.uint8), 4),
                           rest if residual else np.zeros_like(rest))


def block_sum_matrix(k: int, block_size: int) -> np.ndarray:
    """S [K, K / block_size] with ``(x · S)[b] = sum of x over block b``."""
    matrix = np.zeros((k, k // block_size), np.float32)
    matrix[np.arange(k), np.arange(k) // block_size] = 1.0
    return matrix


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [rows, cols] -> bytes, two 4-bit values per byte (the first in the low nibble), as MatMulNBits reads."""
    if bits == 8:
        return values
    if values.shape[1] % 2:
        values = np.concatenate([values, np.zeros((values.shape[0], 1), np.uint8)], 1)
    return (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], -1).reshape(packed.shape[0], -1)
