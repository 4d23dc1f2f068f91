"""KV-cache memory planner: bytes per token and the largest batch that fits a memory budget.

    python -m scripts.bench.plan_memory                                    # LLaMA-7B on an A100-80GB, fp16
    python -m scripts.bench.plan_memory --model smollm2-135m --memory-gb 24 --weight-dtype fp32 --kv-dtype fp32
    python -m scripts.bench.plan_memory --model path/to/config.json --memory-gb 80 --context 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from python_backend.engine.memory_planner import DTYPE_BYTES, PRESETS, ModelShape, kv_bytes_per_token, plan

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b", help=f"a preset ({', '.join(PRESETS)}) or a config.json")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="accelerator memory in GB (10^9 bytes)")
    parser.add_argument("--fractions", default="0.7,0.8", help="share of memory for weights + KV cache")
    parser.add_argument("--contexts", default="512,1024,2048,4096", help="tokens per sequence (prompt + output)")
    parser.add_argument("--weight-dtype", default="fp16", choices=DTYPE_BYTES)
    parser.add_argument("--kv-dtype", default="fp16", choices=DTYPE_BYTES)
    args = parser.parse_args(argv)
    shape = PRESETS.get(args.model) or ModelShape.from_hf_config(Path(args.model))
    per_token = kv_bytes_per_token(shape, args.kv_dtype)
    print(f"{shape.name}: {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim}, "
          f"{shape.num_parameters / 1e9:.2f} B parameters")
    print(f"KV cache: {per_token / 1024:.1f} KiB per token ({args.kv_dtype}); "
          f"weights {shape.num_parameters * DTYPE_BYTES[args.weight_dtype] / GIB:.2f} GiB ({args.weight_dtype}); "
          f"memory {args.memory_gb:g} GB\n")
    fractions = [float(f) for f in args.fractions.split(",")]
    print("| context | KV per sequence | " + " | ".join(f"max batch at {f:.0%}" for f in fractions) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in fractions) + " |")
    for context in (int(c) for c in args.contexts.split(",")):
        plans = [plan(shape, args.memory_gb * 1e9, f, context, args.weight_dtype, args.kv_dtype) for f in fractions]
        print(f"| {context} | {plans[0].kv_bytes_per_sequence / GIB:.3f} GiB | "
              + " | ".join(str(p.max_batch) for p in plans) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
