"""What per-row LoRA adapters cost in the fused graph (issue 35's design check), in-process, before they are served:
32 rows' prefill and decode steps on a variant's fused graph as built, on the same graph with adapter inputs
(scripts/prepare/lora_graph.py) and no adapter in the step (every width 0), and with N random adapters of rank R on
every projection spread over the rows beside rows without one. Median of the steps; one process.

    python -m scripts.bench.lora_overhead --model-dir build/model-fp32 --adapters 4 --rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from python_backend.engine.kv_slots import SlotKVCache
from python_backend.model_files import ONNX_FILE, SETTINGS_FILE
from python_backend.lora import KINDS, Adapter, AdapterInputs, BaseShapes
from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
from scripts.prepare.lora_graph import add_adapter_inputs


def random_adapters(targets: dict, count: int, rank: int, rng) -> list[Adapter]:
    widths = {kind: rank * len(modules) for kind, modules in KINDS.items()}
    return [Adapter(f"adapter{i}", widths, {
        (layer, kind): ((rng.standard_normal((features_in, widths[kind])) * 0.02).astype(np.float32),
                        (rng.standard_normal((widths[kind], features_out)) * 0.02).astype(np.float32))
        for (layer, kind), (features_in, features_out) in targets.items()}) for i in range(count)]


def timed_steps(decoder, rows: int, prompt: int, steps: int, extra) -> tuple[float, float]:
    """(prefill ms, median decode step ms) of `rows` random prompts of `prompt` tokens."""
    cache = SlotKVCache(decoder, rows, prompt + steps + 1)
    views = cache._rows(0, rows)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 20000, (rows, prompt))
    started = time.perf_counter()
    logits = decoder.forward_in_place(ids, np.ones((rows, prompt), np.int64), views, extra=extra)
    prefill = time.perf_counter() - started
    times = []
    for step in range(steps):
        tokens = logits[:, -1].argmax(-1)[:, None]
        started = time.perf_counter()
        logits = decoder.forward_in_place(tokens, np.ones((rows, prompt + step + 1), np.int64), views, extra=extra)
        times.append(time.perf_counter() - started)
    return prefill * 1000, float(np.median(times)) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("build/model-fp32"),
                        help="a variant built on the fused graph with fp32 or fp16 matrices (QUANT=fp32)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    path = args.model_dir / ONNX_FILE
    settings = json.loads((args.model_dir / SETTINGS_FILE).read_text())
    base = BaseShapes.from_config(json.loads((Path(settings["hf_dir"]) / "config.json").read_text()))
    model = onnx.load(str(path))
    targets = {(t.layer, t.kind): (t.in_features, t.out_features) for t in add_adapter_inputs(model)}
    if len(targets) != base.num_layers * len(KINDS):
        raise SystemExit(f"{path}: {len(targets)} projections found, not {base.num_layers * len(KINDS)}")
    with tempfile.TemporaryDirectory(prefix="lora-graph-") as work:
        lora_path = Path(work) / "model.onnx"
        onnx.save(model, str(lora_path), save_as_external_data=True, location="model.onnx.data")
        del model
        plain, with_lora = OnnxSlotDecoder(path), OnnxSlotDecoder(lora_path)
        inputs = AdapterInputs(targets)
        adapters = random_adapters(targets, args.adapters, args.rank, np.random.default_rng(1))
        spread = [adapters[r % (args.adapters + 1)] if r % (args.adapters + 1) < args.adapters else None
                  for r in range(args.rows)]
        runs = [("the graph as built", plain, None),
                ("adapter inputs, no adapter in the step", with_lora, inputs.for_rows([None] * args.rows)),
                (f"{args.adapters} adapters of rank {args.rank} on every projection, "
                 f"{sum(a is None for a in spread)} of {args.rows} rows without one", with_lora,
                 inputs.for_rows(spread))]
        results = [(name, *timed_steps(decoder, args.rows, args.prompt, args.steps, extra))
                   for name, decoder, extra in runs]
    base_prefill, base_step = results[0][1], results[0][2]
    print(f"| {args.model_dir.name}, {args.rows} rows | prefill of {args.prompt} tokens a row (ms) "
          f"| decode step, median of {args.steps} (ms) |")
    print("| --- | --- | --- |")
    for name, prefill, step in results:
        print(f"| {name} | {prefill:.0f} (x{prefill / base_prefill:.2f}) | {step:.1f} (x{step / base_step:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
