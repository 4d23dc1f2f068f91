import pytest

from python_backend.engine.memory_planner import PRESETS, ModelShape, kv_bytes_per_token, plan


def test_llama_7b_kv_cache_is_half_a_mebibyte_per_token_in_fp16():
    assert kv_bytes_per_token(PRESETS["llama-7b"], "fp16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024


def test_llama_7b_on_an_a100_80gb():
    # 80 GB x 70% = 56 GB; minus 13.5 GB of fp16 weights = 42.5 GB; 1 GiB of KV per 2048-token sequence.
    at_2048 = plan(PRESETS["llama-7b"], 80e9, 0.7, 2048)
    assert at_2048.max_batch == int((56e9 - 6.74e9 * 2) // (512 * 1024 * 2048)) == 39
    assert plan(PRESETS["llama-7b"], 80e9, 0.8, 4096).max_batch == 23


def test_smollm2_preset_matches_the_exported_model(decoder, settings):
    shape = PRESETS["smollm2-135m"]
    assert kv_bytes_per_token(shape, "fp32") == decoder.cache_shape.bytes_per_token()
    from_config = ModelShape.from_hf_config(f"{settings['hf_dir']}/config.json")
    assert (from_config.num_layers, from_config.num_kv_heads, from_config.head_dim) == (30, 3, 64)
    assert from_config.num_parameters == pytest.approx(1.35e8, rel=0.02)


def test_bad_fraction_is_refused():
    with pytest.raises(ValueError, match="fraction"):
        plan(PRESETS["llama-7b"], 80e9, 1.5, 2048)
