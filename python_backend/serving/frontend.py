"""What the user-facing models (`ensemble`, `ensemble_unary`) do with the llm model's token stream: incremental
detokenization, stop strings matched on the generated text, streaming or one final answer, and cancellation that
reaches the llm model."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from python_backend.serving.detokenizer import Decode, IncrementalDetokenizer
from python_backend.serving.periodic import Periodic
from python_backend.serving.preprocessing import PreparedRequest

class LlmChunk(NamedTuple):
    """One response of the llm model: new token ids, whether it is the last, and, when asked for, per token its
    log-probability and the most likely tokens' (ids and values, one row per token)."""
    ids: list[int]
    finished: bool
    finish_reason: str | None = None  # the llm's: "eos", "stop", "length", "cancelled"
    logprobs: list[float] | None = None
    top_logprobs: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None
    prompt_scores: dict[str, np.ndarray] | None = None  # the first response of a prompt scored: the llm's arrays


@dataclass
class Delta:
    text: str
    finished: bool
    ids: list[int] = field(default_factory=list)  # the tokens behind this text
    finish_reason: str | None = None  # on the final Delta: "stop" (EOS, stop string or sequence) or "length"
    logprobs: list[float] = field(default_factory=list)  # per token in ids, when the llm sent them
    top_logprobs: list[list[float]] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    prompt_scores: dict[str, np.ndarray] | None = None  # prompt_log_probs (and its top arrays), when asked for

    @property
    def token_count(self) -> int:
        return len(self.ids)

    def add(self, chunk: LlmChunk) -> None:
        self.ids += chunk.ids
        self.logprobs += chunk.logprobs or []
        self.top_logprobs += chunk.top_logprobs or []
        self.top_ids += chunk.top_ids or []
        if chunk.prompt_scores is not None:
            self.prompt_scores = chunk.prompt_scores


