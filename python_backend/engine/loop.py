"""The engine on its own thread: it runs the core (core.py) step after step and delivers what each step returns.

Requests and cancels arrive from Triton's execute() threads under one lock; responses, errors and metrics leave
through an outbox (outbox.py), and a token's latency is measured when its response leaves. The Triton model only
submits, cancels and turns emitted tokens into responses."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from python_backend.engine.core import EngineCore, QueueFullError
from python_backend.engine.outbox import Outbox
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.step_output import (Decoded, Event, Failed, NewTokens, Prefilled, PrefixLookup, Speculated,
                                               StepOutput)
from python_backend.errors import UnavailableError

__all__ = ["Engine", "EngineObserver", "QueueFullError", "generate"]


class EngineObserver:
    """Hooks for metrics; the defaults keep the padding totals (used by benchmarks and tests)."""

    def __init__(self):
        self.computed_tokens = 0
        self.padding_tokens = 0

    def on_prefill(self, computed: int, padding: int) -> None:
        self.computed_tokens += computed
        self.padding_tokens += padding

    def on_decode(self, batch_size: int, dead_rows: int) -> None:
        self.computed_tokens += batch_size
        self.padding_tokens += dead_rows

    def on_tokens(self, count: int, ttft: float | None, itl: float | None) -> None:
        """count tokens handed out to one sequence; ttft for its first, else itl: the mean gap per token."""

    def on_prefix_lookup(self, queried: int, hits: int, evicted_blocks: int) -> None:
        """Prefix caching: prompt tokens looked up, found in the cache, and blocks evicted, since the last call."""

    def on_adapter_tokens(self, adapter: str, count: int, finished: bool) -> None:
        """LoRA: count tokens handed out to a sequence of this adapter, and whether the sequence ended."""

    def on_speculation(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: one round's draft tokens checked (positions the served model computed besides the
        row's own token, which on_decode counts), and of them kept."""
        self.computed_tokens += proposed

    def on_state(self, running: int, waiting: int, kv_bytes: int, prefix_cache_bytes: int = 0) -> None:
        pass

    def padding_waste(self) -> float:
        return self.padding_tokens / self.computed_tokens if self.computed_tokens else 0.0


def deliveries(events: Iterable[Event], observer: EngineObserver) -> Iterator[tuple[Callable, tuple]]:
    """The calls that deliver a step's events, in order: a sequence's tokens, its error, the cost metrics."""
    for event in events:
        match event:
            case NewTokens(seq, ids, finished, logprobs):
                yield send_tokens, (observer, seq, ids, finished, logprobs)
            case Failed(seq, error) if seq.on_error is not None:
                yield seq.on_error, (seq, error)
            case Prefilled(computed, padding):
                yield observer.on_prefill, (computed, padding)
            case Decoded(batch_size, dead_rows):
                yield observer.on_decode, (batch_size, dead_rows)
            case PrefixLookup(queried, hits, evicted):
                yield observer.on_prefix_lookup, (queried, hits, evicted)
            case Speculated(proposed, accepted):
                yield observer.on_speculation, (proposed, accepted)


def send_tokens(observer: EngineObserver, seq: Sequence, new: list[int], finished: bool, logprobs) -> None:
    """Hands the tokens out, then times them, so that TTFT and inter-token latency are measured when the response
    leaves (on the outbox thread), not when it was queued."""
    try:
        if seq.emit is not None:
            seq.emit(seq, new, finished, logprobs)
    finally:
        if new:
            now = time.monotonic()
            if seq.first_token_at is None:
                ttft, itl, seq.first_token_at = now - seq.arrival, None, now
            else:
                ttft, itl = None, (now - seq.last_token_at) / len(new)
            seq.last_token_at = now
            observer.on_tokens(len(new), ttft, itl)
        if seq.adapter is not None and (new or finished):
            observer.on_adapter_tokens(seq.adapter.name, len(new), finished)


class Engine:
    """decoder: any runtime of python_backend/runtime/ (the interface is in python_backend/runtime/decoder.py).
    Until start(), step() runs in place and delivers on the caller's thread."""

    def __init__(self, decoder, config: SchedulerConfig, observer: EngineObserver | None = None,
                 outbox_capacity: int = 4096, drafter=None):
        self.observer = observer or EngineObserver()
        self.outbox_capacity = outbox_capacity
        self._lock = threading.Condition()
        self.core = EngineCore(decoder, config, intake_lock=self._lock, drafter=drafter)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._outbox: Outbox | None = None  # set while running on a thread; else callbacks run in place
        self.last_progress = time.time()  # wall clock, read by the heartbeat

    # --- called from Triton's execute() threads ---

    def submit(self, sequence: Sequence) -> None:
        """Raises InvalidRequestError (can never fit the KV budget) or QueueFullError (the waiting queue is full)."""
        with self._lock:
            events = self.core.add(sequence)
            if not events:
                self._lock.notify()
        self._deliver(events)

    def cancel(self, key: str) -> None:
        with self._lock:
            self.core.cancel(key)
            self._lock.notify()

    def start(self) -> None:
        self._outbox = Outbox("llm-responses", capacity=self.outbox_capacity)
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict:
        """What the heartbeat reports: whether the loop runs, has work, and when it last made progress."""
        return {"engine_alive": self.alive, "has_work": self.core.has_work, "last_progress": self.last_progress}

    def stop(self) -> None:
        """Stops the loop; every request not finished yet gets a final error response."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                print("[engine] the engine thread did not stop within 10 s", file=sys.stderr)
                return
        with self._lock:
            events = self.core.abort(UnavailableError("the model is shutting down"))
        self._deliver(events)
        if self._outbox:
            self._outbox.close()

    # --- the engine thread ---

    def step(self) -> bool:
        """One step of the core, each event delivered as it happens; False when there was nothing to do yet."""
        out = StepOutput()
        self._deliver(self.core.stream(out))
        if out.error is None:
            self.last_progress = time.time()
        if (state := out.state) is not None:
            self._put(self.observer.on_state, state.running, state.waiting, state.kv_bytes, state.prefix_cache_bytes)
        return out.progressed

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.core.has_work:
                    self.last_progress = time.time()
                    self._lock.wait(timeout=1.0)
                if self._stopping:
                    return
            if not self.step():
                time.sleep(0.002)  # only static batching waits here, for its batch to fill or time out

    def _deliver(self, events: Iterable[Event]) -> None:
        for callback, args in deliveries(events, self.observer):
            self._put(callback, *args)

    def _put(self, callback: Callable, *args) -> None:
        if self._outbox is None:
            callback(*args)
        else:
            self._outbox.put(callback, *args)


def generate(decoder, sequences: list[Sequence], strategy: str = "dynamic") -> EngineObserver:
    """Runs these sequences to completion on the calling thread, as one group; returns the engine's totals."""
    config = SchedulerConfig(
        strategy=strategy,
        max_batch_size=len(sequences),
        static_batch_size=len(sequences),
        kv_budget_tokens=sum(s.reserved_tokens() for s in sequences) * len(sequences),
        kv_layout=getattr(decoder, "kv_layout", "padded"),
        max_context_length=max(s.reserved_tokens() for s in sequences),
        max_queue_size=len(sequences),
    )
    core, observer = EngineCore(decoder, config), EngineObserver()
    for seq in sequences:
        core.add(seq)
    while True:
        out = core.step()
        for callback, args in deliveries(out.events, observer):
            callback(*args)
        if (state := out.state) is not None:
            observer.on_state(state.running, state.waiting, state.kv_bytes, state.prefix_cache_bytes)
        if not out.progressed:
            return observer
