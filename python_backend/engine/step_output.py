"""What one engine step did, as plain data, for the thread that runs the engine to deliver (loop.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_backend.engine.sampling import TokenLogprob
from python_backend.engine.sequence import Sequence


@dataclass
class NewTokens:
    """Tokens of one sequence to hand out (none when it ends without new ones); ``finished`` marks its last event."""
    seq: Sequence
    ids: list[int]
    finished: bool
    logprobs: list[TokenLogprob] | None  # one per id, when the sequence asks for them


@dataclass
class Failed:
    """A sequence that ends with this error; it gets no finished NewTokens."""
    seq: Sequence
    error: Exception


@dataclass
class Prefilled:
    """One prefill's cost: the positions it computed, and how many of them were left padding."""
    computed: int
    padding: int


@dataclass
class Decoded:
    """One decode step's cost: its rows, and how many of them were finished rows computed anyway (static's padding)."""
    batch_size: int
    dead_rows: int


@dataclass
class Speculated:
    """One speculative round of a lone row: the draft tokens the served model checked, and how many it kept."""
    proposed: int
    accepted: int


@dataclass
class PrefixLookup:
    """Prefix caching during one step: prompt tokens looked up, of them found in the cache, blocks evicted."""
    queried: int
    hits: int
    evicted_blocks: int


@dataclass(frozen=True)
class EngineState:
    running: int
    waiting: int  # admitted but not prefilled yet included
    kv_bytes: int
    prefix_cache_bytes: int = 0  # the prefix cache's blocks, apart from the running sequences' kv_bytes


Event = NewTokens | Failed | Prefilled | Decoded | PrefixLookup | Speculated


@dataclass
class StepOutput:
    events: list[Event] = field(default_factory=list)  # in the order they happened
    state: EngineState | None = None  # set when it changed, or the step prefilled or decoded
    progressed: bool = False  # False: nothing to do yet (static batching waits for its batch)
    error: Exception | None = None  # the step itself failed (a decode step, say): every sequence in it failed

    @property
    def new_tokens(self) -> list[NewTokens]:
        return [e for e in self.events if isinstance(e, NewTokens)]

    @property
    def finished(self) -> list[Sequence]:
        """Sequences that ended normally in this step (eos, stop, length or cancelled)."""
        return [e.seq for e in self.events if isinstance(e, NewTokens) and e.finished]

    @property
    def failed(self) -> list[Failed]:
        return [e for e in self.events if isinstance(e, Failed)]
