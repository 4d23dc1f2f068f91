"""The engine's core: each step cancels, admits, prefills, decodes and retires sequences, and returns what it did."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial

import numpy as np

from python_backend.engine.batch_sampling import choose_next
from python_backend.engine.kv_batch import PaddedKVCache
from python_backend.engine.kv_slots import SlotKVCache
from python_backend.engine.prefix_cache import PrefixCache
from python_backend.engine.sampling import prompt_token_logprobs
from python_backend.engine.scheduler import Scheduler, SchedulerConfig, cache_bound
from python_backend.engine.sequence import Sequence
from python_backend.engine.speculative import Drafter, SpeculationCounts
from python_backend.engine.step_output import (Decoded, EngineState, Event, Failed, NewTokens, Prefilled, PrefixLookup,
                                               Speculated, StepOutput)
from python_backend.errors import InvalidRequestError, UnavailableError

# A cancel whose key matches no sequence came after its sequence finished, or overtook its request: kept this long
# for add() to find.
UNMATCHED_CANCEL_TTL_S = 60.0


class QueueFullError(UnavailableError):
    """The waiting queue is at its bound: the client should retry later (503 / UNAVAILABLE)."""


def open_kv_cache(decoder, config: SchedulerConfig):
    """The KV cache the decoder's graph writes: slots written in place (a fused graph), else a padded batch."""
    if getattr(decoder, "kv_layout", "padded") == "slots":
        if not config.max_context_length:
            raise ValueError("a slot KV cache needs the scheduler config's max_context_length (the slots' length)")
        return SlotKVCache(decoder, config.max_batch_size, config.max_context_length)
    return PaddedKVCache(decoder)


def check_drafter(drafter: Drafter, decoder, cache) -> None:
    """Speculative decoding needs the served graph's logits at every new position, on a slot cache, and a draft of
    the same vocabulary."""
    if cache.layout != "slots" or not getattr(decoder, "scores_prompts", False):
        raise ValueError("speculative decoding needs a fused graph's slot KV cache whose graph gives every position's "
                         "logits (a QUANT variant's folder, built since prompt scoring)")
    if drafter.decoder.vocab_size != decoder.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({drafter.decoder.vocab_size} tokens) is not the served "
                         f"model's ({decoder.vocab_size})")


