"""The exact int4 variant's check before any work (scripts/prepare/source_grid.py): weights already on a 4-bit grid in
blocks of 32 pass (the served model's, dequantized from its Q4_1 GGUF), weights with more values in a block are refused
naming the matrices and the GGUF's tensor types."""

import json

import numpy as np
import torch
from safetensors.torch import save_file

from scripts.prepare.source_grid import gguf_tensor_types, off_grid_matrices, refusal


def on_grid(rows: int, cols: int, levels: int, rng) -> torch.Tensor:
    """A matrix whose every block of 32 holds at most `levels` values: min + scale * code, per block."""
    codes = rng.integers(0, levels, size=(rows * cols // 32, 32))
    scale, low = rng.uniform(0.01, 0.1, (len(codes), 1)), rng.uniform(-1, 0, (len(codes), 1))
    return torch.tensor((low + scale * codes).reshape(rows, cols), dtype=torch.float32)


def test_weights_on_a_4_bit_grid_pass_and_others_are_named(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"model.layers.0.self_attn.q_proj.weight": on_grid(64, 128, 16, rng),
               "model.layers.0.mlp.down_proj.weight": on_grid(128, 64, 16, rng),
               "model.embed_tokens.weight": torch.randn(100, 64),  # not a layer matrix: stays fp32, not checked
               "model.layers.0.input_layernorm.weight": torch.randn(64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert off_grid_matrices(tmp_path, 4, 32) == ([], 2)
    assert refusal(tmp_path, "", "int4", 4, 32) is None
    tensors["model.layers.1.mlp.up_proj.weight"] = on_grid(64, 128, 64, rng)  # a 6-bit grid (Q6_K)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    off, seen = off_grid_matrices(tmp_path, 4, 32)
    assert seen == 3 and [o.name for o in off] == ["model.layers.1.mlp.up_proj.weight"] and off[0].levels > 16
    assert "1 of 3 layer matrices" in refusal(tmp_path, "", "int4", 4, 32)


def test_the_served_models_weights_are_on_the_grid_and_its_gguf_types_are_read(model_dir):
    settings = json.loads((model_dir / "llm_settings.json").read_text())
    off, seen = off_grid_matrices(model_dir / "hf", 4, 32)
    assert seen == 30 * 7 and off == []
    types = gguf_tensor_types(settings["source"])
    assert types["Q4_1"] >= 30 * 6 and sum(types.values()) >= seen
