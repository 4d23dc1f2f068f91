"""The batching policy: which sequences join the batch, how their prefill is cut, when to decode, which rows stay.

The engine's core (core.py) holds the queues and asks at every step; the scheduler holds no state.

Waiting sequences are taken by priority (lower first; the core keeps the queue so ordered), first come, first served
within one; sequences with a positive priority (batch jobs) never take the last ``priority_reserved_slots`` rows.
While live work is about (continuous), background work is also held to ``background_rows_with_live`` rows and
``background_prefill_tokens_with_live`` prompt tokens a step: a live request then arrives into a short step.

- ``continuous``: any step may admit new sequences (first come, first served) while the running batch has room;
  prefill of newcomers happens before the step's decode, which runs at every step.
- ``dynamic``: when the batch is empty, everything that queued meanwhile becomes the next group and runs to
  completion (what Triton's dynamic batcher does for a model whose execute blocks); optional length buckets keep
  prompts of similar length together to cut padding. Finished sequences leave the batch at once.
- ``static``: when the batch is empty and ``static_batch_size`` requests wait (or the oldest waited
  ``static_timeout_s``), they run together to completion; finished rows keep being computed until the last one ends.

Every strategy prefills at most ``max_prefill_tokens`` prompt tokens per step, in chunks of similar prompt length;
a group (dynamic, static) decodes once all of it is prefilled. A prompt's tokens are the ones to compute: with prefix
caching, those the cache does not hold (the core's ``cost``), so that the rests of many prompts behind a cached
instruction are prefilled in the step that admits them, not one a step between decode steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from python_backend.engine.kv_batch import PaddedKVCache
from python_backend.engine.kv_slots import SlotKVCache
from python_backend.config_values import flag
from python_backend.engine.sequence import Sequence

STRATEGIES = ("continuous", "dynamic", "static")
KV_LAYOUTS = {cache.layout: cache for cache in (PaddedKVCache, SlotKVCache)}

# A padded position costs as much as a real one, and each extra chunk about as much as 14 positions (SmolLM2, 2 CPU
# cores): prefilling the benchmark's 32 prompts took 0.83 s at 10 %, 0.93 s at 25 % and 1.03 s with no padding.
PREFILL_MAX_PADDING = 0.10


@dataclass(frozen=True)
class SchedulerConfig:
    strategy: str = "continuous"
    max_batch_size: int = 32  # most sequences decoded together
    kv_budget_tokens: int = 65536  # bound on cached tokens (padded: rows x longest row; slots: each row's own)
    kv_layout: str = "padded"  # the decoder's: "padded" (kv_batch.py) or "slots" (kv_slots.py)
    max_context_length: int | None = None  # most prompt + max_tokens of one sequence (the slots' length)
    enable_kv_cache_reuse: bool = False  # prefix caching (prefix_cache.py); the slot layout only
    max_queue_size: int = 256  # waiting sequences (of a priority or more urgent) beyond this are refused (503)
    # Rows that sequences with priority > 0 (batch jobs) never take, so that live requests find one at once.
    priority_reserved_slots: int = 0
    # While a live sequence (priority <= 0) waits or runs, or did within live_grace_s, background sequences are
    # admitted only up to this many running rows and this many prompt tokens a step (at least one sequence); 0: no
    # bound. On a CPU a step's time grows with its rows, and a live request waits for the step it arrives into.
    background_rows_with_live: int = 0
    background_prefill_tokens_with_live: int = 0
    live_grace_s: float = 1.0  # a client's next live request usually comes within this: the bound stays on
    max_prefill_tokens: int = 1024  # continuous: prompt tokens prefilled per step, at least one sequence
    static_batch_size: int = 8
    static_timeout_s: float = 0.5
    length_buckets: tuple[int, ...] = ()  # dynamic: prompt-length boundaries, e.g. (32, 128)
    # LoRA: most distinct adapters in the running batch (0: no bound); a request with another one waits its turn,
    # requests for the base behind it go ahead. Each adapter's matrices are joined into the step's inputs
    # (python_backend/lora.py).
    max_adapters_per_step: int = 0

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"batching strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout must be one of {tuple(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if not 0 <= self.priority_reserved_slots < self.max_batch_size:
            raise ValueError(f"priority_reserved_slots must be in [0, max_batch_size {self.max_batch_size}), got "
                             f"{self.priority_reserved_slots}")
        if min(self.background_rows_with_live, self.background_prefill_tokens_with_live, self.live_grace_s) < 0:
            raise ValueError("background_rows_with_live, background_prefill_tokens_with_live and live_grace_ms must "
                             "be at least 0")

    @classmethod
    def from_parameters(cls, params: dict[str, str], max_batch_size: int, kv_bytes_per_token: int,
                        kv_layout: str = "padded", max_context_length: int | None = None,
                        reserved_bytes: int = 0, max_adapters_per_step: int = 0) -> "SchedulerConfig":
        """From the llm model's config.pbtxt parameters. The KV budget bounds the real peak of cache memory: for
        the padded cache, twice the cache (kv_batch.KV_PEAK_FACTOR); for slots written in place, the rows' tokens.
        ``reserved_bytes`` of kv_cache_budget_mb go to something else (LoRA adapters: llm_adapters.py)."""
        budget_bytes = int(float(params["kv_cache_budget_mb"]) * 2**20) - reserved_bytes
        max_context_length = max_context_length or int(params.get("max_context_length") or 0) or None
        if reserved_bytes and budget_bytes < (max_context_length or 1) * kv_bytes_per_token:
            raise ValueError(f"kv_cache_budget_mb {params['kv_cache_budget_mb']}: the LoRA adapters' "
                             f"{reserved_bytes / 2**20:.0f} MiB (max_loras x max_lora_rank) leave less than one "
                             "sequence's KV cache: raise the budget or lower max_loras or max_lora_rank")
        peak_factor = KV_LAYOUTS[kv_layout].kv_peak_factor
        return cls(
            strategy=params["batching_strategy"],
            max_batch_size=max_batch_size,
            kv_budget_tokens=budget_bytes // (peak_factor * kv_bytes_per_token),
            kv_layout=kv_layout,
            max_context_length=max_context_length,
            enable_kv_cache_reuse=kv_layout == "slots" and flag(params.get("enable_kv_cache_reuse", "false"),
                                                                "enable_kv_cache_reuse"),
            max_queue_size=int(params["max_queue_size"]),
            # a batch of one or two rows (a small max_batch_size) keeps at least one row for batch work
            priority_reserved_slots=min(int(params.get("priority_reserved_slots") or 0), max_batch_size - 1),
            background_rows_with_live=int(params.get("background_rows_with_live") or 0),
            background_prefill_tokens_with_live=int(params.get("background_prefill_tokens_with_live") or 0),
            live_grace_s=float(params.get("live_grace_ms") or 1000) / 1000,
            max_prefill_tokens=int(params["max_prefill_tokens"]),
            static_batch_size=int(params.get("static_batch_size") or max_batch_size),
            static_timeout_s=float(params["static_timeout_ms"]) / 1000,
            length_buckets=tuple(int(b) for b in params.get("length_buckets", "").split(",") if b.strip()),
            max_adapters_per_step=max_adapters_per_step,
        )


def cache_bound(layout: str, sequences: list[Sequence], cache_len: int) -> int:
    """Most tokens the cache of these sequences can ever hold, in the given layout."""
    if layout == "slots":  # each row in its own slot, at most its reservation (kv_slots.py)
        return sum(s.reserved_tokens() for s in sequences)
    return padded_cache_bound(sequences, cache_len)


def padded_cache_bound(sequences: list[Sequence], cache_len: int) -> int:
    """Most cache slots the left-padded batch of these sequences can ever hold: every row is as long as the longest
    cache now, grown by the most tokens any row may still generate."""
    if not sequences:
        return 0
    longest = max([cache_len] + [len(s.prompt_ids) + len(s.output_ids) for s in sequences])
    return len(sequences) * (longest + max(s.remaining_tokens() for s in sequences))


def _prompt_length(sequence: Sequence) -> int:
    return len(sequence.prompt_ids)


def length_sorted_chunks(sequences: list[Sequence], max_padding: float = PREFILL_MAX_PADDING,
                         cost=_prompt_length) -> list[list[Sequence]]:
    """Splits a prefill into chunks of similar length to compute (cost), so that padding stays under
    ``max_padding`` of each chunk's computed positions. Each sequence's cost is asked once (a prefix-cache look)."""
    sizes = {id(s): cost(s) for s in sequences}
    chunks: list[list[Sequence]] = []
    real = 0  # the last chunk's tokens to compute
    for seq in sorted(sequences, key=lambda s: sizes[id(s)], reverse=True):
        size = sizes[id(seq)]
        if chunks:
            chunk = chunks[-1]
            longest = sizes[id(chunk[0])]
            if (len(chunk) + 1) * longest - (real + size) <= max_padding * (len(chunk) + 1) * longest:
                chunk.append(seq)
                real += size
                continue
        chunks.append([seq])
        real = size
    return chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config

    def admit(self, waiting: deque[Sequence], running: list[Sequence], cache_len: int, now: float,
              live_active: bool = False, cost=None) -> list[Sequence]:
        """Pops the sequences to prefill now from the front of ``waiting``. live_active: live work waits or runs, or
        did within live_grace_s (the core keeps that time). cost(sequence): its prompt tokens to compute (default:
        all of them)."""
        c = self.config
        cost = cost or _prompt_length
        if not waiting:
            return []
        if c.strategy == "continuous":
            return self._take(waiting, running, cache_len, c.max_prefill_tokens, live_active=live_active, cost=cost)
        if running:
            return []  # dynamic and static: a group runs to completion before the next starts
        if c.strategy == "static":
            if len(waiting) < c.static_batch_size and now - waiting[0].arrival < c.static_timeout_s:
                return []
            return self._take(waiting, [], 0, None, limit=c.static_batch_size, cost=cost)
        return self._take(waiting, [], 0, None, bucket=self._bucket(waiting[0]), cost=cost)

    def prefill_chunks(self, admitted: list[Sequence], cost=None) -> list[list[Sequence]]:
        """Pops this step's prefill from the front of ``admitted`` (at most max_prefill_tokens prompt tokens, at least
        one sequence, so that no strategy's step runs unbounded while cancellations and the decode wait), in
        chunks of similar prompt length, more urgent priorities first."""
        taken, tokens, cost, sizes = [], 0, cost or _prompt_length, {}
        while admitted:
            size = cost(admitted[0])
            if taken and tokens + size > self.config.max_prefill_tokens:
                break
            sizes[id(admitted[0])] = size
            taken.append(admitted.pop(0))
            tokens += size
        # The most urgent first: a live request's first token does not wait for batch lines' prefill.
        return [chunk for priority in sorted({s.priority for s in taken})
                for chunk in length_sorted_chunks([s for s in taken if s.priority == priority],
                                                  cost=lambda s: sizes[id(s)])]

    def should_decode(self, running: list[Sequence], admitted: list[Sequence]) -> bool:
        """Whether the running batch decodes at this step: a group (dynamic, static) once all of it is prefilled,
        continuous at every step; never when every row has finished."""
        return (self.config.strategy == "continuous" or not admitted) and any(not s.finished for s in running)

    def rows_to_keep(self, running: list[Sequence]) -> list[int]:
        """The rows of the running batch that stay after this step. Static batching keeps computing finished rows
        (padding) until the last row ends; only a cancelled or failed row leaves at once."""
        if self.config.strategy == "static" and any(not s.finished for s in running):
            return [row for row, s in enumerate(running) if s.finish_reason not in ("cancelled", "error")]
        return [row for row, s in enumerate(running) if not s.finished]

    def _take(self, waiting, running, cache_len, prefill_tokens, limit=None, bucket=None,
              live_active=False, cost=_prompt_length) -> list[Sequence]:
        c = self.config
        limit = min(limit or c.max_batch_size, c.max_batch_size - len(running))
        background_running = sum(s.priority > 0 for s in running)
        background_room = c.max_batch_size - c.priority_reserved_slots - background_running
        background_tokens = None
        if live_active:
            if c.background_rows_with_live:
                background_room = min(background_room, c.background_rows_with_live - background_running)
            background_tokens = c.background_prefill_tokens_with_live or None
        taken: list[Sequence] = []
        prompt_tokens = background_taken = background_prompt_tokens = 0
        skipped: list[Sequence] = []
        adapters = {s.adapter.key for s in running if s.adapter is not None}
        adapter_waits = False  # once one waits for its adapter, adapters' requests behind it wait too (no starving)
        while waiting and len(taken) < limit:
            candidate = waiting[0]
            if c.max_adapters_per_step and candidate.adapter is not None and (adapter_waits or (
                    candidate.adapter.key not in adapters and len(adapters) >= c.max_adapters_per_step)):
                adapter_waits = True
                skipped.append(waiting.popleft())
                continue
            size = cost(candidate)  # its prompt tokens to compute (a prefix-cache look: asked once)
            if candidate.priority > 0:  # the queue is ordered by priority: only background work is left
                if background_taken >= background_room:
                    break
                if (background_tokens is not None and background_taken
                        and background_prompt_tokens + size > background_tokens):
                    break
            if bucket is not None and self._bucket(candidate) != bucket:
                skipped.append(waiting.popleft())
                continue
            if taken and prefill_tokens is not None and prompt_tokens + size > prefill_tokens:
                break
            if cache_bound(c.kv_layout, running + taken + [candidate], cache_len) > c.kv_budget_tokens:
                break
            taken.append(waiting.popleft())
            prompt_tokens += size
            if candidate.adapter is not None:
                adapters.add(candidate.adapter.key)
            if candidate.priority > 0:
                background_taken += 1
                background_prompt_tokens += size
        waiting.extendleft(reversed(skipped))
        return taken

    def _bucket(self, sequence: Sequence) -> int:
        return bisect.bisect_left(self.config.length_buckets, len(sequence.prompt_ids))