def open_prefix_cache(cache, config: SchedulerConfig) -> PrefixCache | None:
    """The prefix cache when reuse is on; its blocks are whole pages of the slot cache's memory."""
    if not config.enable_kv_cache_reuse:
        return None
    if cache.layout != "slots":
        raise ValueError("enable_kv_cache_reuse needs a fused graph's slot KV cache (every QUANT variant's folder); "
                         "the export's own graph (build/model itself, the GPU runtimes, a model the fused graph "
                         "cannot take) has no prefix caching")
    block = -(-16 // cache.align_tokens) * cache.align_tokens  # at least 16 tokens, whole pages
    return PrefixCache(cache.decoder.cache_shape, config.kv_budget_tokens, block, cache.decoder.vocab_size,
                       cache.tensors)


def _scores_top(seq: Sequence) -> int | None:
    """A scored prompt's top count (what its scores must hold), None for a prompt not scored."""
    return seq.params.top_logprobs if seq.params.prompt_logprobs else None


def _scores(seq: Sequence, logits: np.ndarray, first: int) -> list:
    """The scores of prompt tokens first, first + 1, ... from the logits of the positions before each."""
    return prompt_token_logprobs(logits, seq.prompt_ids[first:first + len(logits)], seq.params.top_logprobs)


class EngineCore:
    """The queues, the running batch's KV cache, and one step at a time: no thread, no callbacks; the scheduler
    decides. decoder: any runtime of python_backend/runtime/ (the interface is in python_backend/runtime/decoder.py).

    add() and cancel() change the waiting queue and the cancel keys, and a step reads them holding ``intake_lock``:
    a caller on several threads passes the lock that it holds around add() and cancel() (loop.py). The step's
    parts are generators of the events they make (``yield from`` runs them).

    drafter: speculative decoding (speculative.py) for a row decoding alone, on a slot cache whose graph gives every
    position's logits; None: one token a step for every row."""

    def __init__(self, decoder, config: SchedulerConfig, intake_lock=None, drafter: Drafter | None = None):
        self.decoder = decoder
        self.cache = open_kv_cache(decoder, config)
        if config.kv_layout != self.cache.layout:
            raise ValueError(f"the scheduler counts a {config.kv_layout} KV cache, the decoder writes "
                             f"{self.cache.layout}")
        if drafter is not None:
            check_drafter(drafter, decoder, self.cache)
        self.drafter = drafter
        self.speculation = SpeculationCounts()
        self.prefix = open_prefix_cache(self.cache, config)
        self.config = config
        self.scheduler = Scheduler(config)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not computed yet
        self.running: list[Sequence] = []  # the rows of the cache, in order
        self._next_tokens = np.zeros(0, np.int64)  # each row's last chosen token, fed at the next decode
        self._cancelled: dict[str, float] = {}  # key -> when the cancel arrived
        self._intake_lock = nullcontext() if intake_lock is None else intake_lock
        self._reported_state: EngineState | None = None
        self._live_seen_at = float("-inf")  # when a live sequence (priority <= 0) last waited or ran
        self._decoded_last_step = False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting)

    def add(self, sequence: Sequence) -> list[Event]:
        """Queues a sequence, or returns its final event at once when a cancel for it came first. Raises
        InvalidRequestError when it can never fit the KV budget, QueueFullError when the waiting queue is full."""
        if sequence.params.prompt_logprobs and not getattr(self.decoder, "scores_prompts", False):
            raise InvalidRequestError(f"prompt log-probabilities are not available on this runtime "
                                      f"({type(self.decoder).__name__}: its graph returns the last position's logits "
                                      "only)")
        if sequence.adapter is not None and getattr(self.cache, "lora", None) is None:
            raise InvalidRequestError(f"LoRA adapter {sequence.adapter.name!r}: this server runs no adapter graph "
                                      "(adapters need a variant's folder, the fused graph, and max_loras above 0)")
        need = cache_bound(self.config.kv_layout, [sequence], 0)
        if need > self.config.kv_budget_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens need {need} KV-cache slots, more than the budget of "
                f"{self.config.kv_budget_tokens}"
            )
        if self.config.max_context_length and sequence.reserved_tokens() > self.config.max_context_length:
            raise InvalidRequestError(f"prompt + max_tokens are {sequence.reserved_tokens()} tokens, more than the "
                                      f"context length of {self.config.max_context_length}")
        if self._cancelled.pop(sequence.key, None) is not None:  # its client left before it got here
            sequence.finish_reason = "cancelled"
            return list(self._emit(sequence))
        # Only sequences as urgent or more count: background (batch) work never makes the queue refuse live work.
        if sum(s.priority <= sequence.priority for s in self.waiting) >= self.config.max_queue_size:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_size} requests); retry later")
        self._enqueue(sequence)
        return []

    def _enqueue(self, sequence: Sequence) -> None:
        """Keeps ``waiting`` ordered by priority, first come first served within one (usually an append)."""
        after = len(self.waiting)
        while after and self.waiting[after - 1].priority > sequence.priority:
            after -= 1
        self.waiting.insert(after, sequence)

    def cancel(self, key: str) -> None:
        """Cancels the sequence with this key at the next step, or when add() brings it."""
        self._cancelled[key] = time.monotonic()

    def step(self) -> StepOutput:
        """One iteration, run to its end: what it did."""
        out = StepOutput()
        for _ in self.stream(out):
            pass
        return out

    def stream(self, out: StepOutput) -> Iterator[Event]:
        """One iteration that yields each event as it happens, so that a caller can hand tokens out while the rest
        of the step computes; ``out`` records them, and the step's state, progress and error.

        An error that escapes the per-sequence handling (a failed decode step) fails the sequences in the batch and
        becomes the step's error; waiting ones are untouched and the next step goes on."""
        try:
            for event in self._step(out):
                out.events.append(event)
                yield event
        except Exception as error:  # noqa: BLE001 - the engine must survive; the requests get the error
            print(f"[engine] step failed, failing {len(self.running) + len(self.prefilling)} requests: "
                  f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
            out.progressed, out.error = True, error
            failures = list(self._fail_all(error))
            out.events += failures
            yield from failures

    def abort(self, error: Exception) -> list[Event]:
        """Fails every sequence not finished yet, waiting ones included (the engine stops)."""
        self.prefilling += list(self.waiting)
        self.waiting.clear()
        return list(self._fail_all(error))

    def _step(self, out: StepOutput) -> Iterator[Event]:
        with self._intake_lock:
            cancelled = self._apply_cancellations()
            busy = self.running + self.prefilling
            clock = time.monotonic()
            if (self.waiting and self.waiting[0].priority <= 0) or any(s.priority <= 0 for s in busy):
                self._live_seen_at = clock
            live_active = clock - self._live_seen_at <= self.config.live_grace_s
            self.prefilling += self.scheduler.admit(self.waiting, busy, self.cache.cache_len, clock, live_active,
                                                    self._prompt_cost)
        for seq in cancelled:
            yield from self._emit(seq)
        if self.prefix is not None:  # the cache gets what the admitted reservations leave, before they are written
            counts = (self.prefix.queried_tokens, self.prefix.hit_tokens, self.prefix.evicted_blocks)
            self.prefix.trim(self._prefix_room())
        chunks = self.scheduler.prefill_chunks(self.prefilling, self._prompt_cost)
        for chunk in chunks:
            yield from self._prefill(chunk)
        if self.prefix is not None:
            now = (self.prefix.queried_tokens, self.prefix.hit_tokens, self.prefix.evicted_blocks)
            if now != counts:
                yield PrefixLookup(*(a - b for a, b in zip(now, counts)))
        decoding = self.scheduler.should_decode(self.running, self.prefilling)
        if decoding and live_active and self._decoded_last_step and any(s.priority > 0 for c in chunks for s in c):
            # A live request waits for the step it arrives into: while live work is about, background prefill and
            # the decode take turns, each a short step (never two prefill steps in a row: the decode goes on).
            decoding = False
        if decoding:
            yield from self._decode(self._rows_to_decode(live_active))
        self._decoded_last_step = decoding
        self._retire()
        state = EngineState(len(self.running), len(self.waiting) + len(self.prefilling), self.cache.cache_bytes(),
                            self.prefix.cached_bytes() if self.prefix else 0)
        if state != self._reported_state or chunks or decoding:
            self._reported_state = out.state = state
        out.progressed = bool(chunks) or decoding or bool(cancelled)

    def _apply_cancellations(self) -> list[Sequence]:
        """Marks cancelled sequences and takes them out of the queues; returns them."""
        now = time.monotonic()
        cancelled = []
        for seq in list(self.waiting) + self.prefilling + self.running:
            if seq.finished:
                continue
            if self._cancelled.pop(seq.key, None) is not None or (seq.is_cancelled is not None and seq.is_cancelled()):
                seq.finish_reason = "cancelled"
                cancelled.append(seq)
        for seq in cancelled:
            if seq in self.waiting:
                self.waiting.remove(seq)
            elif seq in self.prefilling:
                self.prefilling.remove(seq)
        for key in [k for k, at in self._cancelled.items() if now - at > UNMATCHED_CANCEL_TTL_S]:
            del self._cancelled[key]
        return cancelled

    def _prefill(self, chunk: list[Sequence]) -> Iterator[Event]:
        rows = len(self.running)
        try:
            yield from self._prefill_chunk(chunk)
        except Exception as error:  # noqa: BLE001 - find the culprit: each sequence alone
            if len(self.running) != rows:  # rows joined the cache: computed again, they would be there twice
                raise  # the step fails its batch (stream)
            if len(chunk) == 1:
                yield from self._fail(chunk[0], error)
                return
            for seq in chunk:
                try:
                    yield from self._prefill_chunk([seq])
                except Exception as single_error:  # noqa: BLE001
                    yield from self._fail(seq, single_error)

    def _prefill_chunk(self, sequences: list[Sequence]) -> Iterator[Event]:
        unique, forks = self._unique(sequences)
        hits = {id(s): self.prefix.match(s.prompt_ids, s.prefix_salt, _scores_top(s)) for s in unique} \
            if self.prefix else {}
        first_row = len(self.running)
        parts, computed, padding, errors = [], 0, 0, {}
        for scoring in (False, True):  # a prompt scored needs every position's logits: its own call
            group = [s for s in unique if s.params.prompt_logprobs == scoring
                     and not (hits.get(id(s)) and hits[id(s)].whole is not None)]
            for rows, (logits, rows_computed, rows_padding) in self._compute(group, hits, scoring, errors):
                self.running += rows  # the cache's new rows, in order
                parts.append(logits)
                computed, padding = computed + rows_computed, padding + rows_padding
        for seq in unique:  # prompts held whole: copied in, nothing computed
            hit = hits.get(id(seq))
            if not hit or hit.whole is None:
                continue
            try:
                self.cache.adopt(len(seq.prompt_ids), seq.reserved_tokens(), partial(self.prefix.load, hit),
                                 seq.adapter)
            except Exception as error:  # noqa: BLE001 - this sequence's own copy: it fails alone
                errors[id(seq)] = error
                continue
            if seq.params.prompt_logprobs:
                seq.prompt_logprobs = hit.scores()
            self.running.append(seq)
            parts.append(hit.whole.logits[None])
        for seq in unique:
            if id(seq) in errors:
                yield from self._fail(seq, errors[id(seq)])
        logits = np.concatenate(parts) if parts else None  # row i: running[first_row + i]'s last prompt position
        computed_rows = {id(seq): i for i, seq in enumerate(self.running[first_row:])}
        copied = []  # the computed row each fork copies
        for seq, source in forks:  # the same prompt as one computed above: its row copied, its logits shared
            if id(source) not in computed_rows:  # its prefill failed: so does this one's
                yield from self._fail(seq, errors[id(source)])
                continue
            copied.append(computed_rows[id(source)])
            self.cache.fork(first_row + copied[-1], seq.reserved_tokens())
            seq.prompt_logprobs = source.prompt_logprobs
            self.running.append(seq)
        if copied:
            logits = np.concatenate([logits, logits[copied]])
        joined = self.running[first_row:]
        if self.prefix is not None:
            self._store_prefixes(joined[:len(computed_rows)], first_row, logits)
        if not joined:
            return
        tokens, failed = self._choose_first(joined, logits)
        self._next_tokens = np.concatenate([self._next_tokens, tokens])
        yield Prefilled(computed, padding)
        for seq, error in failed:
            yield from self._fail(seq, error)
        for seq in joined:
            yield from self._emit(seq)

    def _store_prefixes(self, joined: list[Sequence], first_row: int, logits: np.ndarray) -> None:
        """Copies the prompts just prefilled into the prefix cache. The cache only saves work: a copy that fails is
        said and skipped, and the requests go on."""
        room = self._prefix_room()
        for i, seq in enumerate(joined):
            try:
                self.prefix.store(seq.prompt_ids, seq.prefix_salt, self.cache.row(first_row + i), room, logits[i],
                                  seq.prompt_logprobs, seq.params.top_logprobs)
            except Exception as error:  # noqa: BLE001 - the request does not need it
                print(f"[engine] prefix cache: a prompt was not stored: {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)

    def _compute(self, rows: list[Sequence], hits: dict, scoring: bool, errors: dict) -> list[tuple[list, tuple]]:
        """The calls that prefilled these rows, with what each returned: one call, or when it fails each row alone,
        so that only the culprit fails (its error in errors). (A graph built before query_seqlens refuses several
        rows after their pasts: they are then computed one at a time.)"""
        if not rows:
            return []
        try:
            return [(rows, self._prefill_rows(rows, hits, scoring))]
        except Exception as error:  # noqa: BLE001 - a bad prompt must not fail its neighbours
            if len(rows) == 1:
                errors[id(rows[0])] = error
                return []
            return [done for seq in rows for done in self._compute([seq], hits, scoring, errors)]

    def _prefill_rows(self, rows: list[Sequence], hits: dict, scoring: bool) -> tuple[np.ndarray, int, int]:
        """One model call that writes these prompts into the next free slots, each after what the prefix cache
        holds of it: their last logits [rows, vocab], the positions computed and the padding among them. A prompt
        scored recomputes its last cached position too: its logits score the first token not cached (the cache
        keeps scores, not logits)."""
        cached = [hits[id(s)].tokens(self.prefix.block_tokens) - scoring if hits.get(id(s)) else 0 for s in rows]
        options = {"adapters": [s.adapter for s in rows]} if any(s.adapter for s in rows) else {}
        if any(cached):  # (the slot cache's; the padded cache has no prefix caching)
            options.update(cached=cached, fills=self.prefix.fills([hits.get(id(s)) for s in rows]))
        prompts, reserved = [s.prompt_ids for s in rows], [s.reserved_tokens() for s in rows]
        logits, computed, padding = self.cache.prefill(prompts, reserved, all_positions=scoring, **options)
        if not scoring:
            return logits, computed, padding
        for seq, positions, skip in zip(rows, logits, cached):
            before = hits[id(seq)].scores() if skip else [None]  # a first token has no score
            seq.prompt_logprobs = before + _scores(seq, positions[:-1], skip + 1)
        return np.stack([positions[-1] for positions in logits]), computed, padding

    def _prompt_cost(self, seq: Sequence) -> int:
        """The prompt tokens a prefill of seq computes: those the prefix cache does not hold (the scheduler's
        prefill budget counts these)."""
        if self.prefix is None:
            return len(seq.prompt_ids)
        return len(seq.prompt_ids) - self.prefix.found_tokens(seq.prompt_ids, seq.prefix_salt, _scores_top(seq))

    @staticmethod
    def _choose_first(joined: list[Sequence], logits: np.ndarray):
        """Each prefilled sequence's first token; a sequence that only scores its prompt (max_tokens 0) ends."""
        choosing = [i for i, seq in enumerate(joined) if seq.params.max_tokens > 0]
        for i in set(range(len(joined))) - set(choosing):
            joined[i].finish_reason = "length"
        if len(choosing) == len(joined):
            return choose_next(joined, logits)
        tokens = np.zeros(len(joined), np.int64)
        tokens[choosing], failed = choose_next([joined[i] for i in choosing], logits[choosing])
        return tokens, failed

    def _unique(self, sequences: list[Sequence]) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]]]:
        """The sequences whose prompts are computed, and the others (slot cache: the same prompt and salt as one of
        them, like ``n`` choices of one prompt admitted together) each with the one it copies."""
        if self.cache.layout != "slots":
            return sequences, []
        unique, forks, first = [], [], {}
        for seq in sequences:
            source = first.setdefault((seq.prefix_salt, tuple(seq.prompt_ids), _scores_top(seq)), seq)
            if source is seq:
                unique.append(seq)
            else:
                forks.append((seq, source))
        return unique, forks

    def _prefix_room(self) -> int:
        """Tokens of the KV budget that the running and admitted sequences' reservations leave to the prefix cache."""
        return self.config.kv_budget_tokens - sum(s.reserved_tokens() for s in self.running + self.prefilling)

    def _rows_to_decode(self, live_active: bool) -> int:
        """How many rows, from the first, this step decodes. While live work is about (continuous, slot cache),
        background rows beyond background_rows_with_live wait: the rows that decode (the live ones and the first
        background ones in row order) are moved to the front, and the rest keep their next token for later."""
        rows, bound = len(self.running), self.config.background_rows_with_live
        if not (live_active and bound and self.config.strategy == "continuous" and self.cache.layout == "slots"):
            return rows
        background = [r for r, s in enumerate(self.running) if s.priority > 0 and not s.finished]
        paused = set(background[bound:])
        if not paused:
            return rows
        count = rows - len(paused)
        outside = [r for r in range(count, rows) if r not in paused]
        holes = [r for r in range(count) if r in paused]
        for a, b in zip(outside, holes):
            self.cache.swap(a, b)
            self.running[a], self.running[b] = self.running[b], self.running[a]
            self._next_tokens[[a, b]] = self._next_tokens[[b, a]]
        return count

    def _decode(self, rows: int) -> Iterator[Event]:
        if self.drafter is not None and rows == len(self.running) == 1 and self._speculates(self.running[0]):
            yield from self._decode_speculative(self.running[0])
            return
        logits = self.cache.step(self._next_tokens) if rows == len(self.running) else \
            self.cache.step(self._next_tokens, rows)
        live = [row for row in range(rows) if not self.running[row].finished]
        yield Decoded(rows, rows - len(live))
        chosen, failed = choose_next([self.running[r] for r in live], logits[live])
        for seq, error in failed:
            yield from self._fail(seq, error)
        self._next_tokens[live] = chosen
        for row in live:
            yield from self._emit(self.running[row])

    def _speculates(self, seq: Sequence) -> bool:
        """Whether this lone row decodes speculatively: nothing waits to join it (continuous batching; a round, with
        the draft model's prefill of the row, would hold their prefill back: the first request of a burst behind one
        instruction held the other 31 for 2 s instead of 1 s), greedy (a sampled row would rarely keep a draft),
        the base model (the draft knows no adapter), and room for a draft and the served model's token after it."""
        joining = self.prefilling or (self.waiting and self.config.strategy == "continuous")  # (a group: none joins)
        return (not joining and not seq.finished and seq.params.greedy
                and seq.adapter is None and seq.remaining_tokens() >= 2
                and seq.output_ids[-1:] == [int(self._next_tokens[0])])

    def _decode_speculative(self, seq: Sequence) -> Iterator[Event]:
        """One round for the lone row 0: the draft proposes k tokens, the served model computes the row's next token
        and the k drafts in one call, and the row takes each position's choice while the draft before it was that
        choice. 1 to k + 1 tokens, each the one plain decoding would have chosen from these logits."""
        k = min(self.drafter.draft_tokens, seq.remaining_tokens() - 1)
        tokens = seq.prompt_ids + seq.output_ids
        try:
            proposed = self.drafter.propose(seq.key, tokens, k)
        except Exception as error:  # noqa: BLE001 - the draft is an optimisation: the row decodes plainly instead
            print(f"[engine] draft model failed, decoding plainly: {type(error).__name__}: {error}", file=sys.stderr,
                  flush=True)
            self.drafter.forget()
            logits = self.cache.step(self._next_tokens)
            yield Decoded(1, 0)
            yield from self._choose_in_turn(seq, logits, [])
            return
        length = int(self.cache.lengths[0])
        logits = self.cache.extend(0, [int(self._next_tokens[0]), *proposed])
        yield Decoded(1, 0)
        kept = yield from self._choose_in_turn(seq, logits, proposed)
        self.cache.truncate(0, length + 1 + kept)
        self.drafter.accept(kept)
        self.speculation.rounds += 1
        self.speculation.proposed += k
        self.speculation.accepted += kept
        yield Speculated(k, kept)

    def _choose_in_turn(self, seq: Sequence, logits: np.ndarray, proposed: list[int]):
        """Row 0's tokens from its positions' logits in turn, going on while the token chosen is the draft fed next;
        its tokens are emitted. Returns how many drafts it kept."""
        kept = 0
        while True:
            chosen, failed = choose_next([seq], logits[kept:kept + 1])
            for failed_seq, error in failed:
                yield from self._fail(failed_seq, error)
            self._next_tokens[0] = chosen[0]
            if failed or seq.finished or kept == len(proposed) or int(chosen[0]) != proposed[kept]:
                break
            kept += 1
        yield from self._emit(seq)
        return kept

    def _retire(self) -> None:
        """Frees the cache rows that the scheduler lets go."""
        keep = self.scheduler.rows_to_keep(self.running)
        if len(keep) == len(self.running):
            return
        order = self.cache.select(keep)
        self.running = [self.running[r] for r in order]
        self._next_tokens = self._next_tokens[order]

    def _fail_all(self, error: Exception) -> Iterator[Event]:
        """An error that cannot be pinned on one request: every request in the batch or being prefilled ends
        with it at once."""
        failing = self.running + self.prefilling
        self.cache.clear()
        self.running, self.prefilling = [], []
        self._next_tokens = np.zeros(0, np.int64)
        for seq in failing:
            yield from self._fail(seq, error)

    @staticmethod
    def _fail(seq: Sequence, error: Exception) -> Iterator[Event]:
        if not seq.final_sent:
            seq.finish_reason, seq.final_sent = "error", True
            yield Failed(seq, error)

    @staticmethod
    def _emit(seq: Sequence) -> Iterator[Event]:
        """The sequence's tokens not handed out yet, and whether they are its last."""
        if seq.final_sent:
            return
        new, logprobs = seq.take_emittable()
        seq.final_sent = seq.finished
        if new or seq.finished:
            yield NewTokens(seq, new, seq.finished, logprobs)
