"""The fused decoder graph of an export, for ``QUANT=fast``: onnxruntime-genai's model builder, run on the Hugging
Face folder the export writes (EXPORT_DIR/hf), in fp32 for the CPU.

Its graph (342 nodes against the standard export's ~2,000): ``GroupQueryAttention`` with rotary embedding inside,
which appends to a KV buffer in place (python_backend/runtime/onnx_slot_decoder.py);
``SkipSimplifiedLayerNormalization``; one packed QKV MatMul per layer. scripts/prepare/quantize.py then puts the project's own 4-bit weights in it.
The builder supports the architectures onnxruntime-genai lists (Llama, Mistral, Qwen, Phi, Gemma, ...); another
model fails here with the builder's message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

BUILDER = "onnxruntime_genai.models.builder"


def build(hf_dir: Path) -> onnx.ModelProto:
    """The builder's fp32 CPU graph of hf_dir, with its weights loaded and the cache's head size made concrete."""
    with tempfile.TemporaryDirectory(prefix="fused-graph-") as work:
        output, cache = Path(work) / "model", Path(work) / "cache"
        command = [sys.executable, "-m", BUILDER, "-i", str(hf_dir), "-o", str(output), "-p", "fp32", "-e", "cpu",
                   "-c", str(cache)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai's model builder failed on {hf_dir} (exit {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        model = onnx.load(str(output / "model.onnx"))
    set_head_size(model, head_size(hf_dir))
    return model


def head_size(hf_dir: Path) -> int:
    config = json.loads((hf_dir / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def set_head_size(model: onnx.ModelProto, size: int) -> None:
    """The builder leaves the caches' last dimension symbolic; the runtime reads the cache's shape from it."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.shape.dim[3].dim_value = size


def lm_head(model: onnx.ModelProto) -> str:
    """The name of the MatMul that makes the logits."""
    for node in model.graph.node:
        if node.op_type == "MatMul" and "logits" in node.output:
            return node.name
    raise ValueError("the fused graph has no MatMul producing 'logits'")
