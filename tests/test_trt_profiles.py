"""TensorRT optimization profiles from the llm model's limits (python_backend/runtime/trt_profiles.py): every decoder input
of the real export has a range in each profile, every range holds its opt shape and the config's limits, and the
two profiles are tuned for a decode step and a prefill."""

from __future__ import annotations

import pytest

from python_backend.runtime.trt_profiles import DecoderLimits, decode_point, optimization_profiles, prefill_point
from tests.helpers import config_limits_from_text


def config_limits(decoder) -> DecoderLimits:
    """The config's limits (read with a regex) and the real export's cache dims."""
    config, shape = config_limits_from_text(), decoder.cache_shape
    return DecoderLimits(max_batch_size=config.max_batch_size, max_prefill_tokens=config.max_prefill_tokens,
                         max_context_length=config.max_context_length, num_layers=shape.num_layers,
                         num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def test_every_input_of_the_export_has_a_range_in_each_profile(decoder):
    names = {i.name for i in decoder.session.get_inputs()}
    for profile in optimization_profiles(config_limits(decoder)):
        assert set(profile) == names


def test_ranges_hold_their_opt_shapes_and_the_configs_limits(decoder):
    limits = config_limits(decoder)
    for profile in optimization_profiles(limits):
        for name, shapes in profile.items():
            assert all(lo <= opt <= hi for lo, opt, hi in zip(shapes.min, shapes.opt, shapes.max)), name
        assert profile["input_ids"].min == (1, 1)
        assert profile["input_ids"].max == (limits.max_batch_size, limits.max_prefill_tokens)
        assert profile["attention_mask"].max == (limits.max_batch_size, limits.max_context_length)
        cache = profile["past_key_values.0.key"]
        assert cache.min[2] == 0 and cache.max[2] == limits.max_context_length - 1
        assert cache.max[1::2] == (limits.num_kv_heads, limits.head_dim)


def test_one_profile_is_tuned_for_a_decode_step_and_one_for_a_prefill(decoder):
    limits = config_limits(decoder)
    decode, prefill = optimization_profiles(limits)
    assert decode["input_ids"].opt == (limits.max_batch_size, 1)
    assert decode["attention_mask"].opt == (limits.max_batch_size, decode_point(limits).past + 1)
    assert prefill["past_key_values.0.value"].opt[2] == 0
    assert prefill["input_ids"].opt == (prefill_point(limits).batch, prefill_point(limits).new)


def test_impossible_limits_are_refused():
    with pytest.raises(ValueError, match="exceeds max_context_length"):
        DecoderLimits(max_batch_size=8, max_prefill_tokens=4096, max_context_length=2048, num_layers=1,
                      num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="at least 1"):
        DecoderLimits(max_batch_size=0, max_prefill_tokens=1, max_context_length=8, num_layers=1, num_kv_heads=1,
                      head_dim=8)
