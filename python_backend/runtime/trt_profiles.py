"""TensorRT optimization profiles for the exported decoder, derived from the `llm` model's limits.

A TensorRT engine built from an ONNX graph with dynamic axes needs, for every dynamic input, a (min, opt, max)
shape per optimization profile. The decoder's inputs (python_backend/runtime/onnx_decoder.py) have three dynamic sizes:
batch, new tokens in this call, and tokens already in the cache (past). Their bounds come from the `llm` config:
batch 1..max_batch_size, new tokens 1..max_prefill_tokens, past 0..max_context_length - 1, and past + new at most
max_context_length. Two profiles share those bounds and differ in their `opt` shapes, for which TensorRT tunes its
kernels: a decode step (every row one new token, a full batch, a half-full cache) and a typical prefill (a few
prompts of a typical length, empty cache).

Plain code with unit tests (tests/test_trt_profiles.py): nothing here needs TensorRT. The engine build that uses it
is the GPU issue's, not written yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderLimits:
    max_batch_size: int
    max_prefill_tokens: int
    max_context_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    typical_prompt_tokens: int = 64
    typical_prefill_batch: int = 4

    def __post_init__(self):
        if min(self.max_batch_size, self.max_prefill_tokens, self.max_context_length) < 1:
            raise ValueError("max_batch_size, max_prefill_tokens and max_context_length must be at least 1")
        if self.max_prefill_tokens > self.max_context_length:
            raise ValueError(f"max_prefill_tokens {self.max_prefill_tokens} exceeds max_context_length "
                             f"{self.max_context_length}")


Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape


@dataclass(frozen=True)
class Point:
    """One (batch, new tokens, past tokens) point of the decoder's dynamic sizes."""

    batch: int
    new: int
    past: int


def _shapes(limits: DecoderLimits, point: Point) -> dict[str, Shape]:
    token_shape = (point.batch, point.new)
    cache_shape = (point.batch, limits.num_kv_heads, point.past, limits.head_dim)
    shapes = {"input_ids": token_shape, "attention_mask": (point.batch, point.past + point.new),
              "position_ids": token_shape, "logits_positions": (1,)}  # the last position: scoring is CPU-only
    for layer in range(limits.num_layers):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{layer}.{kind}"] = cache_shape
    return shapes


def _profile(limits: DecoderLimits, opt: Point) -> dict[str, ShapeRange]:
    smallest = Point(batch=1, new=1, past=0)
    # The attention mask spans past + new, which never exceeds the context; past alone reaches context - 1 (decode).
    largest = Point(batch=limits.max_batch_size, new=limits.max_prefill_tokens, past=limits.max_context_length - 1)
    low, best, high = _shapes(limits, smallest), _shapes(limits, opt), _shapes(limits, largest)
    high["attention_mask"] = (limits.max_batch_size, limits.max_context_length)
    return {name: ShapeRange(low[name], best[name], high[name]) for name in low}


def decode_point(limits: DecoderLimits) -> Point:
    return Point(batch=limits.max_batch_size, new=1, past=limits.max_context_length // 2)


def prefill_point(limits: DecoderLimits) -> Point:
    return Point(batch=min(limits.typical_prefill_batch, limits.max_batch_size),
                 new=min(limits.typical_prompt_tokens, limits.max_prefill_tokens), past=0)


def optimization_profiles(limits: DecoderLimits) -> list[dict[str, ShapeRange]]:
    """[decode profile, prefill profile], each input name -> (min, opt, max)."""
    return [_profile(limits, decode_point(limits)), _profile(limits, prefill_point(limits))]
