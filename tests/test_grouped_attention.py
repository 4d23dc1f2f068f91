"""The export's grouped-query attention against transformers' own eager attention (which repeats KV heads)."""

import types

import pytest
import torch


@pytest.mark.parametrize("q_len, past", [(1, 37), (6, 0), (4, 9)])
def test_matches_eager_attention_with_padding_and_causal_mask(q_len, past):
    from transformers.models.llama.modeling_llama import eager_attention_forward  # here: every worker collects it

    from scripts.prepare.grouped_attention import grouped_query_attention

    torch.manual_seed(q_len)
    batch, heads, kv_heads, head_dim = 3, 9, 3, 16
    kv_len = past + q_len
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    query = torch.randn(batch, heads, q_len, head_dim)
    key, value = torch.randn(batch, kv_heads, kv_len, head_dim), torch.randn(batch, kv_heads, kv_len, head_dim)
    # Additive mask: causal, plus left padding of different widths per row.
    mask = torch.zeros(batch, 1, q_len, kv_len)
    mask[:, :, torch.arange(q_len)[:, None] + past < torch.arange(kv_len)[None, :]] = torch.finfo(torch.float32).min
    for row, pad in enumerate((0, 2, 5)):
        mask[row, :, :, :pad] = torch.finfo(torch.float32).min

    expected, expected_probs = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, probs = grouped_query_attention(module, query, key, value, mask, scaling=0.25)

    assert got.shape == expected.shape == (batch, q_len, heads, head_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)
