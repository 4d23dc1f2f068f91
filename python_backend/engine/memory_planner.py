"""How many sequences fit in a memory budget: KV-cache bytes per token, and the largest batch for a context length.

    KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element
    largest batch      = (memory x fraction - weights) // (KV bytes per token x context length)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: float

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelShape":
        config = json.loads(Path(path).read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
        intermediate = config.get("intermediate_size", 4 * hidden)
        kv_heads = config.get("num_key_value_heads", heads)
        # Llama-style parameter count: attention + gated MLP per layer, embeddings (+ LM head unless tied).
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        per_layer = attention + 3 * hidden * intermediate + 2 * hidden
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
        return cls(Path(path).parent.name, layers, kv_heads, head_dim, layers * per_layer + embeddings + hidden)


PRESETS = {
    "llama-7b": ModelShape("LLaMA-7B", num_layers=32, num_kv_heads=32, head_dim=128, num_parameters=6.74e9),
    "smollm2-135m": ModelShape("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, num_parameters=1.35e8),
}


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "fp16") -> float:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[kv_dtype]


@dataclass(frozen=True)
class Plan:
    weights_bytes: float
    kv_budget_bytes: float
    kv_bytes_per_sequence: float
    max_batch: int


def plan(shape: ModelShape, memory_bytes: float, fraction: float, context_len: int,
         weight_dtype: str = "fp16", kv_dtype: str = "fp16") -> Plan:
    """The largest batch whose weights plus full-context KV caches fit in ``fraction`` of ``memory_bytes``.
    Activations and the runtime's workspace are not counted: that is what the remaining fraction is for."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    weights = shape.num_parameters * DTYPE_BYTES[weight_dtype]
    budget = memory_bytes * fraction - weights
    per_sequence = kv_bytes_per_token(shape, kv_dtype) * context_len
    return Plan(weights, budget, per_sequence, max(0, int(budget // per_sequence)))
