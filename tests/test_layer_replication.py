"""The export of a model whose layers are all alike traces two and copies the second's graph for the rest
(scripts/prepare/layer_replication.py): a model with layers of more than one kind, or too few, is traced whole, and
tracing two leaves the model as it was. That the copies compute what PyTorch does is checked on the tiny model's
export (test_tiny_model.py) and by every export's parity check."""

import pytest
import torch

from scripts.prepare import layer_replication
from scripts.prepare.traced_decoder import traced_layers


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_tracing_two_layers_leaves_the_model_and_its_config_as_they_were():
    model = tiny_llama(4)
    layers = model.model.layers
    with traced_layers(model, 2):
        assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2
        assert list(model.model.layers) == list(layers)[:2]
    assert model.model.layers is layers and len(layers) == 4 and model.config.num_hidden_layers == 4


def test_models_with_layers_of_more_than_one_kind_or_too_few_are_traced_whole():
    import transformers as tf

    assert layer_replication.replication_refusal(tf.LlamaConfig(num_hidden_layers=4)) is None
    assert "2 layers" in layer_replication.replication_refusal(tf.LlamaConfig(num_hidden_layers=2))
    gemma2 = tf.Gemma2Config(num_hidden_layers=4)  # sliding-window and full attention, alternating
    assert "layer_types: full_attention, sliding_attention" in layer_replication.replication_refusal(gemma2)
    qwen2 = tf.Qwen2Config(num_hidden_layers=4)  # a window it does not use: every layer full attention
    assert qwen2.layer_types == ["full_attention"] * 4 and layer_replication.replication_refusal(qwen2) is None
    no_rope = tf.LlamaConfig(num_hidden_layers=4)
    no_rope.no_rope_layers = [1, 1, 1, 0]  # Llama 4's: a layer without rotary embeddings
    assert "no_rope_layers" in layer_replication.replication_refusal(no_rope)
    state = {f"model.layers.{i}.mlp.weight": torch.zeros(2, 2) for i in range(3)}
    layer_replication.check_uniform(state, 3)
    state["model.layers.2.mlp.weight"] = torch.zeros(2, 3)  # a layer of another kind: not layer 1's weights
    with pytest.raises(layer_replication.NotReplicable, match="layer 2"):
        layer_replication.check_uniform(state, 3)
