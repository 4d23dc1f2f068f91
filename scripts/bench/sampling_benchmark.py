"""What sampling costs the engine beside greedy decoding: the same prompts run in-process (the server's engine, no
server), greedy and then sampled (temperature 0.8, top_p 0.95, a seed per row), every row to max_tokens; output
tokens/s of each (the median of --repeats runs, alternating) and the ratio sampled / greedy.

    python -m scripts.bench.sampling_benchmark                  # build/model-fp32, 16 prompts x 64 tokens, 3 runs each
    python -m scripts.bench.sampling_benchmark --model-dir build/model-int4 --requests 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.factory import cpu_decoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.bench.workload import NEVER_WRITTEN, log, workload
from scripts.paths import EXPORT_DIR
from scripts.prepare.quantize import variant_dir

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def run(decoder, prompts: list[list[int]], max_tokens: int, sampled: bool) -> tuple[list[list[int]], float]:
    """Every prompt's output tokens and the seconds of one run of them all together (continuous batching)."""
    seqs = [Sequence(prompt_ids=list(ids), params=SamplingParams(
        max_tokens=max_tokens, end_ids=(NEVER_WRITTEN,), **({**SAMPLED, "seed": row} if sampled else {})))
        for row, ids in enumerate(prompts)]
    started = time.perf_counter()
    generate(decoder, seqs, strategy="continuous")
    return [s.output_ids for s in seqs], time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "fp32"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokenizer, decoder = PromptTokenizer(args.model_dir), cpu_decoder(args.model_dir / ONNX_FILE)
    prompts = [tokenizer.encode(r["text_input"], apply_chat_template=True) for r in workload(args.requests)]
    run(decoder, prompts[:2], 4, sampled=True)  # warm-up
    speeds = {"greedy": [], "sampled": []}
    for _ in range(args.repeats):
        for name in speeds:
            outputs, seconds = run(decoder, prompts, args.max_tokens, sampled=name == "sampled")
            speeds[name].append(sum(map(len, outputs)) / seconds)
            log(f"{name}: {speeds[name][-1]:.1f} output tok/s")
    greedy, sampled = (statistics.median(speeds[name]) for name in speeds)
    print(f"{args.model_dir.name}, {args.requests} rows x {args.max_tokens} tokens, median of {args.repeats} runs: "
          f"greedy {greedy:.1f} tok/s, sampled ({SAMPLED}) {sampled:.1f} tok/s, "
          f"sampled / greedy {sampled / greedy:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
