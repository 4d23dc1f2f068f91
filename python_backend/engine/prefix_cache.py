"""Prefix caching on the slot KV cache (kv_slots.py): the keys and values of prompt prefixes that requests share,
kept in blocks of ``block_tokens`` tokens so that a later prompt that starts with them is prefilled from its first
token not cached; and, for a prompt seen whole, what makes it need no computing at all.

- **Blocks keyed by a hash chain.** Block i of a prompt is keyed by (the key of block i - 1, the salt, its tokens),
  so a block is found only behind the very same tokens and under the same salt (tenants with different salts never
  share). The block keeps its tokens, and a lookup compares them: a hash collision cannot hand out wrong keys.
- **Whole prompts.** After its prefill a prompt also leaves an entry keyed behind its last full block: its tokens
  past that block (0 to block_tokens - 1, their keys and values in a block of the pool) and its last position's
  logits. The same prompt again, under the same salt, is copied in whole and its first token is chosen from those
  logits: no model call (a retried request, a batch file's repeated rows). The logits cost
  memory like ``logits_tokens`` tokens of the budget.
- **Copies, not references.** A hit copies the blocks into the new row's slot, and a prefilled prompt copies its
  full blocks into the cache: a running sequence never shares memory with the cache, so evicting a block can never
  disturb one.
- **Exact.** A cached block holds what a prefill computed for the same tokens at the same positions, and a whole
  prompt's logits are the ones its prefill computed; the rest of a prompt found only in part is prefilled in the
  new row's slot after the copied blocks, with the other prompts of its chunk in one call (kv_slots.py: the same
  bits as a call of its own; the scheduler's budget counts only the tokens to compute: ``found_tokens``). At least
  ``MIN_SUFFIX`` tokens of a prompt found in part are computed: a single new token after a past runs the kernel's
  decode path, whose rounding differs from a prefill's.
- **Scores too.** A prompt scored (each token's log-probability: evaluation) leaves its tokens' scores with its
  blocks, so that the shared context of a multiple-choice question is scored once: a scored prompt is matched only
  on blocks that hold scores (with at least its top count), and the rest is computed from the last cached
  position on, whose logits score the first token not cached. Scores are small beside the keys and values (a few
  dozen bytes a token against 46 KB for SmolLM2) and are not counted in the budget.
- **Inside the budget, least recently used first.** The pool's blocks are anonymous memory backed only where
  written; ``trim`` drops the least recently used entries (and gives their pages back) until the cache fits what
  the running rows' reservations leave of the budget. The engine trims after admission, before a prefill writes,
  so the cache never holds a request back and never pushes the peak over the budget.
"""

from __future__ import annotations

import mmap
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import partial

import numpy as np

from python_backend.engine.kv_slots import buffers

MIN_SUFFIX = 2


@dataclass
class Block:
    key: int
    tokens: tuple[int, ...]
    index: int | None  # its place in the pool (None: a whole prompt's entry with no tokens past its full blocks)
    logits: np.ndarray | None = None  # a whole prompt's entry: its last position's logits [vocab]
    cost: int = 0  # tokens of the budget it holds
    scores: list | None = None  # its tokens' log-probabilities (TokenLogprob; None for a prompt's first token)
    scores_top: int = 0  # how many most likely tokens each score holds


@dataclass
class PrefixHit:
    blocks: list[Block]  # the prompt's leading full blocks
    whole: Block | None = None  # the rest of the prompt and its last logits: nothing to compute

    def __bool__(self) -> bool:
        return bool(self.blocks) or self.whole is not None

    def tokens(self, block_tokens: int) -> int:
        return len(self.blocks) * block_tokens + (len(self.whole.tokens) if self.whole else 0)

    def scores(self) -> list:
        """The cached tokens' scores, in order (a match for a scored prompt holds them all)."""
        return [score for block in self.blocks + ([self.whole] if self.whole else []) for score in block.scores]


