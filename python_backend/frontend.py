"""What the user-facing models (`ensemble`, `ensemble_unary`) do with the llm model's token stream: incremental
detokenization, streaming or one final answer, and cancellation that reaches the llm model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from python_backend.detokenizer import Decode, IncrementalDetokenizer

# The ensemble's inputs, passed on to preprocessing as they came.
USER_INPUTS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty",
               "end_id", "apply_chat_template", "stop_words")


@dataclass
class Delta:
    text: str
    token_count: int
    finished: bool


def text_deltas(
    chunks: Iterable[tuple[list[int], bool]],
    decode: Decode,
    stream: bool,
    is_cancelled: Callable[[], bool] = lambda: False,
    cancel: Callable[[], None] = lambda: None,
) -> Iterator[Delta]:
    """Turns (new token ids, finished) chunks into text.

    stream: one Delta per chunk that completes some text (and always a final one); otherwise one final Delta.
    When ``is_cancelled()`` turns true, ``cancel()`` is called once and nothing more is yielded; the remaining
    chunks are still consumed, so the llm model's stream ends cleanly."""
    detokenizer = IncrementalDetokenizer(decode)
    pieces: list[str] = []
    pending_tokens = 0
    cancelled = False
    for ids, finished in chunks:
        if not cancelled and is_cancelled():
            cancel()
            cancelled = True
        if cancelled:
            continue
        text = detokenizer.push(list(ids)) + (detokenizer.flush() if finished else "")
        pending_tokens += len(ids)
        if stream:
            if text or finished:
                yield Delta(text, pending_tokens, finished)
                pending_tokens = 0
        else:
            pieces.append(text)
            if finished:
                yield Delta("".join(pieces), pending_tokens, True)
        if finished:
            return