class StopStrings:
    """Cuts the generated text just before the first occurrence of any stop string, wherever the token boundaries
    fall. Text that could still turn out to begin a stop string (the longest suffix that is a prefix of one) is
    held back until the next text decides it, so nothing sent ever has to be taken back."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Adds generated text; returns (the text now safe to send, whether a stop string was found). After a
        match the text returned ends just before the stop string, and nothing more should be pushed."""
        self.held += text
        match = self._first_match()
        if match is not None:
            ready, self.held = self.held[:match], ""
            return ready, True
        cut = len(self.held) - self._longest_partial_match()
        ready, self.held = self.held[:cut], self.held[cut:]
        return ready, False

    def flush(self) -> str:
        """The held-back text, for the end of a generation that found no stop string."""
        held, self.held = self.held, ""
        return held

    def _first_match(self) -> int | None:
        found = [at for at in (self.held.find(s) for s in self.stop) if at >= 0]
        return min(found, default=None)

    def _longest_partial_match(self) -> int:
        longest = max((len(s) for s in self.stop), default=0)
        for length in range(min(len(self.held), longest - 1), 0, -1):
            suffix = self.held[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0


def text_deltas(
    chunks: Iterable[LlmChunk | tuple[list[int], bool]],
    decode: Decode,
    stream: bool,
    is_cancelled: Callable[[], bool] = lambda: False,
    cancel: Callable[[], None] = lambda: None,
    stop: Sequence[str] = (),
) -> Iterator[Delta]:
    """Turns the llm's chunks (or plain (new token ids, finished) pairs) into text, ended before the first stop
    string.

    stream: one Delta per chunk that completes some text (and always a final one); otherwise one final Delta.
    A Delta carries the tokens consumed since the previous one (with their log-probabilities, if any).
    When a stop string appears before the llm model has finished, ``cancel()`` is called once, then the final
    Delta is yielded. When ``is_cancelled()`` turns true, ``cancel()`` is called once and nothing more is yielded.
    Either way the remaining chunks are still consumed, so the llm model's stream ends cleanly."""
    detokenizer = IncrementalDetokenizer(decode)
    stops = StopStrings(stop)
    pieces: list[str] = []  # text not yet yielded
    pending = Delta("", False)  # the tokens behind it
    answering = True  # false once the answer is complete or its client went away: the rest is only drained
    for whole in chunks:
        whole = LlmChunk(*whole)
        if answering and is_cancelled():
            cancel()
            answering = False
        # With stop strings, a chunk of several tokens (speculative decoding's) is read token by token, so that the
        # answer ends at the token that completed the match, with the count and log-probabilities of those tokens.
        for chunk in (_token_by_token(whole) if stops.stop and len(whole.ids) > 1 else (whole,)):
            if not answering:
                break
            pending.add(chunk)
            text, stopped = _sendable_text(detokenizer, stops, chunk.ids, chunk.finished)
            pieces.append(text)
            if stopped and not whole.finished:
                cancel()
            if stopped or chunk.finished:
                pending.text, pending.finished = "".join(pieces), True
                pending.finish_reason = "length" if chunk.finish_reason == "length" and not stopped else "stop"
                yield pending
                answering = False
            elif stream and text:
                pending.text = "".join(pieces)
                yield pending
                pieces, pending = [], Delta("", False)
        if whole.finished:
            return


def _token_by_token(chunk: LlmChunk) -> Iterator[LlmChunk]:
    """The chunk as one chunk per token, the last one finishing it; the prompt's scores come with the first."""
    last = len(chunk.ids) - 1

    def row(values, i):
        return None if values is None else values[i:i + 1]

    for i, token in enumerate(chunk.ids):
        yield LlmChunk([token], chunk.finished and i == last, chunk.finish_reason if i == last else None,
                       row(chunk.logprobs, i), row(chunk.top_logprobs, i), row(chunk.top_ids, i),
                       chunk.prompt_scores if i == 0 else None)


def response_outputs(delta: Delta, request: PreparedRequest, first: bool) -> dict[str, np.ndarray]:
    """The ensemble's output tensors (with their batch dimension) for one Delta: text_output always, the rest
    when the request asked for it (TensorRT-LLM's names: num_input_tokens, num_output_tokens, output_log_probs)."""
    text = (request.echo if first else "") + delta.text
    outputs = {"text_output": np.array([[text.encode("utf-8")]], np.object_)}
    if delta.finished:
        outputs["finish_reason"] = np.array([[delta.finish_reason.encode()]], np.object_)
    if request.return_num_input_tokens:
        outputs["num_input_tokens"] = np.array([[request.prompt_tokens]], np.uint32)
    if request.return_num_output_tokens:
        outputs["num_output_tokens"] = np.array([[delta.token_count]], np.uint32)
    if request.return_log_probs:
        outputs["output_ids"] = np.array([delta.ids], np.int32).reshape(1, -1)
        outputs["output_log_probs"] = np.array([delta.logprobs], np.float32).reshape(1, -1)
    if request.num_top_log_probs:
        shape = (1, delta.token_count, request.num_top_log_probs)
        outputs["top_log_probs"] = np.array(delta.top_logprobs, np.float32).reshape(shape)
        outputs["top_log_prob_ids"] = np.array(delta.top_ids, np.int32).reshape(shape)
    if delta.prompt_scores is not None:
        outputs.update({name: value[None] for name, value in delta.prompt_scores.items()})
    return outputs


def _sendable_text(detokenizer: IncrementalDetokenizer, stops: StopStrings, ids: list[int], finished: bool):
    """(the chunk's text that can be sent now, whether it ended at a stop string)."""
    text, stopped = stops.push(detokenizer.push(list(ids)) + (detokenizer.flush() if finished else ""))
    if finished and not stopped:
        text += stops.flush()
    return text, stopped


class CancellationWatch:
    """Tells the llm model about clients that went away while their request still waits in its queue: such a
    request gets no token, so the per-token check in ``text_deltas`` cannot see it. Once a request has started
    streaming, that per-token check takes over and the watch stops asking (each ask is a round trip to the
    server). Each key is cancelled at most once."""

    def __init__(self, send_cancel: Callable[[str], None], interval_s: float = 0.1):
        self.send_cancel, self.interval_s = send_cancel, interval_s
        self._active: set[str] = set()  # cancellable, not yet cancelled
        self._waiting: dict[str, Callable[[], bool]] = {}  # polled: no token yet
        self._lock = threading.Lock()
        self._poller = Periodic("cancellation-watch", interval_s, self.poll)

    def add(self, key: str, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._active.add(key)
            self._waiting[key] = is_cancelled

    def started(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def remove(self, key: str) -> None:
        """Call before the request's final response: a sender must not be asked anything after it."""
        with self._lock:  # waits for a poll in progress, which may be asking this key's sender
            self._active.discard(key)
            self._waiting.pop(key, None)

    def cancel(self, key: str) -> None:
        with self._lock:
            if key not in self._active:
                return
            self._active.discard(key)
            self._waiting.pop(key, None)
        self.send_cancel(key)

    def poll(self) -> None:
        with self._lock:
            gone = [key for key, is_cancelled in self._waiting.items() if is_cancelled()]
            for key in gone:
                self._active.discard(key)
                del self._waiting[key]
        for key in gone:
            self.send_cancel(key)

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()
