"""GGUF files of the types people download, written from a tiny random Llama by scripts/bench/gguf_files.py: each
type read as the file's own grid (scripts/prepare/gguf_grid.py), the 5-, 6- and 8-bit ones as two 4-bit matrices; one
file of every common type, a layer each, exported, its exact int4 variant built with each tensor on its grid and the
F16 one fp32, equal to the fp32 export of the same file and served token-exact; a file with no layer tensor on an
integer grid refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from scripts.bench import gguf_files
from scripts.prepare import block_quantization, quantize, source_grid
from scripts.prepare.gguf_grid import FileGrids, decode
from tests.helpers import export_tiny

# One file, one layer per type people download: Q4_0, Q4_1, Q4_K_M's mix (its layer 2 holds attn_v and ffn_down in
# Q6_K, so that its fused q/k/v matrix mixes a 4-bit and a 6-bit type), Q5_K_M (Q5_K on its layer 3), Q6_K, Q8_0, F16.
LAYER_PRESETS = ["Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_each_4_bit_type_is_read_as_its_own_grid_and_kept_exactly(kind):
    values = weights(16, 512)
    blocks = gguf_files.encode(values, kind)
    stored = dequantize(blocks, GGMLQuantizationType[kind]).reshape(values.shape)
    grid = decode(kind, blocks.reshape(len(values), -1), values.shape[1])
    assert np.array_equal(grid.values(), stored)  # the same arithmetic as gguf's dequantize: bit for bit
    assert grid.codes.max() <= 15

    weight = stored.T  # a MatMul's [K, N]
    kept = block_quantization.from_grid(grid.codes, grid.scales, grid.offsets)
    assert np.array_equal(kept.codes().reshape(len(values), -1), grid.codes)
    assert kept.residual_spread(weight) <= 1e-6 * np.abs(weight).max()
    # The grid found again from each block's min and max is Q4_1's own (its blocks reach both ends by construction),
    # not Q4_0's (d = max|w| / 8 leaves code 15 unused in most blocks): its weights would be rounded a second time.
    # (Q4_K's blocks miss an end when llama.cpp's search picks their scales; this encoder's seldom do.)
    again = block_quantization.quantize(weight, 4)
    if kind != "Q4_K":
        assert (again.residual_spread(weight) <= 1e-6 * np.abs(weight).max()) == (kind == "Q4_1")


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"])
def test_each_wider_type_is_read_as_its_own_grid_and_two_4_bit_matmuls_give_its_fp32_product(kind):
    """A 5-, 6- or 8-bit tensor's codes, scales and offsets read from its blocks (Q6_K's sub-blocks of 16 with
    signed scales), and the matrix as the sum of two 4-bit MatMulNBits (high and low nibbles) run by onnxruntime: the
    fp32 product of the file's values."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    values = weights(8, 512, seed=2)
    blocks = gguf_files.encode(values, kind)
    if kind == "Q6_K":  # llama.cpp's Q6_K scales are signed; this encoder's are not: half of them negated here
        scales = blocks.reshape(-1, 210)[::2, 192:208]
        scales[:] = (-scales.view(np.int8)).view(np.uint8)
    stored = dequantize(blocks, GGMLQuantizationType[kind]).reshape(values.shape)
    grid = decode(kind, blocks.reshape(len(values), -1), values.shape[1])
    assert np.abs(grid.values() - stored).max() <= 1e-6 * np.abs(stored).max()
    assert grid.block == (16 if kind == "Q6_K" else 32) and 15 < grid.codes.max() < 2 ** grid.bits

    weight = np.ascontiguousarray(stored.T)  # a MatMul's [K, N]
    graph = helper.make_graph([], "halves", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    spreads = []
    nodes = quantize.GridGraph(model, quantize.RECIPES["int4"]).on_grid("proj", "x", "y", grid, weight, spreads)
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid(quantize.MS_DOMAIN, 1))
    assert [n.op_type for n in nodes].count("MatMulNBits") == 2 and nodes[-1].name == "proj.halves"
    # Q5_1's and Q5_K's offsets (d·q + m, −dmin·m) are no whole number of steps: the low half carries a residual
    assert ("proj.low.residual" in [n.name for n in nodes]) == (kind in ("Q5_1", "Q5_K"))
    assert spreads[0] <= 1e-6 * np.abs(weight).max()
    assert not any(numpy_helper.to_array(i).dtype == np.float32 and i.dims == [512, 8] for i in graph.initializer)
    x = np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)
    product = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(product[0] - x @ weight).max() <= 1e-5 * np.abs(x @ weight).max()


