"""What the export traces: a transformers causal LM wrapped so that its KV cache is flat inputs and outputs, one pair
of tensors per layer (past_key_values.N.key/value in, present.N.key/value out), and the logits only of the positions
asked for; and the trace itself, torch.onnx.export(dynamo=True), its graph optimized as torch.onnx.export would but
for one rewrite (optimize_graph). scripts/prepare/export_onnx.py checks its parity."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from scripts.prepare import layer_replication


class DecoderWithCache(torch.nn.Module):
    """forward(input_ids, attention_mask, position_ids, logits_positions, k0, v0, k1, v1, ...) -> (logits of the
    new positions listed in logits_positions, k0', v0', ...)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, logits_positions, *past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        # Only the positions asked for go through the LM head: the last one to generate ([new - 1]: rows are
        # left-padded), every one to score a prompt. Full-sequence logits of every prefill (batch x length x 49k
        # vocab) would cost more than the prefill itself.
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=True, logits_to_keep=logits_positions,
        )
        present = []
        for layer in out.cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


# torch's cache of fake-tensor dispatches, off while tracing: with dynamic shapes each hit rebuilds its outputs'
# symbolic sizes and strides, which costs more than the dispatch it saves. SmolLM2's trace took 131 s and 132 s
# without it, 175 s and 159 s with it (alternating, 2-core machine, 2026-12-07), and wrote the same graph byte for byte.
FAKE_TENSOR_CACHE = False


def export_graph(model, onnx_path: Path, log: Callable[[str], None] = print, every_layer: bool = False) -> None:
    """The model traced by torch.onnx.export (dynamo) into onnx_path, its weights in an external data file beside it:
    batch, sequence and past lengths dynamic. A model whose layers are all of one kind has its first two traced and
    the second copied for the others (layer_replication.py), unless every_layer."""
    layers = model.config.num_hidden_layers
    why = "asked (--trace-every-layer)" if every_layer else layer_replication.replication_refusal(model.config)
    if why is None:
        started = time.monotonic()
        try:
            with traced_layers(model, layer_replication.TRACED_LAYERS):
                program = trace(model, log)
            layer_replication.replicate(program.model, DecoderWithCache(model).state_dict(), layers)
            log(f"layers 2-{layers - 1} copied from layer 1 ({time.monotonic() - started:.1f} s with the trace)")
        except layer_replication.NotReplicable as error:
            why = f"the trace of {layer_replication.TRACED_LAYERS} layers cannot be extended ({error})"
    if why is not None:
        if layers > layer_replication.TRACED_LAYERS:
            log(f"all {layers} layers traced: {why}")
        program = trace(model, log)
    started = time.monotonic()
    optimize_graph(program.model)
    log(f"graph optimized in {time.monotonic() - started:.1f} s")
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(onnx_path), external_data=True)


@contextlib.contextmanager
def traced_layers(model, count: int):
    """The model with only its first ``count`` decoder layers while inside (its config says so too)."""
    config = model.config
    stacks = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.ModuleList) and len(module) == config.num_hidden_layers]
    if len(stacks) != 1:
        raise layer_replication.NotReplicable(f"{len(stacks)} lists of {config.num_hidden_layers} modules in the "
                                              "model, not one of its layers")
    parent_name, _, attribute = stacks[0].rpartition(".")
    parent = model.get_submodule(parent_name)
    stack = getattr(parent, attribute)
    saved = {key: getattr(config, key) for key in ("num_hidden_layers", "layer_types") if hasattr(config, key)}
    try:
        setattr(parent, attribute, stack[:count])
        config.num_hidden_layers = count
        if saved.get("layer_types"):
            config.layer_types = saved["layer_types"][:count]
        yield
    finally:
        setattr(parent, attribute, stack)
        for key, value in saved.items():
            setattr(config, key, value)


def head_size(config) -> int:
    """The width of one attention head: the cache's last axis."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def trace(model, log: Callable[[str], None]):
    """torch.onnx.export's ONNXProgram of the model as it is (its config's layers), not optimized."""
    config = model.config
    layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, head_size(config)
    # Sample shapes avoid 0 and 1: export would specialize those dimensions.
    batch, seq, past_len = 2, 3, 4
    past = [torch.zeros(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers)]
    args = (
        torch.ones(batch, seq, dtype=torch.int64),
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq, dtype=torch.int64).repeat(batch, 1),
        torch.arange(seq - 2, seq, dtype=torch.int64),
        *past,
    )
    dyn = torch.export.Dim.DYNAMIC
    dynamic_shapes = {
        "input_ids": {0: dyn, 1: dyn},
        "attention_mask": {0: dyn, 1: dyn},
        "position_ids": {0: dyn, 1: dyn},
        "logits_positions": {0: dyn},
        "past": tuple({0: dyn, 2: dyn} for _ in past),
    }
    kv_names = [f"{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    log(f"torch.onnx.export(dynamo=True): {layers} layers, {kv_heads} KV heads, head_dim {head_dim} "
        f"(~{6 + 4 * layers} s)")
    with torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=FAKE_TENSOR_CACHE):
        return torch.onnx.export(
            DecoderWithCache(model).eval(),
            args,
            input_names=["input_ids", "attention_mask", "position_ids", "logits_positions"]
            + [f"past_key_values.{n}" for n in kv_names],
            output_names=["logits"] + [f"present.{n}" for n in kv_names],
            dynamic_shapes=dynamic_shapes,
            dynamo=True,
            optimize=False,
            verbose=False,
        )


# onnxscript's rewrite that turns two Slices halving a tensor's last axis into one Split. Its pattern of two nodes is
# matched against the graph's Slices pair by pair: SmolLM2's optimize_ir took 45-50 s (its rewrite pass 28 s and 19 s
# in its two rounds), 6 s without this rule, which rewrites nothing in its graph (onnxscript 0.7.2).
PAIRED_SLICES_RULE = "SlicesSplit"


def optimize_graph(model) -> None:
    """What torch.onnx.export(optimize=True) does to the graph (onnxscript's optimize_ir, then its fusions), in place,
    without the rewrite of PAIRED_SLICES_RULE: SmolLM2's graph the same node for node, in 6 s instead of 45 s. A model
    whose graph has such pairs keeps two Slices where the full optimizer writes a Split: the same values."""
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter import onnx_fusions

    default = rewriter._DEFAULT_REWRITE_RULES  # optimize_ir reads its rules here; it takes no list of its own
    kept = tuple(rule for rule in default if getattr(rule, "name", None) != PAIRED_SLICES_RULE)
    if len(kept) != len(default) - 1:
        raise RuntimeError(f"onnxscript's default rewrite rules have no {PAIRED_SLICES_RULE} rule: see "
                           "scripts/prepare/traced_decoder.py for why it is left out")
    rewriter._DEFAULT_REWRITE_RULES = kept
    try:
        optimizer.optimize_ir(model)
    finally:
        rewriter._DEFAULT_REWRITE_RULES = default
    onnx_fusions.fuse(model)
