"""One generation request as it flows through the engine."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from python_backend.engine.sampling import SamplingParams, TokenChooser, TokenLogprob

# emit(sequence, new_token_ids, finished, their log-probabilities or None): called (from the engine's outbox thread)
# whenever a sequence has tokens to hand out.
Emit = Callable[["Sequence", list[int], bool, "list[TokenLogprob] | None"], None]


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    # Unguessable (128 bits): a cancel request names its sequence by key, so a client must not guess another's.
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    emit: Emit | None = field(default=None, repr=False)
    on_error: Callable[["Sequence", Exception], None] | None = field(default=None, repr=False)
    # Polled once per step: lets a direct (non-ensemble) client's cancelled stream free the sequence.
    is_cancelled: Callable[[], bool] | None = field(default=None, repr=False)
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str = ""  # prefix caching: cached prompt prefixes are shared only under the same salt
    # Lower runs earlier (vLLM's convention): waiting sequences are admitted by (priority, arrival). Live requests
    # have 0; batch jobs send a positive one, and rows are kept free of them (SchedulerConfig.priority_reserved_slots).
    priority: int = 0
    # Guided decoding: masks this sequence's logits at each step and ends it when its grammar is complete
    # (python_backend/guided/guide.py); None when unconstrained.
    guide: object | None = field(default=None, repr=False)
    # LoRA: the adapter this sequence runs with (python_backend/lora.py's Adapter); None for the base model.
    adapter: object | None = field(default=None, repr=False)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, when params.logprobs
    # With params.prompt_logprobs, after the prefill: one per prompt token, None for the first (nothing before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None  # "eos", "stop", "length", "cancelled" or "error"
    emitted: int = 0  # how many output ids were already handed out
    final_sent: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    chooser: TokenChooser = field(init=False, repr=False)

    @property
    def prefix_salt(self) -> str:
        """What the prefix cache keys this prompt's blocks by besides its tokens: its salt, and its adapter (each load
        of one: a name loaded again with other weights shares nothing), whose keys and values differ from the
        base's."""
        return self.cache_salt if self.adapter is None else f"{self.cache_salt}\x00lora:{self.adapter.key}"

    def __post_init__(self):
        self.chooser = TokenChooser(self.params, self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def reserved_tokens(self) -> int:
        """Cache slots this sequence may still need: its prompt plus every token it may yet generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    def remaining_tokens(self) -> int:
        return 0 if self.finished else self.params.max_tokens - len(self.output_ids)

    def append(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Adds a generated token (and its log-probability, if asked for) and decides whether the sequence is done.

        EOS and stop sequences are not part of the output."""
        if token in self.params.end_ids:
            self.finish_reason = "eos"
            return
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        for stop in self.params.stop_token_sequences:
            if stop and self.output_ids[-len(stop):] == list(stop):
                del self.output_ids[-len(stop):]
                del self.logprobs[len(self.output_ids):]
                self.finish_reason = "stop"
                return
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"

    def take_emittable(self) -> tuple[list[int], list[TokenLogprob] | None]:
        """Output ids not yet handed out (and their log-probabilities, if asked for), holding back a tail that may
        still turn into a stop sequence."""
        start, end = self.emitted, len(self.output_ids)
        if not self.finished:
            end -= self._stop_prefix_len()
        new = self.output_ids[start:end]
        self.emitted = max(self.emitted, end)
        return new, (self.logprobs[start:start + len(new)] if self.params.logprobs else None)

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's scores the first time they are asked for (with the sequence's first tokens), else None."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def _stop_prefix_len(self) -> int:
        longest = 0
        for stop in self.params.stop_token_sequences:
            for size in range(min(len(stop) - 1, len(self.output_ids)), longest, -1):
                if self.output_ids[-size:] == list(stop[:size]):
                    longest = size
                    break
        return longest