@pytest.mark.parametrize("kind, levels", [("Q4_K", 16), ("Q5_K", 32), ("Q6_K", 64), ("IQ4_NL", 16)])
def test_the_k_quant_encoders_write_blocks_that_gguf_reads_back(kind, levels):
    values = weights(4, 1024, seed=1)
    stored = dequantize(gguf_files.encode(values, kind), GGMLQuantizationType[kind]).reshape(values.shape)
    assert np.abs(stored - values).max() < 4 * np.abs(values).max() / levels
    # Written again from what was read, the same values: the blocks hold exactly the grid they claim.
    again = dequantize(gguf_files.encode(stored, kind), GGMLQuantizationType[kind]).reshape(values.shape)
    assert np.array_equal(again, stored)


def test_the_presets_give_each_tensor_the_type_llama_quantize_does():
    assert gguf_files.tensor_type("Q4_K_M", "blk.0.attn_q.weight", 256, 3) == "Q4_K"
    assert gguf_files.tensor_type("Q4_K_M", "blk.2.attn_v.weight", 256, 3) == "Q6_K"  # a layer with more bits
    assert gguf_files.tensor_type("Q4_K_M", "blk.1.attn_v.weight", 256, 3) == "Q4_K"
    assert gguf_files.tensor_type("Q5_K_M", "blk.0.ffn_down.weight", 576, 30) == "Q8_0"  # Q6_K's fallback
    assert gguf_files.tensor_type("Q4_K_M", "blk.5.ffn_up.weight", 576, 30) == "Q5_0"  # SmolLM2's 576-wide rows
    assert gguf_files.tensor_type("Q4_0", "token_embd.weight", 576, 30) == "Q8_0"


