"""Grouped-query attention that never copies the KV cache per query head, for export.

transformers' eager attention repeats each key/value head for every query head that shares it (``repeat_kv``:
an Expand plus a reshape). Exported to ONNX that is a full copy of the cache, per layer, per step: with
SmolLM2's 9 query heads over 3 KV heads it was a fifth to a third of a decode step on CPU (onnxruntime profile,
batch 8-32, past 200-256). Here the query heads of a group are stacked instead, so one matmul per KV head serves
the whole group and the cache is read in place. Same math, same results (the export's parity check holds).

Registered as the attention implementation ``grouped_eager`` (with eager's additive mask).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

NAME = "grouped_eager"


def grouped_query_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query [batch, heads, q_len, head_dim]; key/value [batch, kv_heads, kv_len, head_dim]; attention_mask
    additive, [batch, 1, q_len, >= kv_len]. Returns ([batch, q_len, heads, head_dim], probabilities)."""
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError(f"{NAME} attention has no attention sinks")
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # Query head h uses KV head h // groups (repeat_kv's order), so a plain reshape groups them.
    stacked = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    scores = torch.matmul(stacked, key.transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:  # Gemma 2: scores squashed into (-softcap, softcap) before the mask, as its eager does
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, kv_heads, groups, q_len, kv_len)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :kv_len]
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs.view(batch, kv_heads, groups * q_len, kv_len), value)
    out = out.view(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()
    return out, probs.view(batch, heads, q_len, kv_len)


def register() -> str:
    AttentionInterface.register(NAME, grouped_query_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    return NAME
