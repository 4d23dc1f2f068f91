"""The llm model's runtimes side by side, in-process: the same engine (continuous batching) on the benchmark's
workload with each runtime, runs alternating so that a noisy machine slows each alike. Prints output tokens/s per
run, the medians, their ratio to the first runtime, and whether every runtime gave the first one's tokens.

    python -m scripts.bench.runtime_benchmark                                   # onnxruntime vs its IO-binding path, CPU
    python -m scripts.bench.runtime_benchmark --runtimes onnxruntime,onnxruntime-cuda,tensorrt   # on a GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ModelSettings
from python_backend.runtime.decoder import ServingLimits
from python_backend.runtime.factory import RuntimeSettings, open_decoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.bench.workload import workload
from scripts.paths import PROJECT_ROOT, default_model_dir

IO_BINDING = "+io_binding"  # suffix: onnxruntime on the CPU through IO binding, the cache in torch tensors


def settings_for(name: str) -> RuntimeSettings:
    runtime = name.removesuffix(IO_BINDING)
    return replace(RuntimeSettings(runtime=runtime), io_binding=name.endswith(IO_BINDING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", default=f"onnxruntime,onnxruntime{IO_BINDING}")
    parser.add_argument("--model-dir", type=Path, default=default_model_dir())
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    names = args.runtimes.split(",")
    limits = ServingLimits(max_batch_size=args.requests, max_prefill_tokens=1024, max_context_length=2048)
    decoders = {name: open_decoder(settings_for(name), args.model_dir, limits, PROJECT_ROOT) for name in names}
    tokenizer, eos = PromptTokenizer(args.model_dir), ModelSettings.load(args.model_dir).eos_token_ids
    requests = workload(args.requests)
    prompts = [tokenizer.encode(r["text_input"], apply_chat_template=False) for r in requests]

    def run(decoder) -> tuple[float, list[list[int]]]:
        sequences = [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=r["max_tokens"], end_ids=eos))
                     for p, r in zip(prompts, requests)]
        started = time.perf_counter()
        generate(decoder, sequences, strategy="continuous")
        elapsed = time.perf_counter() - started
        return sum(len(s.output_ids) for s in sequences) / elapsed, [s.output_ids for s in sequences]

    for decoder in decoders.values():
        run(decoder)  # warm-up
    speeds: dict[str, list[float]] = {name: [] for name in names}
    answers: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name in names:
            speed, answers[name] = run(decoders[name])
            speeds[name].append(speed)
            print(f"run {repeat + 1} {name}: {speed:.1f} output tokens/s", file=sys.stderr, flush=True)
    first = names[0]
    base = statistics.median(speeds[first])
    print(f"{len(requests)} requests, continuous batching, {args.repeats} alternating runs each, model "
          f"{args.model_dir}")
    print("| runtime | output tokens/s (median) | runs | vs first | same tokens as first |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        median = statistics.median(speeds[name])
        runs = ", ".join(f"{s:.1f}" for s in speeds[name])
        print(f"| {name} | {median:.1f} | {runs} | x{median / base:.2f} | {answers[name] == answers[first]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