@pytest.fixture(scope="session")
def tiny_llama_dir(model_dir, tmp_path_factory) -> Path:
    """A Hugging Face folder: a random Llama 256 wide (rows of whole K-quant super-blocks), a layer per type of the
    mixed file, SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # here: every worker collects every file

    folder = tmp_path_factory.mktemp("tiny_llama_256")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=len(LAYER_PRESETS),
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def mixed_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.mixed.gguf"
    types = gguf_files.write(tiny_llama_dir, LAYER_PRESETS, path, chat_template=TEMPLATE)
    assert [types[f"blk.{i}.ffn_up.weight"] for i in range(len(LAYER_PRESETS))] == [
        "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"]
    assert types["blk.2.attn_v.weight"] == types["blk.2.ffn_down.weight"] == "Q6_K"
    assert types["blk.3.attn_v.weight"] == types["blk.3.ffn_down.weight"] == "Q5_K"  # not a layer with more bits
    return path


def small_gguf(path: Path, tensors: dict[str, str], rows: dict[str, int] | None = None) -> Path:
    """A GGUF file of only these tensors (name -> type), each 256 wide, of 2 rows (or rows[name]) drawn with a seed
    of its own, without the tokenizer a model's file carries: its header says what a big file's would."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for seed, (name, kind) in enumerate(tensors.items()):
        values = weights((rows or {}).get(name, 2), 256, seed)
        writer.add_tensor(name, gguf_files.encode(values, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_without_a_layer_tensor_on_an_integer_grid_is_refused_naming_its_types(tmp_path):
    floats = {**{f"blk.{i}.ffn_up.weight": "F16" for i in range(3)}, "blk.0.attn_v.weight": "F32",
              "token_embd.weight": "Q4_0"}  # not a layer tensor: it does not count
    f16 = small_gguf(tmp_path / "tiny.F16.gguf", floats)
    why = source_grid.refusal(tmp_path, str(f16), "int4", 4, 32)
    assert "none of tiny.F16.gguf's layer tensors is of those types: they are 3 F16, 1 F32." in why
    assert "Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0" in why and "Nothing was built" in why
    iq = small_gguf(tmp_path / "tiny.IQ4_NL.gguf", {f"blk.{i}.ffn_up.weight": "IQ4_NL" for i in range(2)})
    assert "they are 2 IQ4_NL (IQ4_NL map their codes through a table" in source_grid.refusal(tmp_path, str(iq), "int4",
                                                                                                4, 32)
    for kind in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"):
        one_on_a_grid = small_gguf(tmp_path / f"tiny.{kind}.gguf", {**floats, "blk.2.attn_q.weight": kind})
        assert source_grid.refusal(tmp_path, str(one_on_a_grid), "int4", 4, 32) is None, kind


def test_the_files_rows_are_found_whatever_their_order(tmp_path):
    """The loader reorders Llama's q and k rows and the fused graph packs q, k and v in one matrix: rows are matched
    by value. A matrix with rows of two grid layouts (4-bit blocks of 32, Q6_K's 6-bit blocks of 16) comes in runs of
    columns; one with an unknown row has no grid. (A file of these tensors as the mixed model's file has them, and
    two of other types beside them whose rows must not be found.)"""
    from scripts.prepare.gguf_tensors import read_tensors

    path = small_gguf(tmp_path / "rows.gguf", {"blk.0.attn_k.weight": "Q4_0", "blk.0.attn_q.weight": "Q4_0",
                                               "blk.1.attn_q.weight": "Q4_1", "blk.2.attn_q.weight": "Q4_K",
                                               "blk.2.attn_v.weight": "Q6_K", "blk.1.ffn_up.weight": "Q8_0",
                                               "blk.3.attn_q.weight": "Q5_K"},
                      rows={"blk.0.attn_k.weight": 128, "blk.0.attn_q.weight": 256, "blk.1.attn_q.weight": 256,
                            "blk.2.attn_q.weight": 256, "blk.2.attn_v.weight": 128, "blk.1.ffn_up.weight": 256,
                            "blk.3.attn_q.weight": 256})
    grids = FileGrids(path)
    tensors = {t.name: dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
               for t in read_tensors(path) if t.name.startswith("blk.")}
    packed = np.concatenate([tensors["blk.0.attn_k.weight"][::-1], tensors["blk.1.attn_q.weight"]])
    match = grids.match(packed.T)
    assert match.grid is not None and dict(match.types) == {"Q4_0": 128, "Q4_1": 256}
    assert np.array_equal(match.grid.values(), packed)
    mixed = grids.match(np.concatenate([tensors["blk.2.attn_q.weight"], tensors["blk.2.attn_v.weight"]]).T)
    assert mixed.grid is None and set(mixed.types) == {"Q4_K", "Q6_K"} and mixed.missing == 0
    assert mixed.runs() == [(slice(0, 256), (4, 32)), (slice(256, 384), (8, 16))]
    assert np.array_equal(mixed.grid_of(slice(256, 384)).values(), tensors["blk.2.attn_v.weight"])
    assert np.array_equal(mixed.grid_of(slice(0, 256)).values(), tensors["blk.2.attn_q.weight"])
    unknown = grids.match(np.concatenate([tensors["blk.0.attn_q.weight"], np.ones((1, 256), np.float32)]).T)
    assert unknown.grid is None and unknown.missing == 1


def test_the_tensor_table_is_read_past_every_kind_of_metadata_as_gguf_reads_it(tmp_path):
    """gguf_tensors steps over the metadata unparsed: every value type, arrays of strings, of numbers and of arrays,
    and an alignment of its own (the data's start) leave its tensors where gguf's GGUFReader finds them (the served
    model's file: tests/test_source_grid.py)."""
    import gguf

    from scripts.prepare.gguf_tensors import read_tensors

    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(4096)  # longer than the header: the default 32 would look for the data too early
    for kind, value in [("uint8", 1), ("int8", -2), ("uint16", 3), ("int16", -4), ("uint32", 5), ("int32", -6),
                        ("float32", 0.5), ("bool", True), ("uint64", 2**40), ("int64", -(2**40)), ("float64", 0.25),
                        ("string", "ünïcode")]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_token_list(["<s>", "é", "a b", ""])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.nested", [[1, 2], ["x", "yz"]])
    for seed, (name, kind) in enumerate({"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_up.weight": "Q6_K",
                                         "output_norm.weight": "F32", "blk.1.ffn_up.weight": "F16",
                                         "blk.1.attn_q.weight": "Q8_0"}.items()):
        values = weights(1 if kind == "F32" else 3, 256, seed)
        writer.add_tensor(name, gguf_files.encode(values, kind), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mine, theirs = read_tensors(path), gguf.GGUFReader(path).tensors
    assert [t.name for t in mine] == [t.name for t in theirs]
    for ours, gguf_s in zip(mine, theirs):
        assert (ours.tensor_type, ours.shape) == (gguf_s.tensor_type, tuple(int(d) for d in gguf_s.shape)), ours.name
        assert ours.data.dtype == gguf_s.data.dtype and ours.data.shape == gguf_s.data.shape, ours.name
        assert np.array_equal(ours.data, gguf_s.data), ours.name


def test_a_file_is_parsed_once_while_it_is_unchanged(tmp_path):
    import os

    import gguf

    from scripts.prepare.gguf_reader import open_gguf, parsed_once

    path = small_gguf(tmp_path / "small.gguf", {"blk.0.ffn_up.weight": "Q4_0"})
    first = open_gguf(path)
    assert open_gguf(str(path)) is first and [t.name for t in first.tensors] == ["blk.0.ffn_up.weight"]
    with parsed_once():  # what transformers' loaders open while the export loads a GGUF
        assert gguf.GGUFReader(path) is first
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # written again, the same size
    assert open_gguf(path) is not first


def test_the_export_parses_a_file_once_and_builds_a_table_of_tensor_names_once(tmp_path, monkeypatch):
    """The export's look at the file's config before any work (refusal) is the file's one parse, which loading it
    reads again; within parsed_once, gguf's table of tensor names (which transformers builds once per submodule as it
    maps the weights) is built once per architecture and depth."""
    import gguf

    from scripts.prepare import export_onnx
    from scripts.prepare.gguf_reader import parsed_once

    path = small_gguf(tmp_path / "small.gguf", {"blk.0.ffn_up.weight": "Q4_0"})
    parses = []
    parse = gguf.gguf_reader.GGUFReader.__init__
    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__",
                        lambda self, *args, **kwargs: parses.append(args[0]) or parse(self, *args, **kwargs))
    assert export_onnx.refusal(path) is None
    with parsed_once():  # as load_source reads it
        gguf.GGUFReader(path)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
        assert names.get_name("model.layers.1.mlp.up_proj") == "blk.1.ffn_up"
    assert len(parses) == 1, parses
    assert gguf.get_tensor_name_map is gguf.tensor_mapping.get_tensor_name_map


@pytest.fixture(scope="session")
def mixed_int4(mixed_gguf, tmp_path_factory) -> Path:
    """`make model SOURCE=tiny.mixed.gguf QUANT=int4`: the fp32 export, then the exact variant with its parity check
    (on 4 load-test prompts, export_tiny's; built by make model, 42 of 42 on 2026-12-05, docs/models.md)."""
    export = tmp_path_factory.mktemp("gguf_export") / "model"
    export_tiny(mixed_gguf, export, variants=("int4",))
    return quantize.variant_dir(export, "int4")


@pytest.mark.server
@pytest.mark.models
def test_int4_of_a_mixed_file_keeps_each_4_bit_tensor_on_its_grid_exactly(mixed_int4):
    report = json.loads((mixed_int4 / "parity_report.json").read_text())
    assert report["passed"] and report["greedy_agreement"]["identical"] == report["greedy_agreement"]["prompts"] == 4
    assert report["max_abs_logit_diff"] < 1e-4
    assert report["build"]["matrices"] == {
        # per layer the packed q/k/v, o, gate, up and down; on Q4_K_M's layer, down (Q6_K) is two 4-bit halves and
        # the packed q/k/v is split: q and k on their 4-bit grid, v (Q6_K) in halves; the 5-, 6- and 8-bit layers
        # are halves too, and only the F16 layer stays fp32
        quantize.FILE_GRID: {"Q4_0": 5, "Q4_1": 5, "Q4_K": 3},
        quantize.SPLIT: {"Q4_K+Q6_K": 1},
        quantize.WIDE_GRID: {"Q6_K": 1 + 5, "Q5_K": 5, "Q8_0": 5},
        quantize.KEPT_FP32: {"F16": 5},
    }
    # The tokenizer and its chat template are the file's own.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(mixed_int4, local_files_only=True)
    assert tokenizer.chat_template == TEMPLATE


@pytest.mark.server
@pytest.mark.models
def test_int4_of_a_mixed_file_is_served_token_exact(mixed_gguf, mixed_int4, servers):
    from transformers import LlamaForCausalLM

    from python_backend.serving.tokenization import PromptTokenizer
    from scripts.clients.llm_client import GenerateClient
    from tests.helpers import hf_greedy

    settings = json.loads((mixed_int4 / "llm_settings.json").read_text())
    hf_model = LlamaForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name,
                                                dtype=torch.float32).eval()
    tokenizer = PromptTokenizer(mixed_int4)
    client = GenerateClient(f"127.0.0.1:{servers.get(mixed_int4).http}")
    for prompt in ["The capital of France is", "def fibonacci(n):", "用一句话介绍一下长城。"]:
        expected = hf_greedy(hf_model, settings, tokenizer.encode(prompt, apply_chat_template=True), 24)
        completion = client.complete({"text_input": prompt, "max_tokens": 24, "apply_chat_template": True})
        assert completion.text == tokenizer.decode(expected), prompt
