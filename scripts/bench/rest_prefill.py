"""The rests of prompts found in part in the prefix cache: one call for all the rows against one call a row.

    python -m scripts.bench.rest_prefill build/model-fp32 build/model-int4

For each variant folder and each shape (tokens cached, the range of the rests' lengths, rows): the rows' cached
prefixes are written into their slots, then their rests are computed one row a call (the engine before format 9's
graphs took a past for one row only) and all rows in one call (right-padded, query_seqlens); the median of
--repeats each, and the largest difference between the two calls' last logits (0: the same bits).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from python_backend.engine.kv_slots import SlotKVCache
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.factory import cpu_decoder

# (tokens cached, shortest and longest rest, rows): a long shared instruction with short user turns; the chat
# template's head with whole questions (prompts never seen); a mid-length prefix.
SHAPES = [(512, 20, 40, 16), (512, 30, 30, 32), (64, 10, 60, 8), (16, 80, 120, 16)]


def compare(cache: SlotKVCache, cached: int, shortest: int, longest: int, rows: int, repeats: int,
            rng: np.random.Generator) -> tuple[float, float, float]:
    """(ms one row a call, ms all rows in one call, max |difference| of their last logits)."""
    head = [int(t) for t in rng.integers(100, 30000, cached)]
    prompts = [head + [int(t) for t in rng.integers(100, 30000, int(rng.integers(shortest, longest + 1)))]
               for _ in range(rows)]
    cache.prefill([head], [len(head)])
    prefix = [np.array(view[:, :, :cached]) for view in cache.row(0)]
    cache.clear()

    def fill(row):
        for target, held in zip(row, prefix):
            target[:, :, :cached] = held

    def apart():
        logits = [cache.prefill([p], [len(p)], cached=[cached], fills=[fill])[0] for p in prompts]
        cache.clear()
        return np.concatenate(logits)

    def together():
        logits = cache.prefill(prompts, [len(p) for p in prompts], cached=[cached] * rows, fills=[fill] * rows)[0]
        cache.clear()
        return logits

    times = {}
    for name, call in (("apart", apart), ("together", together)):
        taken = []
        for _ in range(repeats):
            started = time.perf_counter()
            logits = call()
            taken.append(time.perf_counter() - started)
        times[name] = (statistics.median(taken) * 1000, logits)
    difference = float(np.abs(times["apart"][1] - times["together"][1]).max())
    return times["apart"][0], times["together"][0], difference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dirs", type=Path, nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for model_dir in args.model_dirs:
        decoder = cpu_decoder(model_dir / ONNX_FILE)
        if not getattr(decoder, "batches_rests", False):
            print(f"{model_dir}: its graph takes a rest after a past for one row a call (built before "
                  "query_seqlens: make model QUANT=... builds it again)")
            continue
        cache = SlotKVCache(decoder, max(s[3] for s in SHAPES), max(s[0] + s[2] for s in SHAPES))
        rng = np.random.default_rng(0)
        for cached, shortest, longest, rows in SHAPES:
            apart, together, difference = compare(cache, cached, shortest, longest, rows, args.repeats, rng)
            print(f"{model_dir.name}: {rows} rests of {shortest}-{longest} tokens after {cached} cached: one row a "
                  f"call {apart:.0f} ms, one call {together:.0f} ms (x{apart / together:.2f}); "
                  f"max |difference| of the logits {difference:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
