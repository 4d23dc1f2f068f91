"""Whether a model's layer matrices already lie on a b-bit grid in blocks (what the exact int4 variant needs), checked
before any variant is built: reading the weights takes seconds, a build and its parity check take minutes.

A matrix dequantized from a 4-bit GGUF block type (Q4_0, Q4_1, and Q4_K's sub-blocks of 32) holds at most 16
distinct values in each block of 32 along its input dimension; one from Q5_K, Q6_K or Q8_0 holds up to 32, 64 or 256,
and trained float weights about 32 (every value differs). scripts/prepare/block_quantization.py can keep only the
first kind exactly in 4 bits: the others get a second rounding, and the variant's parity fails after minutes of work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLED_BLOCKS = 512  # blocks looked at per matrix (spread over it); one block with too many values decides


@dataclass(frozen=True)
class OffGrid:
    name: str
    levels: int  # the most distinct values seen in one block


def layer_matrices(weights_dir: Path):
    """(name, [out, in] float array) of each decoder layer's 2-D weight in a Hugging Face folder's safetensors (the
    matrices the int4 variant quantizes; embeddings and the LM head stay fp32)."""
    from safetensors import safe_open

    for path in sorted(weights_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():
                if ".layers." in name and name.endswith(".weight"):
                    tensor = tensors.get_tensor(name)
                    if tensor.dim() == 2:
                        yield name, tensor.float().numpy()


def off_grid_matrices(weights_dir: Path, bits: int, block_size: int) -> tuple[list[OffGrid], int]:
    """The layer matrices with a block (of block_size along the input dimension) holding more than 2**bits distinct
    values, among SAMPLED_BLOCKS blocks spread over each; and how many matrices were looked at."""
    off, seen = [], 0
    for name, matrix in layer_matrices(weights_dir):
        seen += 1
        if matrix.shape[1] % block_size:
            off.append(OffGrid(name, -1))  # rows that are not whole blocks: no block grid at all
            continue
        blocks = matrix.reshape(-1, block_size)
        picked = np.sort(blocks[np.linspace(0, len(blocks) - 1, min(SAMPLED_BLOCKS, len(blocks))).astype(np.int64)])
        levels = 1 + int((np.diff(picked, axis=1) != 0).sum(axis=1).max())  # distinct values of the fullest block
        if levels > 2 ** bits:
            off.append(OffGrid(name, levels))
    return off, seen


def gguf_tensor_types(path: Path) -> Counter:
    """How many of a GGUF file's layer tensors ("blk.*") are of each type (Q4_K, Q6_K, ...), read from its header."""
    from scripts.prepare.gguf_tensors import read_tensors

    return Counter(t.tensor_type.name for t in read_tensors(path) if t.name.startswith("blk."))


def refusal(weights_dir: Path, source: str, variant: str, bits: int, block_size: int) -> str | None:
    """Why the exact variant cannot be exact for these weights, or None when every layer matrix is on the grid. A
    GGUF file's tensors of an integer grid keep the file's own grid and its float tensors stay fp32 (gguf_grid.py):
    refused only when none of its layer tensors has such a grid, as the variant would then be the fp32 weights under
    another name."""
    if source.endswith(".gguf") and Path(source).is_file():
        from scripts.prepare.gguf_grid import ON_GRID

        types = gguf_tensor_types(Path(source))
        if any(types[kind] for kind in ON_GRID):
            return None
        codebook = [kind for kind in types if kind.startswith("IQ")]
        return (f"{variant} keeps a GGUF file's tensors of an integer grid ({', '.join(ON_GRID)}) on their own grid "
                f"and the others in fp32, but none of {Path(source).name}'s layer tensors is of those types: they are "
                + ", ".join(f"{count} {kind}" for kind, count in types.most_common())
                + (f" ({'/'.join(codebook)} map their codes through a table of unevenly spaced values, which no "
                   "integer grid holds)" if codebook else "")
                + ". Nothing was built. Serve QUANT=fp32 (the export, exact) or fp16, or QUANT=fast (not exact by "
                  "design)")
    off, seen = off_grid_matrices(weights_dir, bits, block_size)
    if not off:
        return None
    examples = ", ".join(f"{o.name} ({'rows not whole blocks' if o.levels < 0 else f'{o.levels} values'})"
                         for o in off[:3])
    return (f"{variant} is exact only for weights already on a {bits}-bit grid in blocks of {block_size} (GGUF "
            f"Q4_0, Q4_1 or Q4_K layer tensors): {len(off)} of {seen} layer matrices of {weights_dir} hold more than "
            f"{2 ** bits} values in a block, e.g. {examples}. Nothing was built. Serve QUANT=fp32 (the export) "
            f"or fp16, or QUANT=fast (not exact by design), or build {variant} anyway with --keep-inexact "
            f"(KEEP_INEXACT=1)")
