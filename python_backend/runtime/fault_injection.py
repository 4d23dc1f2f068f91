"""Faults on purpose, for tests against a real server: the llm model wraps its decoder in this when
``TRITON_LLM_INJECT_FAULT`` is set, e.g. ``prefill_token=7`` (a prefill whose prompts hold token 7 fails, as
onnxruntime fails a chunk on a bad input), ``decode_token=3681`` (a decode step that feeds token 3681 fails: an
error no single request can be blamed for), ``min_step_ms=20`` (no step, prefill or decode, ends sooner than 20 ms
after it began: a device no faster than that, so that a test's request of N tokens runs for at least N steps' time
on any machine), or several, comma-separated. Unset, nothing is wrapped."""

from __future__ import annotations

import os
import time

import numpy as np

FAULT_ENV = "TRITON_LLM_INJECT_FAULT"
KINDS = ("prefill_token", "decode_token", "min_step_ms")


class InjectedFault(RuntimeError):
    pass


class FaultyDecoder:
    """The real decoder, failing when a chosen token id is among a prefill's or a decode step's input ids, and each
    of its calls taking at least min_step_s."""

    def __init__(self, decoder, prefill_token: int | None = None, decode_token: int | None = None,
                 min_step_s: float = 0.0):
        self.decoder, self.prefill_token, self.decode_token = decoder, prefill_token, decode_token
        self.min_step_s = min_step_s
        self.cache_shape, self.vocab_size, self.tensors = decoder.cache_shape, decoder.vocab_size, decoder.tensors
        self.kv_layout = getattr(decoder, "kv_layout", "padded")
        self.scores_prompts = getattr(decoder, "scores_prompts", False)
        self.lora_targets = getattr(decoder, "lora_targets", {})
        self.prefill_tokens: list[int] = []  # real prompt tokens of each prefill call

    def empty_cache(self, batch_size: int):
        return self.decoder.empty_cache(batch_size)

    def forward(self, input_ids, attention_mask, position_ids, past, **options):
        started = time.monotonic()
        self._check(input_ids, attention_mask, prefill=past[0].shape[2] == 0)
        out = self.decoder.forward(input_ids, attention_mask, position_ids, past, **options)
        self._pace(started)
        return out

    def forward_in_place(self, input_ids, attention_mask, cache, **options):
        started = time.monotonic()
        self._check(input_ids, attention_mask, prefill=input_ids.shape[1] == attention_mask.shape[1])
        out = self.decoder.forward_in_place(input_ids, attention_mask, cache, **options)
        self._pace(started)
        return out

    def _check(self, input_ids, attention_mask, prefill: bool) -> None:
        if prefill:
            self.prefill_tokens.append(int(np.asarray(attention_mask).sum()))
        token = self.prefill_token if prefill else self.decode_token
        if token is not None and (np.asarray(input_ids) == token).any():
            raise InjectedFault(f"injected fault: a {'prefill' if prefill else 'decode step'} fed token {token}")

    def _pace(self, started: float) -> None:
        left = self.min_step_s - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)


def parse_spec(spec: str) -> dict:
    """FaultyDecoder's arguments from a spec: 'prefill_token=7,min_step_ms=20' -> {prefill_token: 7, min_step_s:
    0.02}."""
    arguments = {}
    for part in spec.split(","):
        kind, _, value = part.strip().partition("=")
        if kind not in KINDS or not value.isdigit():
            raise ValueError(f"{FAULT_ENV} must be comma-separated {'=<n>, '.join(KINDS)}=<n>, got {spec!r}")
        if kind == "min_step_ms":
            arguments["min_step_s"] = int(value) / 1000
        else:
            arguments[kind] = int(value)
    return arguments


def maybe_faulty(decoder, spec: str | None = None):
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    if not spec:
        return decoder
    arguments = parse_spec(spec)
    print(f"[llm] {FAULT_ENV}={spec}: faults are injected on purpose", flush=True)
    return FaultyDecoder(decoder, **arguments)
