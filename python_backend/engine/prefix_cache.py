"""Prefix caching on the slot KV cache (kv_slots.py): the keys and values of prompt prefixes that requests share,
kept in blocks of ``block_tokens`` tokens so that a later prompt that starts with them is prefilled from its first
token not cached.

- **Blocks keyed by a hash chain.** Block i of a prompt is keyed by (the key of block i - 1, the salt, its tokens),
  so a block is found only behind the very same tokens and under the same salt (tenants with different salts never
  share). The block keeps its tokens, and a lookup compares them: a hash collision cannot hand out wrong keys.
- **Copies, not references.** A hit copies the blocks into the new row's slot, and a prefilled prompt copies its
  full blocks into the cache: a running sequence never shares memory with the cache, so evicting a block can never
  disturb one.
- **Exact.** A cached block holds what a prefill computed for the same tokens at the same positions; the rest of the
  prompt is prefilled in the new row's slot alone (onnxruntime's CPU kernel takes several new tokens after a past
  only for one row). At least ``MIN_SUFFIX`` prompt tokens are always computed: a single new token after a past
  runs the kernel's decode path, whose rounding differs from a prefill's.
- **Inside the budget, least recently used first.** The pool's blocks are anonymous memory backed only where
  written; ``trim`` drops the least recently used blocks (and gives their pages back) until the cache fits what the
  running rows' reservations leave of the budget. The engine trims after admission, before a prefill writes, so the
  cache never holds a request back and never pushes the peak over the budget.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

MIN_SUFFIX = 2


@dataclass
class Block:
    key: int
    tokens: tuple[int, ...]
    index: int  # its place in the pool


class PrefixCache:
    def __init__(self, cache_shape, capacity_tokens: int, block_tokens: int):
        self.block_tokens = block_tokens
        self.capacity = max(0, capacity_tokens // block_tokens)
        shape = (max(self.capacity, 1), cache_shape.num_kv_heads, block_tokens, cache_shape.head_dim)
        self._block_bytes = int(np.prod(shape[1:])) * np.dtype(cache_shape.dtype).itemsize
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._maps = [mmap.mmap(-1, self._block_bytes * shape[0], flags=private) for _ in cache_shape.cache_names()]
        self._pool = [np.frombuffer(m, cache_shape.dtype).reshape(shape) for m in self._maps]
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity))
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, found in the cache
        self.evicted_blocks = 0

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def cached_bytes(self) -> int:
        return len(self._blocks) * self._block_bytes * len(self._maps)

    def _chain(self, prompt: list[int], salt: str, blocks: int):
        key = hash(("prefix", salt))
        for i in range(blocks):
            tokens = tuple(prompt[i * self.block_tokens:(i + 1) * self.block_tokens])
            key = hash((key, tokens))
            yield key, tokens

    def usable_blocks(self, prompt: list[int]) -> int:
        """Full blocks of the prompt that may come from the cache (MIN_SUFFIX tokens are always computed)."""
        return max(0, (len(prompt) - MIN_SUFFIX) // self.block_tokens)

    def match(self, prompt: list[int], salt: str = "") -> list[Block]:
        """The longest run of the prompt's leading blocks held under this salt (marked recently used); counts the
        prompt as queried and the run as hit."""
        found = []
        for key, tokens in self._chain(prompt, salt, self.usable_blocks(prompt)):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def load(self, blocks: list[Block], row: list[np.ndarray]) -> None:
        """Copies the blocks into a row's cache (one [1, kv_heads, max_len, head_dim] view per layer key/value)."""
        b = self.block_tokens
        for i, block in enumerate(blocks):
            for pool, target in zip(self._pool, row):
                target[0, :, i * b:(i + 1) * b] = pool[block.index]

    def store(self, prompt: list[int], salt: str, row: list[np.ndarray], room_tokens: int) -> None:
        """Copies the prompt's usable blocks that are not cached yet from a row's cache, evicting the least recently
        used blocks for them, within room_tokens in all."""
        b = self.block_tokens
        for i, (key, tokens) in enumerate(self._chain(prompt, salt, self.usable_blocks(prompt))):
            block = self._blocks.get(key)
            if block is not None and block.tokens == tokens:
                self._blocks.move_to_end(key)
                continue
            if block is not None:  # a hash collision: the newer prompt takes the key
                self._drop(key)
            self.trim(room_tokens - b)
            if not self._free or self.cached_tokens + b > room_tokens:
                return
            block = Block(key, tokens, self._free.pop())
            for pool, source in zip(self._pool, row):
                pool[block.index] = source[0, :, i * b:(i + 1) * b]
            self._blocks[key] = block

    def trim(self, room_tokens: int) -> None:
        """Drops least recently used blocks until the cache holds at most room_tokens."""
        while self._blocks and self.cached_tokens > max(room_tokens, 0):
            self._drop(next(iter(self._blocks)))
            self.evicted_blocks += 1

    def _drop(self, key: int) -> None:
        block = self._blocks.pop(key)
        start = block.index * self._block_bytes
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED, start, self._block_bytes)
        self._free.append(block.index)
