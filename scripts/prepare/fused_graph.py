"""The fused decoder graph of an export, which every weight variant is built on: onnxruntime-genai's model builder,
run on the Hugging Face folder the export writes (EXPORT_DIR/hf), in fp32 for the CPU.

Its graph (342 nodes against the standard export's ~2,000): ``GroupQueryAttention`` with rotary embedding inside,
which appends to a KV buffer in place (python_backend/runtime/onnx_slot_decoder.py);
``SkipSimplifiedLayerNormalization``; one packed QKV MatMul per layer. Its LM head is then given each row's last
position only (``logits_of_last_positions``). scripts/prepare/quantize.py then puts each variant's weights in it.
The builder supports the architectures onnxruntime-genai lists (Llama, Mistral, Qwen, Phi, Gemma, ...); another
(OLMo 2) is refused from its config before any work (``refusal``), and its fp32 and fp16 are built on the export's
own graph instead.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import runpy
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper

BUILDER = "onnxruntime_genai.models.builder"


def build(hf_dir: Path) -> onnx.ModelProto:
    """The builder's fp32 CPU graph of hf_dir, with its weights loaded and the cache's head size made concrete."""
    with tempfile.TemporaryDirectory(prefix="fused-graph-") as work:
        output, cache = Path(work) / "model", Path(work) / "cache"
        run_builder(["-i", str(hf_dir), "-o", str(output), "-p", "fp32", "-e", "cpu", "-c", str(cache)], hf_dir)
        model = onnx.load(str(output / "model.onnx"))
    set_head_size(model, head_size(hf_dir))
    query_lengths_input(model)
    logits_of_last_positions(model)
    return model


def run_builder(args: list[str], hf_dir: Path) -> None:
    """The builder's command line (`python -m onnxruntime_genai.models.builder ARGS`), run in this process: a process
    of its own spent ~3.5 s importing torch, transformers and the builder again, most of a tiny model's build. Its
    output is shown only when it fails."""
    argv, log = sys.argv, io.StringIO()
    sys.argv = [BUILDER, *args]
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            runpy.run_module(BUILDER, run_name="__main__", alter_sys=True)
    except SystemExit as error:
        if error.code not in (0, None):
            raise RuntimeError(f"onnxruntime-genai's model builder failed on {hf_dir} (exit {error.code}):\n"
                               f"{log.getvalue()[-3000:]}") from error
    except Exception as error:  # noqa: BLE001 - any failure of the builder, with its output
        raise RuntimeError(f"onnxruntime-genai's model builder failed on {hf_dir} ({type(error).__name__}: "
                           f"{error}):\n{log.getvalue()[-3000:]}") from error
    finally:
        sys.argv = argv


@functools.lru_cache(maxsize=1)
def builder_architectures() -> frozenset[str]:
    """The model classes the installed builder dispatches on (``config.architectures[0] == "..."`` in its source),
    read from the builder itself so that an upgrade brings its new ones; empty if that source cannot be read."""
    import importlib.util

    spec = importlib.util.find_spec(BUILDER)
    try:
        source = Path(spec.origin).read_text() if spec and spec.origin else ""
    except OSError:
        source = ""
    return frozenset(re.findall(r'architectures\[0\] == "(\w+)"', source))


def refusal(hf_dir: Path, variant: str) -> str | None:
    """Why the fused graph cannot serve this model, from its config before any work (None: nothing known against
    it). A model class the builder does not take (OLMo 2's): it would fail minutes in, after the export. Sliding-window
    layers (Gemma 2's, alternate layers): the builder gives their GroupQueryAttention a local window, which
    onnxruntime runs only on a cache holding the whole window per row; on the slot cache the parity check failed
    inside the kernel (a tiny Gemma 2, 2026-12-02: window 32, and window 4096 on a 64-token cache)."""
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = (config.get("architectures") or [None])[0]
    supported = builder_architectures()
    if supported and architecture and architecture not in supported:
        causal = sorted(a for a in supported if a.endswith("ForCausalLM"))
        return (f"{variant} is built on onnxruntime-genai's fused graph, whose model builder does not take "
                f"{architecture} ({config.get('model_type')}); it takes {', '.join(causal)} (and multimodal "
                "classes). Nothing was built. Serve QUANT=fp32 (exact) or fp16: for such a model they are built "
                "on the export's own graph")
    if "sliding_attention" not in (config.get("layer_types") or []):
        return None
    return (f"{variant} is built on onnxruntime-genai's fused graph, whose sliding-window attention does not run on "
            f"the slot cache: {config.get('model_type')} has sliding-window layers (sliding_window "
            f"{config.get('sliding_window')}). Nothing was built. Serve QUANT=fp32 (exact) or fp16: for such a model "
            "they are built on the export's own graph")


def unwindowed_limit(hf_dir: Path) -> int | None:
    """The longest sequence the fused graph computes as the model does, or None when nothing limits it. A config with
    a `sliding_window` but no `layer_types` (Mistral v0.1's 4096, Phi-3-mini-4k's 2047) has every layer windowed in
    transformers, while the builder reads which layers are windowed from `layer_types` only and gives them all full
    attention: the two agree while a sequence fits in the window (token i sees i - window < j <= i), and not beyond.
    (Sliding layers named in `layer_types` are refused instead: refusal().)"""
    config = json.loads((hf_dir / "config.json").read_text())
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False or config.get("layer_types"):
        return None
    return int(window)


def head_size(hf_dir: Path) -> int:
    config = json.loads((hf_dir / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def set_head_size(model: onnx.ModelProto, size: int) -> None:
    """The builder leaves the caches' last dimension symbolic; the runtime reads the cache's shape from it."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            value.type.tensor_type.shape.dim[3].dim_value = size


def lm_head_node(model: onnx.ModelProto) -> onnx.NodeProto:
    """The MatMul that makes the logits: the node producing 'logits', or the MatMul it is computed from through
    element-wise nodes (Gemma 2's final soft-capping: Div, Tanh, Mul after the head)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    node = producers.get("logits")
    while node is not None and node.op_type != "MatMul":
        node = producers.get(node.input[0]) if node.op_type in ("Div", "Tanh", "Mul", "Cast") else None
    if node is None:
        raise ValueError("the fused graph has no MatMul producing 'logits'")
    return node


def lm_head(model: onnx.ModelProto) -> str:
    """The name of the MatMul that makes the logits."""
    return lm_head_node(model).name


ALL_POSITIONS_INPUT = "logits_all_positions"
QUERY_LENGTHS_INPUT = "query_seqlens"


def query_lengths_input(model: onnx.ModelProto) -> None:
    """Gives every ``GroupQueryAttention`` the graph input ``query_seqlens`` (int32 [rows]): how many of each row's
    new tokens are real, the rest of the row being right padding. With it onnxruntime's kernel (1.32) takes several
    rows that each have a past and several new tokens in one call (the rests of prompts found in part in the prefix
    cache), which it refuses without it ("batch_size must be 1 when sequence_length > 1 and past context is
    given"); each row's past is its mask's sum minus its count. Rows without a past (a first prompt) and decode steps
    are computed as before, to the same bits (seen 2026-12-05, docs/performance.md)."""
    graph = model.graph
    graph.input.append(onnx.helper.make_tensor_value_info(QUERY_LENGTHS_INPUT, onnx.TensorProto.INT32, ["batch_size"]))
    position = 16  # query_seqlens among the operator's inputs (onnxruntime 1.32's contrib schema)
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            node.input.extend([""] * (position - len(node.input)))
            node.input.append(QUERY_LENGTHS_INPUT)


def logits_of_last_positions(model: onnx.ModelProto) -> None:
    """Makes the graph compute the LM head for each row's last position only: ``logits`` becomes [rows, 1, vocab].
    The engine reads no other position while it generates, so the head (49,152 x 576 for SmolLM2) over every other
    position of a prompt is wasted work; the last positions' logits are the same bits as before.
    A row's last position among its new tokens: its count in ``query_seqlens`` - 1 (query_lengths_input), so that
    right-padded rows, with or without a past, each give their own last token's logits.

    Scoring a prompt (its tokens' log-probabilities) needs every position: the graph's input
    ``logits_all_positions`` (int64 [1]: 0 for the last positions) set to 1 gives [rows, new, vocab], each row's new
    positions in order (a right-padded row's padding positions hold logits nobody reads). An input, not an
    initializer with a default: onnxruntime's IOBinding does not take an overridable initializer by name."""
    graph = model.graph
    head = lm_head_node(model)
    hidden_size = next(i for i in graph.initializer if i.name == head.input[1]).dims[0]
    hidden, prefix = head.input[0], "/last_position"

    def const(name: str, values: list[int] | int) -> str:
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(values, np.int64), f"{prefix}/{name}"))
        return f"{prefix}/{name}"

    def node(op: str, inputs: list[str], name: str, **attributes) -> str:
        nodes.append(onnx.helper.make_node(op, inputs, [f"{prefix}/{name}"], name=f"{prefix}/{name}", **attributes))
        return f"{prefix}/{name}"

    graph.input.append(onnx.helper.make_tensor_value_info(ALL_POSITIONS_INPUT, onnx.TensorProto.INT64, [1]))
    nodes: list[onnx.NodeProto] = []
    every = ALL_POSITIONS_INPUT  # 0 or 1
    counts = node("Cast", [node("Unsqueeze", [QUERY_LENGTHS_INPUT, const("axis_1", [1])], "counts_int32")], "counts",
                  to=onnx.TensorProto.INT64)  # [rows, 1]
    ids_shape = node("Shape", ["input_ids"], "ids_shape")
    new = node("Slice", [ids_shape, const("one", [1]), const("two", [2])], "new")
    last = node("Sub", [counts, const("one_again", [1])], "last")
    # Positions gathered: [last] (every = 0) or [0, 1, ..., new - 1] (every = 1): offsets 0..count-1 added to
    # last * (1 - every), where count = 1 + every * (new - 1).
    count = node("Add", [const("one_count", [1]), node("Mul", [every, node("Sub", [new, const("one_less", [1])],
                                                                          "new_minus_one")], "extra")], "count")
    offsets = node("Range", [const("zero_scalar", 0), node("Squeeze", [count], "count_scalar"),
                             const("one_scalar", 1)], "offsets")  # [count]
    start = node("Mul", [last, node("Sub", [const("one_keep", [1]), every], "keep_last")], "start")  # [rows, 1]
    positions = node("Add", [start, node("Unsqueeze", [offsets, const("axis_0", [0])], "offsets_2d")],
                     "positions")  # [rows, count]
    rows = node("Slice", [ids_shape, const("zero", [0]), const("one_end", [1])], "rows")
    target = node("Concat", [rows, count, const("hidden_size", [hidden_size])], "target", axis=0)
    index = node("Expand", [node("Unsqueeze", [positions, const("axis_2", [2])], "positions_3d"), target], "index")
    gathered = node("GatherElements", [hidden, index], "last_hidden", axis=1)  # [rows, count, hidden]
    head.input[0] = gathered
    position = list(graph.node).index(head)
    for offset, new_node in enumerate(nodes):
        graph.node.insert(position + offset, new_node)
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].Clear()
    logits.type.tensor_type.shape.dim[1].dim_param = "positions"
