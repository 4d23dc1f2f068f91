"""The generation engine: a loop, on its own thread, that admits, prefills, decodes and retires sequences.

Each iteration: drop cancelled sequences, admit what the scheduler allows (one left-padded prefill, merged into the
running batch), run one decode step for the whole batch, hand out new tokens, and free the cache rows of finished
sequences. The Triton model only submits, cancels and turns emitted tokens into responses."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

import numpy as np

from python_backend.engine.kv_batch import KVBatch
from python_backend.engine.outbox import Outbox
from python_backend.engine.sampling import token_logprob
from python_backend.engine.scheduler import Scheduler, SchedulerConfig, padded_cache_bound
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError, UnavailableError


UNMATCHED_CANCEL_TTL_S = 60.0


Failures = list[tuple[Sequence, Exception]]


def choose_next(sequences: list[Sequence], logits: np.ndarray) -> tuple[np.ndarray, Failures]:
    """Picks (and appends) each sequence's next token from its row of last-position logits, with its
    log-probability when the sequence asks for them.

    A sequence whose choice fails (its own sampling settings, say) is returned with its error instead, so that
    only it fails; its row gets token 0, which nothing reads because the sequence leaves the batch."""
    tokens = np.zeros(len(sequences), np.int64)
    failed = []
    for row, seq in enumerate(sequences):
        try:
            tokens[row] = seq.chooser.choose(logits[row], seq.output_ids)
            logprob = token_logprob(logits[row], int(tokens[row]), seq.params.top_logprobs) \
                if seq.params.logprobs else None
        except Exception as error:  # noqa: BLE001 - isolated to this sequence
            failed.append((seq, error))
            continue
        seq.append(int(tokens[row]), logprob)
    return tokens, failed


# A padded position costs as much as a real one, and each extra chunk about as much as 14 positions (SmolLM2, 2 CPU
# cores): prefilling the benchmark's 32 prompts took 0.83 s at 10 %, 0.93 s at 25 % and 1.03 s with no padding.
PREFILL_MAX_PADDING = 0.10


def length_sorted_chunks(sequences: list[Sequence], max_padding: float = PREFILL_MAX_PADDING) -> list[list[Sequence]]:
    """Splits a prefill into chunks of similar prompt length, so that left padding stays under ``max_padding``
    of each chunk's computed positions."""
    chunks: list[list[Sequence]] = []
    for seq in sorted(sequences, key=lambda s: len(s.prompt_ids), reverse=True):
        if chunks:
            chunk = chunks[-1]
            longest = len(chunk[0].prompt_ids)
            real = sum(len(s.prompt_ids) for s in chunk) + len(seq.prompt_ids)
            if (len(chunk) + 1) * longest - real <= max_padding * (len(chunk) + 1) * longest:
                chunk.append(seq)
                continue
        chunks.append([seq])
    return chunks


class QueueFullError(UnavailableError):
    """The waiting queue is at its bound: the client should retry later (503 / UNAVAILABLE)."""


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

    def on_state(self, running: int, waiting: int, kv_bytes: int) -> None:
        pass

    def padding_waste(self) -> float:
        return self.padding_tokens / self.computed_tokens if self.computed_tokens else 0.0


