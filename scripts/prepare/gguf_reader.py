"""One parse of a GGUF file per process. gguf's GGUFReader reads every metadata field when it opens a file, the
tokenizer's vocabulary and merges among them (about 100k strings for SmolLM2: 3-4 s on a 2-core machine), and
transformers opens the file four times to load one model (its config twice, the tokenizer, the weights). It also
builds gguf's table of tensor names once per submodule of the model as it maps the weights (397 times for SmolLM2,
about 5 s): within parsed_once() the table of an architecture and depth is built once. What needs only the tensors
reads them without the metadata (gguf_tensors.py)."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from pathlib import Path


def open_gguf(path: str | Path):
    """The file's GGUFReader, parsed once while the file is unchanged (the same size and modification time)."""
    stat = os.stat(path)
    return _parsed(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, size: int, mtime_ns: int):
    from gguf.gguf_reader import GGUFReader  # the class itself, also while parsed_once() stands in for it

    return GGUFReader(path)


@functools.lru_cache(maxsize=8)
def _tensor_name_map(arch, n_blocks: int):
    from gguf.tensor_mapping import get_tensor_name_map  # the function itself, also while parsed_once() stands in

    return get_tensor_name_map(arch, n_blocks)


@contextmanager
def parsed_once():
    """Within this block, transformers' GGUF loaders (which import gguf.GGUFReader and gguf.get_tensor_name_map when
    they run) share open_gguf's reader of each file and one table of tensor names per architecture and depth: both
    read-only, as they only read them."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        return open_gguf(path) if mode == "r" else original_reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, _tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
