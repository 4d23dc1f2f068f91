"""Where a decode step's time goes, by operator type, from onnxruntime's own profiler.

    python -m scripts.bench.profile_decoder build/model build/model-int4 --batch 1

For each model folder: prefill a prompt of --past tokens (batch --batch) into the cache its graph writes (the
export's padded batch, or the fused graph's slots), time --steps decode steps, then profile as many and print the
operators' share of the step time (node kernel time summed by op type; "MatMulNBits" are the quantized weights,
"MatMul" the fp32 weights, attention and the int4 residuals). --no-profile: the step times alone. --rest K (a
fused graph): also the time of a prompt's rest of K tokens after the --past tokens, computed in a slot of its own as
the prefix cache's partial hits are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from python_backend.engine.core import open_kv_cache
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.factory import cpu_decoder


def profile(model_dir: Path, batch: int, past: int, steps: int,
            with_profiler: bool = True) -> tuple[dict[str, float], float, float]:
    """(microseconds per step by op type under the profiler, wall milliseconds per step without and with it)."""
    decoder = cpu_decoder(model_dir / ONNX_FILE)
    prompt = [1] + [100 + i % 1000 for i in range(past - 1)]
    reserved = past + 2 * steps + 8
    kv = open_kv_cache(decoder, SchedulerConfig(max_batch_size=batch, max_context_length=reserved,
                                                kv_layout=getattr(decoder, "kv_layout", "padded")))
    logits, _, _ = kv.prefill([prompt] * batch, [reserved] * batch)
    for _ in range(2):  # warm-up
        logits = kv.step(logits.argmax(-1))
    plain_ms = _timed_steps(kv, logits, steps)
    if not with_profiler:
        return {}, plain_ms, float("nan")
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path("build") / f"profile-{model_dir.name}")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(model_dir / ONNX_FILE), options, providers=["CPUExecutionProvider"])
    kv.decoder = type(decoder)(model_dir / ONNX_FILE, session=session)
    logits = kv.step(logits.argmax(-1))  # first run of the new session: not counted below
    wall_ms = _timed_steps(kv, logits, steps)
    trace = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
    first_counted = sorted(runs, key=lambda e: e["ts"])[1]["ts"]
    by_op: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_counted:
            by_op[event["args"]["op_name"]] += event["dur"] / steps
    return dict(by_op), plain_ms, wall_ms


def _timed_steps(kv, logits, steps: int) -> float:
    """Median milliseconds of one decode step. The cache grows by `steps` tokens."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = kv.step(logits.argmax(-1))
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1000


def rest_ms(model_dir: Path, past: int, rest: int, tries: int) -> float:
    """Median milliseconds of computing ``rest`` new tokens of one row after ``past`` cached ones (slot layout)."""
    decoder = cpu_decoder(model_dir / ONNX_FILE)
    if getattr(decoder, "kv_layout", "padded") != "slots":
        raise SystemExit(f"--rest needs a fused graph's slot cache; {model_dir} has the padded one")
    prompt = [1] + [100 + i % 1000 for i in range(past + rest - 1)]
    kv = open_kv_cache(decoder, SchedulerConfig(max_batch_size=1, max_context_length=past + rest, kv_layout="slots"))
    kv.prefill([prompt[:past]], [past + rest])
    new, mask = np.array([prompt[past:]], np.int64), np.ones((1, past + rest), np.int64)
    times = []
    for _ in range(tries + 2):  # the rest is written over the same positions each time; 2 warm-ups
        started = time.perf_counter()
        decoder.forward_in_place(new, mask, kv.row(0))
        times.append(time.perf_counter() - started)
    times = sorted(times[2:])
    return times[len(times) // 2] * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dirs", type=Path, nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--past", type=int, default=64, help="tokens already in the cache")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--no-profile", action="store_true", help="time the steps only")
    parser.add_argument("--rest", type=int, default=0, help="also time a prompt's rest of this many tokens")
    args = parser.parse_args(argv)
    Path("build").mkdir(exist_ok=True)
    for model_dir in args.model_dirs:
        by_op, plain_ms, wall_ms = profile(model_dir, args.batch, args.past, args.steps, not args.no_profile)
        if args.rest:
            print(f"{model_dir}: a rest of {args.rest} tokens after {args.past}, one row: "
                  f"{rest_ms(model_dir, args.past, args.rest, args.steps):.1f} ms")
        if args.no_profile:
            print(f"{model_dir}: batch {args.batch}, past {args.past}: {plain_ms:.1f} ms per decode step "
                  f"({args.batch * 1000 / plain_ms:.1f} tok/s)")
            continue
        kernels_ms = sum(by_op.values()) / 1000
        print(f"{model_dir}: batch {args.batch}, past {args.past}: {plain_ms:.1f} ms per decode step "
              f"({args.batch * 1000 / plain_ms:.1f} tok/s); under the profiler {wall_ms:.1f} ms, of which kernels "
              f"{kernels_ms:.1f} ms:")
        for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {op:<14} {us / 1000:6.2f} ms  {us / 1000 / kernels_ms:6.1%}")
        rest = sorted(by_op.values(), reverse=True)[args.top:]
        print(f"  {'other':<14} {sum(rest) / 1000:6.2f} ms  {sum(rest) / 1000 / kernels_ms:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
