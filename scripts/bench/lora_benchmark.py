"""What serving LoRA adapters costs (issue 35), through the engine (python_backend/engine/core.py) in one process:
32 concurrent requests spread over N adapters and the base, against 32 on the base alone; and one adapter's single
stream against the base's, which is what the same adapter merged into an export costs (merging changes the weights,
not the computation). Every request decodes exactly --max-tokens (no end token), greedy, continuous batching with
prefix caching as served; adapters are random, rank R on every projection (the most work an adapter of that rank
adds). Cases interleaved, --repeats times each; medians and ratios.

    python -m scripts.bench.lora_benchmark --model-dir build/model-fp32 --adapters 4 --rank 16
    make benchmark-lora

Targets (issue 35): the mixed run at least 70 % of the base's throughput, one stream at least 80 %.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from python_backend.engine.core import EngineCore
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.lora import KINDS, Adapter, BaseShapes
from python_backend.model_files import ADAPTER_ONNX_FILE, ONNX_FILE, SETTINGS_FILE
from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.bench.workload import workload


def random_adapters(base: BaseShapes, count: int, rank: int, rng) -> list[Adapter]:
    """Adapters of this rank on every projection, with PEFT-like magnitudes."""
    adapters = []
    for i in range(count):
        widths = {kind: rank * len(modules) for kind, modules in KINDS.items()}
        matrices = {}
        for layer in range(base.num_layers):
            for kind in KINDS:
                features_in, features_out = base.kind_shape(kind)
                matrices[(layer, kind)] = (
                    (rng.standard_normal((features_in, widths[kind])) / np.sqrt(features_in)).astype(np.float32),
                    (rng.standard_normal((widths[kind], features_out)) * 0.02).astype(np.float32))
        adapters.append(Adapter(f"adapter{i}", widths, matrices))
    return adapters


def tokens_per_s(decoder, prompts: list[list[int]], adapters: list, max_tokens: int) -> float:
    """Generated tokens per second of these requests, all submitted at once (each with its adapter or None)."""
    core = EngineCore(decoder, SchedulerConfig(max_batch_size=max(32, len(prompts)), kv_layout="slots",
                                               max_context_length=1024, kv_budget_tokens=65536,
                                               enable_kv_cache_reuse=True))
    sequences = [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=max_tokens, end_ids=()), adapter=a)
                 for p, a in zip(prompts, adapters)]
    started = time.perf_counter()
    for seq in sequences:
        core.add(seq)
    while core.step().progressed:
        pass
    elapsed = time.perf_counter() - started
    assert all(len(s.output_ids) == max_tokens for s in sequences)
    return len(sequences) * max_tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("build/model-fp32"),
                        help="a variant's folder on the fused graph (it holds the adapter graph)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args(argv)
    settings = json.loads((args.model_dir / SETTINGS_FILE).read_text())
    if "lora_base" not in settings or not (args.model_dir / ADAPTER_ONNX_FILE).is_file():
        raise SystemExit(f"{args.model_dir} has no adapter graph: build the variant again (make variants)")
    base = BaseShapes.from_json(settings["lora_base"])
    tokenizer = PromptTokenizer(args.model_dir)
    prompts = [tokenizer.encode(item["text_input"], apply_chat_template=True) for item in workload(args.requests)]
    adapters = random_adapters(base, args.adapters, args.rank, np.random.default_rng(1))
    spread = [adapters[r % (args.adapters + 1)] if r % (args.adapters + 1) < args.adapters else None
              for r in range(args.requests)]
    plain, with_lora = OnnxSlotDecoder(args.model_dir / ONNX_FILE), OnnxSlotDecoder(args.model_dir / ADAPTER_ONNX_FILE)
    none = [None] * args.requests
    cases = {
        "base": (plain, prompts, none),
        "adapter graph, base only": (with_lora, prompts, none),
        f"{args.adapters} adapters + base": (with_lora, prompts, spread),
        "one stream, base (= merged)": (plain, prompts[:1], [None]),
        "one stream, adapter": (with_lora, prompts[:1], adapters[:1]),
    }
    tokens_per_s(plain, prompts[:2], [None, None], 4)  # warm both sessions
    tokens_per_s(with_lora, prompts[:2], adapters[:2], 4)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (decoder, case_prompts, case_adapters) in cases.items():
            runs[name].append(tokens_per_s(decoder, case_prompts, case_adapters, args.max_tokens))
    median = {name: statistics.median(values) for name, values in runs.items()}
    mixed = median[f"{args.adapters} adapters + base"] / median["base"]
    stream = median["one stream, adapter"] / median["one stream, base (= merged)"]
    print(f"# LoRA through the engine: {args.model_dir.name}, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.adapters} random adapters of rank {args.rank} on every projection; {date.today()}, "
          f"{platform.processor() or platform.machine()}, medians of {args.repeats}")
    print("| case | tok/s (median) | runs | against its base |")
    print("| --- | --- | --- | --- |")
    for name, values in runs.items():
        against = median["one stream, base (= merged)"] if name.startswith("one stream") else median["base"]
        print(f"| {name} | {median[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"x{median[name] / against:.2f} |")
    print(f"mixed / base: {mixed:.2f} (target >= 0.70); one stream adapter / merged: {stream:.2f} (target >= 0.80)")
    if args.output:
        args.output.write_text(json.dumps({"runs": runs, "median": median, "mixed_ratio": mixed,
                                           "stream_ratio": stream, "args": {k: str(v) for k, v in vars(args).items()}},
                                          indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
