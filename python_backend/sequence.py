"""One generation request as it flows through the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_backend.sampling import SamplingParams, TokenChooser


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop" or "length"
    chooser: TokenChooser = field(init=False, repr=False)

    def __post_init__(self):
        self.chooser = TokenChooser(self.params)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        """Adds a generated token and decides whether the sequence is done.

        EOS and stop sequences are not part of the output."""
        if token in self.params.end_ids:
            self.finish_reason = "eos"
            return
        self.output_ids.append(token)
        for stop in self.params.stop_token_sequences:
            if stop and self.output_ids[-len(stop):] == list(stop):
                del self.output_ids[-len(stop):]
                self.finish_reason = "stop"
                return
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
