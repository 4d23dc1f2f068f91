"""Which waiting sequences join the batch at this step: the three batching strategies and the memory budget.

- ``continuous``: any step may admit new sequences (first come, first served) while the running batch has room;
  prefill of newcomers happens before the step's decode, at most ``max_prefill_tokens`` prompt tokens per step.
- ``dynamic``: when the batch is empty, everything that queued meanwhile becomes the next group and runs to
  completion (what Triton's dynamic batcher does for a model whose execute blocks); optional length buckets keep
  prompts of similar length together to cut padding. Finished sequences leave the batch at once.
- ``static``: when the batch is empty and ``static_batch_size`` requests wait (or the oldest waited
  ``static_timeout_s``), they run together to completion; finished rows keep being computed until the last one ends.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from python_backend.engine.kv_batch import KV_PEAK_FACTOR
from python_backend.engine.sequence import Sequence

STRATEGIES = ("continuous", "dynamic", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    strategy: str = "continuous"
    max_batch_size: int = 32  # most sequences decoded together
    kv_budget_tokens: int = 65536  # bound on cache slots, padding included (rows x longest row)
    max_queue_size: int = 256  # waiting sequences beyond this are refused (503 / UNAVAILABLE)
    max_prefill_tokens: int = 1024  # continuous: prompt tokens prefilled per step, at least one sequence
    static_batch_size: int = 8
    static_timeout_s: float = 0.5
    length_buckets: tuple[int, ...] = ()  # dynamic: prompt-length boundaries, e.g. (32, 128)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"batching strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], max_batch_size: int, kv_bytes_per_token: int) -> "SchedulerConfig":
        """From the llm model's config.pbtxt parameters. The KV budget bounds the real peak of cache memory,
        KV_PEAK_FACTOR times the padded cache (python_backend/engine/kv_batch.py)."""
        budget_bytes = int(float(params["kv_cache_budget_mb"]) * 2**20)
        return cls(
            strategy=params["batching_strategy"],
            max_batch_size=max_batch_size,
            kv_budget_tokens=budget_bytes // (KV_PEAK_FACTOR * kv_bytes_per_token),
            max_queue_size=int(params["max_queue_size"]),
            max_prefill_tokens=int(params["max_prefill_tokens"]),
            static_batch_size=int(params.get("static_batch_size") or max_batch_size),
            static_timeout_s=float(params["static_timeout_ms"]) / 1000,
            length_buckets=tuple(int(b) for b in params.get("length_buckets", "").split(",") if b.strip()),
        )


def padded_cache_bound(sequences: list[Sequence], cache_len: int) -> int:
    """Most cache slots the left-padded batch of these sequences can ever hold: every row is as long as the longest
    cache now, grown by the most tokens any row may still generate."""
    if not sequences:
        return 0
    longest = max([cache_len] + [len(s.prompt_ids) + len(s.output_ids) for s in sequences])
    return len(sequences) * (longest + max(s.remaining_tokens() for s in sequences))


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config

    def admit(self, waiting: deque[Sequence], running: list[Sequence], cache_len: int, now: float) -> list[Sequence]:
        """Pops the sequences to prefill now from the front of ``waiting``."""
        c = self.config
        if not waiting:
            return []
        if c.strategy == "continuous":
            return self._take(waiting, running, cache_len, c.max_prefill_tokens)
        if running:
            return []  # dynamic and static: a group runs to completion before the next starts
        if c.strategy == "static":
            if len(waiting) < c.static_batch_size and now - waiting[0].arrival < c.static_timeout_s:
                return []
            return self._take(waiting, [], 0, None, limit=c.static_batch_size)
        return self._take(waiting, [], 0, None, bucket=self._bucket(waiting[0]))

    def _take(self, waiting, running, cache_len, prefill_tokens, limit=None, bucket=None) -> list[Sequence]:
        c = self.config
        limit = min(limit or c.max_batch_size, c.max_batch_size - len(running))
        taken: list[Sequence] = []
        prompt_tokens = 0
        skipped: list[Sequence] = []
        while waiting and len(taken) < limit:
            candidate = waiting[0]
            if bucket is not None and self._bucket(candidate) != bucket:
                skipped.append(waiting.popleft())
                continue
            if taken and prefill_tokens is not None and prompt_tokens + len(candidate.prompt_ids) > prefill_tokens:
                break
            if padded_cache_bound(running + taken + [candidate], cache_len) > c.kv_budget_tokens:
                break
            taken.append(waiting.popleft())
            prompt_tokens += len(candidate.prompt_ids)
        waiting.extendleft(reversed(skipped))
        return taken

    def _bucket(self, sequence: Sequence) -> int:
        return bisect.bisect_left(self.config.length_buckets, len(sequence.prompt_ids))