class PrefixCache:
    def __init__(self, cache_shape, capacity_tokens: int, block_tokens: int, vocab_size: int = 0, tensors=None):
        """tensors: the slot cache's (python_backend/runtime/decoder.py); blocks are kept where its rows are, in
        anonymous host memory given back on eviction, or (the device path) in torch tensors on its device."""
        self.block_tokens = block_tokens
        self.capacity = max(0, capacity_tokens // block_tokens)
        shape = (max(self.capacity, 1), cache_shape.num_kv_heads, block_tokens, cache_shape.head_dim)
        self._block_bytes = int(np.prod(shape[1:])) * np.dtype(cache_shape.dtype).itemsize
        self._logits_bytes = vocab_size * np.dtype(np.float32).itemsize
        # Whole prompts are kept only with the vocabulary's size known; their logits count as this many tokens.
        self.logits_tokens = -(-self._logits_bytes // cache_shape.bytes_per_token()) if vocab_size else 0
        self._maps, self._pool = buffers(tensors, len(cache_shape.cache_names()), shape, cache_shape.dtype)
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity))
        self.cached_tokens = 0  # tokens of the budget the entries hold
        self._pages = self._wholes = 0  # entries holding a block of the pool, entries holding logits
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, found in the cache
        self.evicted_blocks = 0

    def cached_bytes(self) -> int:
        return self._pages * self._block_bytes * len(self._pool) + self._wholes * self._logits_bytes

    def _root(self, salt: str) -> int:
        return hash(("prefix", salt))

    def _chain(self, prompt: list[int], salt: str, blocks: int):
        key = self._root(salt)
        for i in range(blocks):
            tokens = tuple(prompt[i * self.block_tokens:(i + 1) * self.block_tokens])
            key = hash((key, tokens))
            yield key, tokens

    def _whole_key(self, prompt: list[int], last_key: int) -> tuple[int, tuple[int, ...]]:
        tail = tuple(prompt[len(prompt) // self.block_tokens * self.block_tokens:])
        return hash((last_key, "whole", tail)), tail

    def usable_blocks(self, prompt: list[int]) -> int:
        """Full blocks of a prompt found in part that may come from the cache (MIN_SUFFIX tokens are computed)."""
        return max(0, (len(prompt) - MIN_SUFFIX) // self.block_tokens)

    def _find(self, prompt: list[int], salt: str, scores_top: int | None) -> PrefixHit:
        """What the cache holds of the prompt now, touching nothing: the whole prompt, else its usable leading
        blocks. A prompt to score (scores_top: its top count) finds only entries that hold scores."""
        found, last_key = [], self._root(salt)

        def usable(block: Block | None, tokens) -> bool:
            return block is not None and block.tokens == tokens and (
                scores_top is None or (block.scores is not None and block.scores_top >= scores_top))

        for key, tokens in self._chain(prompt, salt, len(prompt) // self.block_tokens):
            block = self._blocks.get(key)
            if not usable(block, tokens):
                break
            found.append(block)
            last_key = key
        hit = PrefixHit(found)
        if len(found) == len(prompt) // self.block_tokens:
            key, tail = self._whole_key(prompt, last_key)
            whole = self._blocks.get(key)
            if usable(whole, tail) and whole.logits is not None:
                hit.whole = whole
        if hit.whole is None:
            del found[self.usable_blocks(prompt):]
        return hit

    def found_tokens(self, prompt: list[int], salt: str = "", scores_top: int | None = None) -> int:
        """How many of the prompt's leading tokens a match would find now (all of them for a prompt held whole),
        without marking anything used or counting a query: what the scheduler's prefill budget does not count."""
        hit = self._find(prompt, salt, scores_top)
        return len(prompt) if hit.whole else len(hit.blocks) * self.block_tokens

    def match(self, prompt: list[int], salt: str = "", scores_top: int | None = None) -> PrefixHit:
        """The prompt whole, else the longest run of its leading blocks held under this salt (marked recently
        used); counts the prompt as queried and what was found as hit. A prompt to score (scores_top: its top
        count) matches only entries that hold scores."""
        hit = self._find(prompt, salt, scores_top)
        for block in hit.blocks + ([hit.whole] if hit.whole else []):
            self._blocks.move_to_end(block.key)
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(prompt) if hit.whole else len(hit.blocks) * self.block_tokens
        return hit

    def load(self, hit: PrefixHit, row: list, found: list | None = None) -> None:
        """Copies what was found into a row's cache (one [1, kv_heads, max_len, head_dim] view per layer key and
        value): block by block, or from ``found``, the hit's tokens already gathered for several rows (``gather``)."""
        if found is not None:
            for source, target in zip(found, row):
                target[0, :, :source.shape[1]] = source
            return
        b = self.block_tokens
        for i, block in enumerate(hit.blocks):
            for pool, target in zip(self._pool, row):
                target[0, :, i * b:(i + 1) * b] = pool[block.index]
        if hit.whole is not None and hit.whole.index is not None:
            start, count = len(hit.blocks) * b, len(hit.whole.tokens)
            for pool, target in zip(self._pool, row):
                target[0, :, start:start + count] = pool[hit.whole.index, :, :count]

    def gather(self, hit: PrefixHit) -> list:
        """The hit's keys and values in token order, one [kv_heads, tokens, head_dim] array per layer key and value,
        for rows that share them: one gather of its pages a layer, where a copy per block would be a call per block,
        layer and row."""
        pages = [block.index for block in hit.blocks]
        tokens = len(pages) * self.block_tokens
        if hit.whole is not None and hit.whole.index is not None:
            pages.append(hit.whole.index)
            tokens += len(hit.whole.tokens)
        found = []
        for pool in self._pool:
            blocks = pool[pages]  # [pages, kv_heads, block_tokens, head_dim]
            heads, dim = blocks.shape[1], blocks.shape[3]
            found.append(blocks.swapaxes(0, 1).reshape(heads, len(pages) * self.block_tokens, dim)[:, :tokens])
        return found

    def fills(self, hits: list) -> list:
        """For each hit (None where nothing was found), what copies it into a row (kv_slots.SlotKVCache.prefill's
        fills, which may run at once on several threads). Rows behind the same blocks (a burst behind one
        instruction) share one gather, made here; a hit of one row is copied block by block."""
        keys = [tuple(block.key for block in hit.blocks) + ((hit.whole.key,) if hit.whole else ()) if hit else None
                for hit in hits]
        shared = {key for key, rows in Counter(keys).items() if key is not None and rows > 1}
        gathered = {key: self.gather(hit) for key, hit in zip(keys, hits) if key in shared}
        return [partial(self.load, hit, found=gathered.get(key)) if hit else None for key, hit in zip(keys, hits)]

    def store(self, prompt: list[int], salt: str, row: list[np.ndarray], room_tokens: int,
              logits: np.ndarray | None = None, scores: list | None = None, scores_top: int = 0) -> None:
        """Copies the prompt's full blocks that are not cached yet from a row's cache, and with the prompt's last
        logits its whole entry, evicting the least recently used entries for them, within room_tokens in all.
        With the prompt's scores (one per token), every entry it passes keeps its tokens' scores."""
        b, last_key = self.block_tokens, self._root(salt)

        def scored(entry: Block, start: int) -> Block:
            if scores is not None and (entry.scores is None or entry.scores_top < scores_top):
                entry.scores, entry.scores_top = scores[start:start + len(entry.tokens)], scores_top
            return entry

        for i, (key, tokens) in enumerate(self._chain(prompt, salt, len(prompt) // b)):
            last_key = key
            if self._touch(key, tokens):
                scored(self._blocks[key], i * b)
                continue
            index = self._take_page(b, room_tokens)
            if index is None:
                return
            self._write_page(index, [source[0, :, i * b:(i + 1) * b] for source in row])
            self._add(scored(Block(key, tokens, index, cost=b), i * b))
        if logits is None or not self.logits_tokens:
            return
        key, tail = self._whole_key(prompt, last_key)
        cost = self.logits_tokens + (b if tail else 0)
        if self._touch(key, tail):
            scored(self._blocks[key], len(prompt) - len(tail))
            return
        if len(prompt) // b * b + cost > room_tokens:
            return  # (evicting its own blocks for it would make it unreachable)
        index = None
        if tail:
            index = self._take_page(cost, room_tokens)
            if index is None:
                return
            self._write_page(index, [source[0, :, len(prompt) - len(tail):len(prompt)] for source in row])
        else:
            self.trim(room_tokens - cost)
            if self.cached_tokens + cost > room_tokens:
                return
        self._add(scored(Block(key, tail, index, np.array(logits, np.float32), cost), len(prompt) - len(tail)))

    def _write_page(self, index: int, tokens: list) -> None:
        """Copies each layer's [kv_heads, n, head_dim] tokens into page ``index`` of its pool; a copy that fails gives
        the page back to the free list (the caller's entry is then not added)."""
        try:
            for pool, source in zip(self._pool, tokens):
                pool[index, :, :source.shape[1]] = source
        except BaseException:
            self._free_page(index)
            raise

    def _touch(self, key: int, tokens: tuple[int, ...]) -> bool:
        """Whether this entry is held (marked recently used); a hash collision's entry is dropped for the new one."""
        block = self._blocks.get(key)
        if block is not None and block.tokens == tokens:
            self._blocks.move_to_end(key)
            return True
        if block is not None:
            self._drop(key)
        return False

    def _take_page(self, cost: int, room_tokens: int) -> int | None:
        """A free block of the pool for an entry of this cost, after evicting for it; None when there is no room."""
        self.trim(room_tokens - cost)
        if not self._free or self.cached_tokens + cost > room_tokens:
            return None
        return self._free.pop()

    def _add(self, block: Block) -> None:
        self._blocks[block.key] = block
        self._count(block, 1)

    def _count(self, block: Block, sign: int) -> None:
        self.cached_tokens += sign * block.cost
        self._pages += sign * (block.index is not None)
        self._wholes += sign * (block.logits is not None)

    def trim(self, room_tokens: int) -> None:
        """Drops least recently used entries until the cache holds at most room_tokens."""
        while self._blocks and self.cached_tokens > max(room_tokens, 0):
            self._drop(next(iter(self._blocks)))
            self.evicted_blocks += 1

    def _drop(self, key: int) -> None:
        block = self._blocks.pop(key)
        self._count(block, -1)
        if block.index is None:
            return
        self._free_page(block.index)

    def _free_page(self, index: int) -> None:
        """Gives a page of the pool back to the system and to the free list."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED, index * self._block_bytes, self._block_bytes)
        self._free.append(index)