class Engine:
    """decoder: any runtime of python_backend/runtime/ (the interface is in python_backend/runtime/decoder.py)."""

    def __init__(self, decoder, config: SchedulerConfig, observer: EngineObserver | None = None,
                 outbox_capacity: int = 4096):
        self.decoder = decoder
        self.config = config
        self.scheduler = Scheduler(config)
        self.observer = observer or EngineObserver()
        self.outbox_capacity = outbox_capacity
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not computed yet
        self.running: list[Sequence] = []
        self.batch: KVBatch | None = None
        self._next_tokens = np.zeros(0, np.int64)
        self._cancelled: dict[str, float] = {}  # key -> when the cancel arrived
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._outbox: Outbox | None = None  # set while running on a thread; else callbacks run in place
        self._reported_state: tuple[int, int, int] | None = None
        self.last_progress = time.time()  # wall clock, read by the heartbeat

    # --- called from Triton's execute() threads ---

    def submit(self, sequence: Sequence) -> None:
        need = padded_cache_bound([sequence], 0)
        if need > self.config.kv_budget_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens need {need} KV-cache slots, more than the budget of "
                f"{self.config.kv_budget_tokens}"
            )
        with self._lock:
            cancelled = self._cancelled.pop(sequence.key, None) is not None  # its client left before it got here
            if not cancelled:
                if len(self.waiting) >= self.config.max_queue_size:
                    raise QueueFullError(
                        f"the waiting queue is full ({self.config.max_queue_size} requests); retry later"
                    )
                self.waiting.append(sequence)
                self._lock.notify()
        if cancelled:
            sequence.finish_reason = "cancelled"
            self._emit(sequence)

    def cancel(self, key: str) -> None:
        with self._lock:
            self._cancelled[key] = time.monotonic()
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
        return {"engine_alive": self.alive, "has_work": bool(self.running or self.prefilling or self.waiting),
                "last_progress": self.last_progress}

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
            self.prefilling += list(self.waiting)
            self.waiting.clear()
        self._fail_all(UnavailableError("the model is shutting down"))
        if self._outbox:
            self._outbox.close()

    # --- the engine thread ---

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.running and not self.prefilling and not self.waiting:
                    self.last_progress = time.time()
                    self._lock.wait(timeout=1.0)
                if self._stopping:
                    return
            if not self.step():
                time.sleep(0.002)  # only static batching waits here, for its batch to fill or time out

    def _fail(self, seq: Sequence, error: Exception) -> None:
        if not seq.final_sent:
            seq.finish_reason, seq.final_sent = "error", True
            if seq.on_error is not None:
                self._deliver(seq.on_error, seq, error)

    def _fail_all(self, error: Exception) -> None:
        """An error that cannot be pinned on one request (a failed decode step): every request in the batch or
        being prefilled ends with it at once; waiting ones are untouched."""
        for seq in self.running + self.prefilling:
            self._fail(seq, error)
        self.batch, self.running, self.prefilling = None, [], []
        self._next_tokens = np.zeros(0, np.int64)

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do yet. An error that escapes the per-sequence
        handling (a failed decode step) fails the requests in the batch, and the engine goes on."""
        try:
            return self._step()
        except Exception as error:  # noqa: BLE001 - the loop must survive; the requests get the error
            print(f"[engine] step failed, failing {len(self.running) + len(self.prefilling)} requests: "
                  f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
            self._fail_all(error)
            return True

    def _step(self) -> bool:
        with self._lock:
            cancelled = self._apply_cancellations()
            busy = self.running + self.prefilling
            admitted = self.scheduler.admit(
                self.waiting, busy, self.batch.cache_len if self.batch else 0, time.monotonic()
            )
            self.prefilling += admitted
        for seq in cancelled:
            self._emit(seq)
        prefilled = self._take_prefill()
        self._prefill(prefilled)
        # A group (dynamic, static) decodes once all of it is prefilled; continuous decodes at every step.
        decoding = (self.config.strategy == "continuous" or not self.prefilling) and any(
            not s.finished for s in self.running)
        if decoding:
            self._decode()
        self._retire()
        self.last_progress = time.time()
        kv_bytes = self.batch.cache_bytes() if self.batch else 0
        state = (len(self.running), len(self.waiting) + len(self.prefilling), kv_bytes)
        if state != self._reported_state or prefilled or decoding:
            self._reported_state = state
            self._deliver(self.observer.on_state, *state)
        return bool(prefilled) or decoding or bool(cancelled)

    def _apply_cancellations(self) -> list[Sequence]:
        """Marks cancelled sequences (under the lock); returns them, to be answered outside it."""
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
        # A key that matched nothing either finished already or has not been submitted yet (a cancel can overtake
        # its request); keep it a while for submit() to find.
        for key in [k for k, at in self._cancelled.items() if now - at > UNMATCHED_CANCEL_TTL_S]:
            del self._cancelled[key]
        return cancelled

    def _take_prefill(self) -> list[Sequence]:
        """The admitted sequences to prefill in this step: at most max_prefill_tokens prompt tokens (at least one
        sequence), so that no strategy's step runs unbounded while cancellations and the decode wait."""
        taken, tokens = [], 0
        while self.prefilling:
            size = len(self.prefilling[0].prompt_ids)
            if taken and tokens + size > self.config.max_prefill_tokens:
                break
            taken.append(self.prefilling.pop(0))
            tokens += size
        return taken

    def _prefill(self, sequences: list[Sequence]) -> None:
        for chunk in length_sorted_chunks(sequences):
            try:
                self._prefill_chunk(chunk)
            except Exception as error:  # noqa: BLE001 - find the culprit: each sequence alone
                if len(chunk) == 1:
                    self._fail(chunk[0], error)
                    continue
                for seq in chunk:
                    try:
                        self._prefill_chunk([seq])
                    except Exception as single_error:  # noqa: BLE001
                        self._fail(seq, single_error)

    def _prefill_chunk(self, sequences: list[Sequence]) -> None:
        batch, logits, padding = KVBatch.prefill(self.decoder, [s.prompt_ids for s in sequences])
        self._deliver(self.observer.on_prefill, batch.size * batch.cache_len, padding)
        tokens, failed = choose_next(sequences, logits)
        for seq, error in failed:
            self._fail(seq, error)
        for seq in sequences:
            self._emit(seq)
        if self.batch is None:
            self.batch, self.running, self._next_tokens = batch, list(sequences), tokens
        else:
            self.batch.extend(batch)
            self.running += sequences
            self._next_tokens = np.concatenate([self._next_tokens, tokens])

    def _decode(self) -> None:
        logits = self.batch.step(self.decoder, self._next_tokens)
        live = [row for row, s in enumerate(self.running) if not s.finished]
        self._deliver(self.observer.on_decode, len(self.running), len(self.running) - len(live))
        chosen, failed = choose_next([self.running[r] for r in live], logits[live])
        for seq, error in failed:
            self._fail(seq, error)
        self._next_tokens[live] = chosen
        for row in live:
            self._emit(self.running[row])

    def _retire(self) -> None:
        """Frees the cache rows of finished sequences. Static batching keeps computing finished rows until the
        last row ends (only a cancelled or failed row leaves at once)."""
        if self.config.strategy == "static" and any(not s.finished for s in self.running):
            keep = [row for row, s in enumerate(self.running) if s.finish_reason not in ("cancelled", "error")]
        else:
            keep = [row for row, s in enumerate(self.running) if not s.finished]
        if len(keep) == len(self.running):
            return
        if not keep:
            self.batch, self.running, self._next_tokens = None, [], np.zeros(0, np.int64)
            return
        self.batch.select(keep)
        self.running = [self.running[r] for r in keep]
        self._next_tokens = self._next_tokens[keep]

    def _emit(self, seq: Sequence) -> None:
        if seq.final_sent:
            return
        new, logprobs = seq.take_emittable()
        seq.final_sent = seq.finished
        if new or seq.finished:
            self._deliver(self._send, seq, new, seq.finished, logprobs)

    def _send(self, seq: Sequence, new: list[int], finished: bool, logprobs) -> None:
        """Runs on the outbox thread: hands the tokens out, then times them, so TTFT and inter-token latency
        are measured when the response leaves, not when it was queued."""
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
                self.observer.on_tokens(len(new), ttft, itl)

    def _deliver(self, callback, *args) -> None:
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
        max_queue_size=len(sequences),
    )
    engine = Engine(decoder, config)
    for seq in sequences:
        engine.submit(seq)
    while engine.step():
        pass
    return engine.observer
