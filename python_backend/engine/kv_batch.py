"""A batch of sequences sharing one left-padded KV cache.

Rows can be dropped (a sequence finished) and batches can be merged (new sequences join): both are copies made
only when membership changes, never at every step. Left padding is masked out by ``attention_mask``, and each row
keeps its own positions, so a sequence computes the same tokens wherever it sits in a batch.

The cache lives where the decoder keeps it (``decoder.tensors``: numpy in host memory, or torch tensors on a
device); the mask and the positions are small numpy arrays on the host, sent with every step.
"""

from __future__ import annotations

import numpy as np

# The real peak of KV-cache memory is twice the padded cache: a decode step holds the past and the new present
# (one column longer) at once, select() the old and the kept rows, extend() both batches and the merged one.
# The engine's budget divides by this, so that kv_cache_budget_mb bounds that peak, not the resting cache.
KV_PEAK_FACTOR = 2


class KVBatch:
    def __init__(self, past: list, attention_mask: np.ndarray, next_positions: np.ndarray, tensors):
        self.past = past
        self.attention_mask = attention_mask  # [batch, cache_len], 0 where a row is left-padded
        self.next_positions = next_positions  # [batch], position id of each row's next token
        self.tensors = tensors  # the decoder's: how cache tensors are made and indexed

    @property
    def size(self) -> int:
        return self.attention_mask.shape[0]

    @property
    def cache_len(self) -> int:
        return self.attention_mask.shape[1]

    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.past)

    @classmethod
    def prefill(cls, decoder, prompts: list[list[int]],
                all_positions: bool = False) -> tuple["KVBatch", np.ndarray | list[np.ndarray], int]:
        """Runs the prompts as one left-padded batch. Returns the batch, last-position logits [batch, vocab] (with
        all_positions, per row the logits of each of its positions [its length, vocab]) and the number of padding
        tokens computed."""
        longest = max(len(p) for p in prompts)
        input_ids = np.zeros((len(prompts), longest), np.int64)
        mask = np.zeros((len(prompts), longest), np.int64)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt):] = prompt
            mask[row, longest - len(prompt):] = 1
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        logits, present = decoder.forward(input_ids, mask, positions, decoder.empty_cache(len(prompts)),
                                          **({"all_positions": True} if all_positions else {}))
        lengths = mask.sum(axis=1)
        padding = int(mask.size - lengths.sum())
        batch = cls(present, mask, lengths.astype(np.int64), decoder.tensors)
        if all_positions:
            return batch, [logits[row, longest - len(p):] for row, p in enumerate(prompts)], padding
        return batch, logits[:, -1, :], padding

    def step(self, decoder, next_tokens: np.ndarray) -> np.ndarray:
        """Feeds one token per row; returns logits [batch, vocab]."""
        mask = np.concatenate([self.attention_mask, np.ones((self.size, 1), np.int64)], axis=1)
        logits, self.past = decoder.forward(
            next_tokens.reshape(-1, 1), mask, self.next_positions.reshape(-1, 1), self.past
        )
        self.attention_mask = mask
        self.next_positions = self.next_positions + 1
        return logits[:, -1, :]

    def select(self, rows: list[int]) -> None:
        """Keeps only these rows (in this order) and drops cache columns that are padding in every kept row."""
        index = np.asarray(rows, dtype=np.int64)
        mask = self.attention_mask[index]
        first_real = int(np.argmax(mask.any(axis=0))) if mask.size else 0
        self.attention_mask = mask[:, first_real:]
        kept = self.tensors.rows(index)
        self.past = [t[:, :, first_real:, :][kept] for t in self.past]  # one copy each, contiguous
        self.next_positions = self.next_positions[index]

    def extend(self, other: "KVBatch") -> None:
        """Appends other's rows, left-padding whichever cache is shorter (each tensor is copied once)."""
        length = max(self.cache_len, other.cache_len)
        self.past = [_stack_right_aligned(self.tensors, a, b, length) for a, b in zip(self.past, other.past)]
        self.attention_mask = _stack_right_aligned(np, self.attention_mask, other.attention_mask, length)
        self.next_positions = np.concatenate([self.next_positions, other.next_positions])


def _stack_right_aligned(tensors, top, bottom, length: int):
    """Rows of top then bottom, each right-aligned along axis 2 of a cache tensor (axis 1 of a mask), zeros
    on the left. ``tensors`` makes the zeros where top lives (numpy itself for the host mask)."""
    axis = 2 if top.ndim == 4 else 1
    shape = list(top.shape)
    shape[0], shape[axis] = top.shape[0] + bottom.shape[0], length
    out = tensors.zeros(shape, top.dtype)
    index = [slice(None)] * top.ndim
    index[0], index[axis] = slice(0, top.shape[0]), slice(length - top.shape[axis], None)
    out[tuple(index)] = top
    index[0], index[axis] = slice(top.shape[0], None), slice(length - bottom.shape[axis], None)
    out[tuple(index)] = bottom
    return out


class PaddedKVCache:
    """The running batch's KVBatch behind the interface the engine's core uses for every cache layout (the
    other: kv_slots.SlotKVCache): prefill appends rows, step feeds one token per row, select keeps rows."""

    layout = "padded"
    kv_peak_factor = KV_PEAK_FACTOR

    def __init__(self, decoder):
        self.decoder = decoder
        self.batch: KVBatch | None = None

    @property
    def size(self) -> int:
        return self.batch.size if self.batch else 0

    @property
    def cache_len(self) -> int:
        return self.batch.cache_len if self.batch else 0

    def real_tokens(self) -> int:
        return self.batch.real_tokens() if self.batch else 0

    def cache_bytes(self) -> int:
        return self.batch.cache_bytes() if self.batch else 0

    def prefill(self, prompts: list[list[int]], reserved: list[int],
                all_positions: bool = False) -> tuple[np.ndarray | list[np.ndarray], int, int]:
        """Prefills the prompts as one left-padded batch and appends it. Returns each prompt's last-position
        logits [rows, vocab] (with all_positions, per row its positions' [its length, vocab]), the positions
        computed and the padding among them."""
        batch, logits, padding = KVBatch.prefill(self.decoder, prompts, all_positions)
        computed = batch.size * batch.cache_len
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.extend(batch)
        return logits, computed, padding

    def step(self, next_tokens: np.ndarray) -> np.ndarray:
        return self.batch.step(self.decoder, next_tokens)

    def select(self, rows: list[int]) -> list[int]:
        """Keeps these rows, in this order; returns it."""
        if not rows:
            self.batch = None
        else:
            self.batch.select(rows)
        return list(rows)

    def clear(self) -> None:
        self.batch = None
