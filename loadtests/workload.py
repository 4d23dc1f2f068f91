"""The load tests' workload: prompts from a JSONL file and a max_tokens distribution, as ensemble inputs or as the same
request to an OpenAI-compatible chat endpoint. No Locust import here, so the sweep, the perf_analyzer input writer
and the tests share it."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[str]:
    prompts = [json.loads(line)["text_input"] for line in Path(path).read_text(encoding="utf-8").splitlines()
               if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


@dataclass(frozen=True)
class MaxTokens:
    """A max_tokens distribution: ``choice:16,32,64`` (uniform over the values), ``uniform:16:128`` (integers in
    [16, 128]) or ``fixed:64``."""

    kind: str
    values: tuple[int, ...]

    @classmethod
    def parse(cls, spec: str) -> "MaxTokens":
        kind, _, rest = spec.partition(":")
        try:
            values = tuple(int(v) for v in rest.replace(":", ",").split(",") if v)
        except ValueError:
            raise ValueError(f"bad max_tokens distribution {spec!r}") from None
        expected = {"choice": None, "uniform": 2, "fixed": 1}
        if kind not in expected or not values or (expected[kind] and len(values) != expected[kind]) \
                or min(values) < 1:
            raise ValueError(f"bad max_tokens distribution {spec!r}: use choice:16,32,64 | uniform:16:128 | fixed:64")
        return cls(kind, values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.values[0], self.values[1])
        return rng.choice(self.values)

    def mean(self) -> float:
        return sum(self.values) / len(self.values)


class Workload:
    def __init__(self, prompts: list[str], max_tokens: MaxTokens, seed: int | None = None,
                 apply_chat_template: bool = True):
        self.prompts, self.max_tokens = prompts, max_tokens
        self.apply_chat_template = apply_chat_template
        self.rng = random.Random(seed)

    def next_request(self) -> dict:
        """Ensemble inputs. apply_chat_template is always sent: the ensemble's default is the raw prompt."""
        return {"text_input": self.rng.choice(self.prompts), "max_tokens": self.max_tokens.sample(self.rng),
                "apply_chat_template": self.apply_chat_template}


def chat_request(request: dict, model: str) -> dict:
    """The same request as a streamed POST /v1/chat/completions body (the chat API always applies the template).
    Greedy, as the ensemble is by default: OpenAI's default temperature is 1."""
    return {"model": model, "messages": [{"role": "user", "content": request["text_input"]}],
            "max_tokens": request["max_tokens"], "temperature": request.get("temperature", 0.0),
            "stream": True, "stream_options": {"include_usage": True}}
