"""The KV cache of a fused in-place graph (python_backend/runtime/onnx_slot_decoder.py): one preallocated slot per
running sequence, written in place by the graph, never copied by a step.

Row r of the running batch lives in slot r, so the batch is always the first ``size`` slots, one contiguous view
of each layer's buffer. A prefill writes its rows into the next free slots; a step appends one token per row at
that row's own length (no padding, no copy); when rows leave, the last rows move into the holes (one copy of each
moved row's tokens, made only when membership changes) and the freed slots' memory goes back to the system.

Memory: each layer's key and value buffer is reserved up front for ``slots x max_len`` tokens, but as anonymous
memory that the system backs only where it is written (and that ``release`` gives back). A decoder whose cache is in
torch tensors (the device path, onnx_slot_decoder.OnnxSlotDeviceDecoder) gets torch buffers on its device instead,
allocated whole. What is resident is the
rows' tokens, each row at most its reservation (prompt + max_tokens): that sum is what the scheduler's admission
bounds by the KV budget, and no step holds a second copy of the cache (``kv_peak_factor`` 1, against the padded
cache's 2).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from python_backend.lora import AdapterInputs

PAGE_BYTES = mmap.PAGESIZE


def buffers(tensors, count: int, shape: tuple, dtype) -> tuple[list[mmap.mmap], list]:
    """count zeroed arrays of this shape where ``tensors`` keeps a cache (python_backend/runtime/decoder.py; None:
    the host). On the host, anonymous private memory that the system backs only where it is written and whose pages
    madvise can give back (the maps, returned too); on a device, torch tensors allocated whole (no maps)."""
    if tensors is not None and not tensors.host:
        return [], [tensors.zeros(shape, dtype) for _ in range(count)]
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (a shared mapping would keep released pages)
    maps = [mmap.mmap(-1, nbytes, flags=private) for _ in range(count)]
    return maps, [np.frombuffer(m, dtype).reshape(shape) for m in maps]


@functools.cache
def fill_pool() -> ThreadPoolExecutor:
    """Threads for copies into the cache, one per core this process may use."""
    return ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="kv-fill")


class SlotKVCache:
    layout = "slots"
    kv_peak_factor = 1

    def __init__(self, decoder, slots: int, max_len: int):
        shape = decoder.cache_shape
        self.decoder = decoder
        row_bytes = shape.num_kv_heads * shape.head_dim * np.dtype(shape.dtype).itemsize
        # A slot spans whole pages (so that release() frees exactly its own) when max_len is a multiple of this.
        self.align_tokens = PAGE_BYTES // math.gcd(PAGE_BYTES, row_bytes)
        self.slots = slots
        self.max_len = -(-max_len // self.align_tokens) * self.align_tokens
        self.bytes_per_token = shape.bytes_per_token()
        slot_shape = (slots, shape.num_kv_heads, self.max_len, shape.head_dim)
        nbytes = int(np.prod(slot_shape)) * np.dtype(shape.dtype).itemsize
        self.tensors = decoder.tensors
        self._maps, self._buffers = buffers(self.tensors, len(shape.cache_names()), slot_shape, shape.dtype)
        self._slot_bytes = nbytes // slots
        self.lengths = np.zeros(0, np.int64)  # tokens held by each row
        self.reserved = np.zeros(0, np.int64)  # most tokens each row may hold (prompt + max_tokens)
        # LoRA: each row's adapter (None: the base), fed to a graph with adapter inputs at every call
        targets = getattr(decoder, "lora_targets", None)
        self.lora = AdapterInputs(targets) if targets else None
        self.adapters: list = []

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def cache_len(self) -> int:
        return int(self.lengths.max()) if self.size else 0

    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def cache_bytes(self) -> int:
        """Bytes of the rows' tokens (the system holds whole pages: up to align_tokens - 1 more tokens a row)."""
        return self.real_tokens() * self.bytes_per_token

    def _rows(self, start: int, stop: int) -> list[np.ndarray]:
        return [b[start:stop] for b in self._buffers]

    def _adapter_inputs(self, adapters: list) -> dict:
        """The forward's keyword for these rows' adapters (none without an adapter graph)."""
        if self.lora is None:
            if any(a is not None for a in adapters):
                raise ValueError("a LoRA adapter needs the variant's adapter graph (a server started with max_loras)")
            return {}
        return {"extra": self.lora.for_rows(adapters)}

    def prefill(self, prompts: list[list[int]], reserved: list[int], all_positions: bool = False,
                adapters: list | None = None, cached: list[int] | None = None,
                fills: list | None = None) -> tuple[np.ndarray | list[np.ndarray], int, int]:
        """Writes the prompts into the next free slots in one call (each with its LoRA adapter, or None). Row i's
        first ``cached[i]`` tokens (default none) are written by ``fills[i](row)`` (a prefix cache's blocks: it may
        write more, which the prefill overwrites) and the rest is computed: the rows' rests right-padded to the
        longest, each after its own past. Returns each prompt's last-position logits [rows, vocab] (with
        all_positions, per row the logits of each position computed [its rest's length, vocab]), the positions
        computed and the padding among them."""
        start, rows = self.size, len(prompts)
        adapters = adapters or [None] * rows
        cached = list(cached or [0] * rows)
        if start + rows > self.slots:
            raise ValueError(f"{start + rows} rows do not fit {self.slots} KV-cache slots")
        lengths = np.array([len(p) for p in prompts], np.int64)
        rests = lengths - np.array(cached, np.int64)
        if rests.min() < 1 or min(cached) < 0 or max(reserved) > self.max_len:
            raise ValueError(f"a prompt must hold 1 to {self.max_len} tokens with its max_tokens, one at least "
                             "not cached")
        longest = int(rests.max())
        input_ids = np.zeros((rows, longest), np.int64)
        for row, (prompt, skip) in enumerate(zip(prompts, cached)):
            input_ids[row, : len(prompt) - skip] = prompt[skip:]
        mask = (np.arange(int(lengths.max()))[None, :] < lengths[:, None]).astype(np.int64)
        cache = self._rows(start, start + rows)
        try:
            self._fill([(start + row, fill) for row, fill in enumerate(fills or []) if fill is not None])
            logits = self.decoder.forward_in_place(input_ids, mask, cache,
                                                   **({"all_positions": True} if all_positions else {}),
                                                   **({"new_counts": rests} if any(cached) else {}),
                                                   **self._adapter_inputs(adapters))
        except Exception:
            self.release(range(start, start + rows))
            raise
        self.adapters += adapters
        self.lengths = np.concatenate([self.lengths, lengths])
        self.reserved = np.concatenate([self.reserved, np.asarray(reserved, np.int64)])
        computed = (rows * longest, rows * longest - int(rests.sum()))
        if all_positions:
            return [logits[row, :rest] for row, rest in enumerate(rests)], *computed
        # The project's fused graphs compute the head at each row's last position only (fused_graph.py).
        return (logits[:, 0] if logits.shape[1] == 1 else logits[np.arange(rows), rests - 1]), *computed

    def _fill(self, rows: list[tuple[int, Callable]]) -> None:
        """Runs each fill(row) for its row on the CPU's cores: a copy into pages not written yet is mostly the
        system's page faults and zeroing, which threads share (numpy copies without the GIL). 31 rows behind a cached
        528-token instruction (fp32, 2 cores): 0.54 s one after another, 0.29 s on two threads with the blocks
        gathered once (prefix_cache.PrefixCache.fills); docs/performance.md."""
        if len(rows) < 2:
            for row, fill in rows:
                fill(self._rows(row, row + 1))
            return
        copies = [fill_pool().submit(fill, self._rows(row, row + 1)) for row, fill in rows]
        wait(copies)  # every copy ended before the caller may free or reuse a slot, whichever raised
        for copy in copies:
            copy.result()

    def adopt(self, length: int, reserved: int, fill, adapter=None) -> None:
        """A row in the next free slot whose ``length`` tokens ``fill(row)`` writes in whole (a prompt the prefix
        cache holds entire): nothing is computed."""
        start = self.size
        if start >= self.slots or not 0 < length <= reserved <= self.max_len:
            raise ValueError(f"cannot adopt {length} tokens into slot {start}")
        try:
            fill(self._rows(start, start + 1))
        except Exception:
            self.release([start])
            raise
        self.adapters.append(adapter)
        self.lengths = np.append(self.lengths, length)
        self.reserved = np.append(self.reserved, reserved)

    def fork(self, source: int, reserved: int) -> None:
        """A new row in the next free slot holding a copy of row ``source``'s tokens (the same prompt, admitted
        together: computed once)."""
        length = int(self.lengths[source])

        def copy(row: list[np.ndarray]) -> None:
            for target, held in zip(row, self.row(source)):
                target[:, :, :length] = held[:, :, :length]

        self.adopt(length, reserved, copy, self.adapters[source])

    def row(self, r: int) -> list[np.ndarray]:
        """Row r's cache: one [1, kv_heads, max_len, head_dim] view per layer key and value."""
        return self._rows(r, r + 1)

    def step(self, next_tokens: np.ndarray, rows: int | None = None) -> np.ndarray:
        """Feeds one token to each of the first ``rows`` rows (all by default), each appended at its row's length;
        returns their logits [rows, vocab]. The other rows wait, unchanged (paused). A row at its reservation (a
        finished row that static batching keeps computing) overwrites its last position instead of growing."""
        rows = self.size if rows is None else rows
        grown = np.minimum(self.lengths[:rows] + 1, self.reserved[:rows])
        mask = (np.arange(int(grown.max()))[None, :] < grown[:, None]).astype(np.int64)
        logits = self.decoder.forward_in_place(next_tokens[:rows].reshape(-1, 1), mask, self._rows(0, rows),
                                               **self._adapter_inputs(self.adapters[:rows]))
        self.lengths[:rows] = grown
        return logits[:, -1, :]

    def extend(self, r: int, tokens: list[int]) -> np.ndarray:
        """Feeds several tokens to row r alone, appended at its length (speculative decoding's check: the kernel
        takes more than one new token after a past for one row); returns the logits of each new position
        [len(tokens), vocab]. The row then holds them all: ``truncate`` drops those that turned out wrong."""
        length = int(self.lengths[r])
        if length + len(tokens) > self.max_len:
            raise ValueError(f"row {r}: {length} + {len(tokens)} tokens exceed its slot of {self.max_len}")
        logits = self.decoder.forward_in_place(np.array([tokens], np.int64), np.ones((1, length + len(tokens)),
                                                                                     np.int64),
                                               self.row(r), all_positions=True,
                                               **self._adapter_inputs(self.adapters[r:r + 1]))
        self.lengths[r] = length + len(tokens)
        return logits[0]

    def truncate(self, r: int, length: int) -> None:
        """Row r keeps its first ``length`` tokens (the next call writes over the rest)."""
        if not 0 < length <= self.lengths[r]:
            raise ValueError(f"row {r} holds {self.lengths[r]} tokens: cannot keep {length}")
        self.lengths[r] = length

    def swap(self, a: int, b: int) -> None:
        """Rows a and b trade slots (their tokens are copied), so that the rows a step decodes come first."""
        used = int(max(self.lengths[a], self.lengths[b]))
        for buffer in self._buffers:
            held = self.tensors.clone(buffer[a, :, :used])
            buffer[a, :, :used] = buffer[b, :, :used]
            buffer[b, :, :used] = held
        for array in (self.lengths, self.reserved):
            array[[a, b]] = array[[b, a]]
        self.adapters[a], self.adapters[b] = self.adapters[b], self.adapters[a]

    def select(self, rows: list[int]) -> list[int]:
        """Keeps these rows (ascending): the last kept rows move into the holes that leaving rows opened below
        them. Returns the rows' new order, as old row indices."""
        kept = len(rows)
        staying = {r for r in rows if r < kept}
        holes = [slot for slot in range(kept) if slot not in staying]
        movers = [r for r in rows if r >= kept]
        order = list(range(kept))
        for hole, row in zip(holes, movers):
            used = int(self.lengths[row])
            for buffer in self._buffers:
                buffer[hole, :, :used] = buffer[row, :, :used]
            order[hole] = row
        self.release(range(kept, self.size))
        self.lengths, self.reserved = self.lengths[order], self.reserved[order]
        self.adapters = [self.adapters[r] for r in order]
        return order

    def clear(self) -> None:
        self.release(range(self.size))
        self.lengths, self.reserved = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.adapters = []

    def release(self, slots) -> None:
        """Gives the slots' memory back to the system (reads as zeros after)."""
        slots = list(slots)
        if not slots:
            return
        start, stop = min(slots) * self._slot_bytes, (max(slots) + 1) * self._slot_bytes
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED, start, stop - start)
