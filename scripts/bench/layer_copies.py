"""The export's layer copies (scripts/prepare/layer_replication.py) against full traces: each architecture of the
architectures table as a tiny random model of 4 layers, exported both ways; onnxruntime's logits and cache outputs of
the two graphs on one random left-padded batch with a past, compared bit for bit, and each export's time.

    .venv/bin/python -m scripts.bench.layer_copies [--layers 4] [--output build/layer-copies]   (~4 min, 2 cores)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from scripts.paths import EXPORT_DIR

BATCH, NEW, PAST = 3, 5, 7


def random_feeds(config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The export's inputs for BATCH rows of NEW tokens after a random past of PAST positions, the first row
    left-padded by 3."""
    from scripts.prepare.traced_decoder import head_size

    mask = np.ones((BATCH, PAST + NEW), np.int64)
    mask[0, :3] = 0
    feeds = {"input_ids": rng.integers(0, config.vocab_size, (BATCH, NEW)), "attention_mask": mask,
             "position_ids": np.tile(np.arange(PAST, PAST + NEW), (BATCH, 1)),
             "logits_positions": np.arange(NEW, dtype=np.int64)}
    for layer in range(config.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal(
                (BATCH, config.num_key_value_heads, PAST, head_size(config))).astype(np.float32)
    return feeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output", type=Path, default=Path("build/layer-copies"))
    args = parser.parse_args(argv)
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.bench.architectures import configs
    from scripts.prepare import grouped_attention
    from scripts.prepare.traced_decoder import export_graph

    tokenizer = AutoTokenizer.from_pretrained(EXPORT_DIR, local_files_only=True)
    attention = grouped_attention.register()
    print("| architecture | the export | copies against the full trace | export copied / full |")
    print("| --- | --- | --- | --- |")
    different = 0
    for name, config in configs(tokenizer, layers=args.layers).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
        sessions, seconds, lines = {}, {}, []
        for mode in ("copied", "full"):
            path = args.output / f"{name.split()[0]}-{mode}" / "model.onnx"
            started = time.monotonic()
            export_graph(model, path, log=lines.append, every_layer=mode == "full")
            seconds[mode] = time.monotonic() - started
            sessions[mode] = ort.InferenceSession(str(path))
        feeds = random_feeds(model.config, np.random.default_rng(0))
        copied, full = (sessions[mode].run(None, feeds) for mode in ("copied", "full"))
        same = all(np.array_equal(a, b) for a, b in zip(copied, full, strict=True))
        different += not same
        route = next((line for line in lines if "copied from" in line or "layers traced" in line), "?")
        worst = max(float(np.abs(a - b).max()) for a, b in zip(copied, full))
        print(f"| {name} | {route.split(' (')[0] if 'copied' in route else route} | "
              f"{'the same bits' if same else f'DIFFERENT: max {worst:.2e}'} | "
              f"{seconds['copied']:.1f} s / {seconds['full']:.1f} s |", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
