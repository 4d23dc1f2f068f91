"""Faults on purpose, for tests against a real server: the llm model wraps its decoder in this when
``TRITON_LLM_INJECT_FAULT`` is set, e.g. ``prefill_token=7`` (a prefill whose prompts hold token 7 fails, as
onnxruntime fails a chunk on a bad input), ``decode_token=3681`` (a decode step that feeds token 3681 fails: an
error no single request can be blamed for), or both, comma-separated. Unset, nothing is wrapped."""

from __future__ import annotations

import os

import numpy as np

FAULT_ENV = "TRITON_LLM_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


class FaultyDecoder:
    """The real decoder, failing when a chosen token id is among a prefill's or a decode step's input ids."""

    def __init__(self, decoder, prefill_token: int | None = None, decode_token: int | None = None):
        self.decoder, self.prefill_token, self.decode_token = decoder, prefill_token, decode_token
        self.cache_shape, self.vocab_size, self.tensors = decoder.cache_shape, decoder.vocab_size, decoder.tensors
        self.kv_layout = getattr(decoder, "kv_layout", "padded")
        self.scores_prompts = getattr(decoder, "scores_prompts", False)
        self.lora_targets = getattr(decoder, "lora_targets", {})
        self.prefill_tokens: list[int] = []  # real prompt tokens of each prefill call

    def empty_cache(self, batch_size: int):
        return self.decoder.empty_cache(batch_size)

    def forward(self, input_ids, attention_mask, position_ids, past, **options):
        self._check(input_ids, attention_mask, prefill=past[0].shape[2] == 0)
        return self.decoder.forward(input_ids, attention_mask, position_ids, past, **options)

    def forward_in_place(self, input_ids, attention_mask, cache, **options):
        self._check(input_ids, attention_mask, prefill=input_ids.shape[1] == attention_mask.shape[1])
        return self.decoder.forward_in_place(input_ids, attention_mask, cache, **options)

    def _check(self, input_ids, attention_mask, prefill: bool) -> None:
        if prefill:
            self.prefill_tokens.append(int(np.asarray(attention_mask).sum()))
        token = self.prefill_token if prefill else self.decode_token
        if token is not None and (np.asarray(input_ids) == token).any():
            raise InjectedFault(f"injected fault: a {'prefill' if prefill else 'decode step'} fed token {token}")


def maybe_faulty(decoder, spec: str | None = None):
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    if not spec:
        return decoder
    tokens = {}
    for part in spec.split(","):
        kind, _, token = part.strip().partition("=")
        if kind not in ("prefill_token", "decode_token") or not token.isdigit():
            raise ValueError(f"{FAULT_ENV} must be prefill_token=<id> and/or decode_token=<id>, got {spec!r}")
        tokens[kind] = int(token)
    print(f"[llm] {FAULT_ENV}={spec}: faults are injected on purpose", flush=True)
    return FaultyDecoder(decoder, **tokens)
