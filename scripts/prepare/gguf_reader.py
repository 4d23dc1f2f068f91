"""One parse of a GGUF file per process. gguf's GGUFReader reads every metadata field when it opens a file, the
tokenizer's vocabulary and merges among them (about 100k strings for SmolLM2: 3-4 s on a 2-core machine), and
transformers opens the file four times to load one model (its config twice, the tokenizer, the weights)."""

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


@contextmanager
def parsed_once():
    """Within this block, transformers' GGUF loaders (which import gguf.GGUFReader when they run) share
    open_gguf's reader of each file: read-only, as they only read it."""
    import gguf

    original = gguf.GGUFReader

    def reader(path, mode="r"):
        return open_gguf(path) if mode == "r" else original(path, mode)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
