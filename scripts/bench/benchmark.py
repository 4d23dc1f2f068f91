"""Batching strategies side by side on one mixed workload, through the real server, with in-process baselines.

    python -m scripts.bench.benchmark                  # 32 concurrent greedy requests (about 5 minutes on 2 cores)
    python -m scripts.bench.benchmark --requests 8 --skip-sequential

Workload: N prompts of 5-60 tokens from loadtests/prompts.jsonl (English, Chinese, code, emoji; raw text, no chat
template), max_tokens cycling 16/32/64/128, greedy, stopping at EOS. Rows:
- plain onnxruntime loop, one at a time / one static batch of N: the textbook greedy loop with a KV cache, no
  engine and no server: left-pad the prompts to the longest, prefill once, decode every row until all have finished;
- engine without server, static / continuous: the server's engine run in-process on all N at once. The static
  strategy beats the plain loop only by prefilling in length-sorted chunks; what serving costs is the gap between
  "engine without server, continuous" and "server, continuous";
- server, one at a time: the requests sent sequentially through Triton (continuous strategy);
- server, <strategy>: all N sent at once over gRPC streaming, with the llm model switched to that strategy;
- OpenAI front: the same N requests as streaming /v1/completions (the official `openai` client) through the
  OpenAI-compatible service (openai_api/) in front of the same server, continuous strategy, each run paired with a
  gRPC streaming run right before it; printed with the ratios (output tokens/s, median TTFT) of the pairs. The
  TTFT the front adds is measured twice more: under the same load (runs of N concurrent requests, half through the
  front, half over gRPC, swapped every run; per request, front minus gRPC) and for one request alone (pairs).
Batched rows show the median of --repeats runs (by output tokens/s).
Also printed: the raw onnxruntime decode speed at batch N (one decode step, past length 128): the ceiling here.
With --variants (make benchmark gives all): the weight variants side by side through the server
(scripts/bench/variant_benchmark.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from python_backend.engine.core import open_kv_cache
from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ONNX_FILE, ModelSettings
from python_backend.runtime.factory import RUNTIMES, cpu_decoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.bench import peers, variant_benchmark
from scripts.bench.workload import Row, log, median_run, percentile, server_row, through_server, workload
from scripts.clients.llm_client import Completion, GrpcStreamClient
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.render_model_repository import repository_for
from scripts.launcher.server_metrics import read_metrics
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR, default_model_dir


def plain_cache(decoder, rows: int, reserved: int):
    """The decoder's own KV cache (padded batch, or slots for a fused graph) for rows of at most reserved tokens."""
    return open_kv_cache(decoder, SchedulerConfig(max_batch_size=rows, max_context_length=reserved,
                                                  kv_layout=getattr(decoder, "kv_layout", "padded")))


def plain_static_batch(decoder, sequences) -> float:
    """The textbook static batch, without the engine: pad every prompt to the longest, prefill once, then decode
    the whole batch (finished rows included) until every row has finished. Greedy. Returns padding waste."""
    reserved = [s.reserved_tokens() for s in sequences]
    batch = plain_cache(decoder, len(sequences), max(reserved))
    logits, computed, wasted = batch.prefill([s.prompt_ids for s in sequences], reserved)
    while True:
        tokens = logits.argmax(-1)
        for seq, token in zip(sequences, tokens):
            if not seq.finished:
                seq.append(int(token))
        finished = sum(s.finished for s in sequences)
        if finished == len(sequences):
            return wasted / computed
        logits = batch.step(tokens)
        computed, wasted = computed + batch.size, wasted + finished


def in_process(requests: list[dict], model_dir: Path, repeats: int) -> tuple[list[Row], float, list[int]]:
    tokenizer, decoder = PromptTokenizer(model_dir), cpu_decoder(model_dir / ONNX_FILE)
    eos = ModelSettings.load(model_dir).eos_token_ids

    def sequences():
        return [Sequence(prompt_ids=tokenizer.encode(r["text_input"], apply_chat_template=False),
                         params=SamplingParams(max_tokens=r["max_tokens"], end_ids=eos)) for r in requests]

    plain_static_batch(decoder, sequences()[:2])  # warm-up
    rows = []
    log(f"plain onnxruntime loop: {len(requests)} requests one at a time")
    seqs, started, latencies = sequences(), time.perf_counter(), []
    for seq in seqs:
        t = time.perf_counter()
        plain_static_batch(decoder, [seq])
        latencies.append(time.perf_counter() - t)
    rows.append(Row("plain onnxruntime loop, one at a time", sum(len(s.output_ids) for s in seqs),
                    time.perf_counter() - started, latency_p50=percentile(latencies, 50),
                    latency_p95=percentile(latencies, 95), padding_waste=0.0))
    answers_alone = [s.output_ids for s in seqs]

    def batched(name, run):
        log(f"{name}: {repeats} runs")
        # Only the plain loop hands every answer out at the end; the engine finishes each when it is done.
        plain = name.startswith("plain")
        runs = []
        for _ in range(repeats):
            seqs, started = sequences(), time.perf_counter()
            waste = run(seqs)
            wall = time.perf_counter() - started
            runs.append(Row(name, sum(len(s.output_ids) for s in seqs), wall, latency_p50=wall if plain else None,
                            latency_p95=wall if plain else None, padding_waste=waste))
            assert [s.output_ids for s in seqs] == answers_alone, f"{name} changed a greedy answer"
        log("  output tok/s of each run: " + ", ".join(f"{r.tokens_per_s:.1f}" for r in runs))
        rows.append(median_run(runs))

    batched(f"plain onnxruntime loop, static batch of {len(requests)}", lambda seqs: plain_static_batch(decoder, seqs))
    for strategy in ("static", "continuous"):
        batched(f"engine without server, {strategy}",
                lambda seqs, strategy=strategy: generate(decoder, seqs, strategy=strategy).padding_waste())
    # Raw decode: one step for a batch of N at past length 128.
    batch = plain_cache(decoder, len(requests), 128 + 8)
    batch.prefill([[1] * 128] * len(requests), [128 + 8] * len(requests))
    tokens = np.ones(len(requests), np.int64)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        batch.step(tokens)
        times.append(time.perf_counter() - t)
    raw = len(requests) / statistics.median(times[1:])
    return rows, raw, [len(ids) for ids in answers_alone]


def openai_stream(client, model: str, request: dict) -> Completion:
    """One request as a streaming completion (raw prompt, greedy) through the OpenAI front."""
    started, first, texts, tokens = time.perf_counter(), None, [], 0
    for chunk in client.completions.create(model=model, prompt=request["text_input"], temperature=0,
                                           max_tokens=request["max_tokens"], stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.perf_counter() - started
            texts.append(chunk.choices[0].text)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return Completion("".join(texts), tokens, time.perf_counter() - started, first, texts)


def openai_client(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)


def through_openai(requests: list[dict], base_url: str, model: str) -> tuple[list[Completion], float]:
    """The requests as streaming completions through the OpenAI front, all at once."""
    client = openai_client(base_url)
    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: openai_stream(client, model, r), requests))
    return results, time.perf_counter() - started


def ttft_added_under_load(requests: list[dict], grpc: str, base_url: str, model: str, runs: int) -> list[float]:
    """What the front adds to each request's TTFT when both paths share the same load: every run sends all N requests
    at once, half through the front and half over gRPC streaming (alternating by index, swapped from one run to the
    next, so that each request takes each path equally often); returns, per request, the median of its TTFTs through
    the front minus the median of its TTFTs over gRPC, in ms."""
    front_client, direct_client = openai_client(base_url), GrpcStreamClient(grpc)
    ttfts = {True: [[] for _ in requests], False: [[] for _ in requests]}
    for run in range(runs):
        def one(i: int) -> None:
            through_front = (i + run) % 2 == 0
            result = (openai_stream(front_client, model, requests[i]) if through_front
                      else direct_client.complete(requests[i]))
            if result.first_token_s is not None:  # None: no text (EOS first)
                ttfts[through_front][i].append(result.first_token_s)

        with ThreadPoolExecutor(len(requests)) as pool:
            list(pool.map(one, range(len(requests))))
    return [(statistics.median(front) - statistics.median(direct)) * 1000
            for front, direct in zip(ttfts[True], ttfts[False]) if front and direct]


def ttft_added_alone(request: dict, grpc: str, base_url: str, model: str, pairs: int) -> list[float]:
    """The same request sent alone, alternately over gRPC streaming and through the front; the TTFT differences of
    the pairs, in ms."""
    front_client, direct_client = openai_client(base_url), GrpcStreamClient(grpc)
    differences = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 else (False, True)
        ttft = {}
        for through_front in order:
            result = (openai_stream(front_client, model, request) if through_front
                      else direct_client.complete(request))
            ttft[through_front] = result.first_token_s
        differences.append((ttft[True] - ttft[False]) * 1000)
    return differences


def openai_front_rows(requests: list[dict], grpc: str, model_dir: Path, repeats: int) -> tuple[list[Row], str]:
    """Paired runs, gRPC streaming then the OpenAI front, on the continuous server, for output tokens/s; then the TTFT
    the front adds, under the same load and alone. Returns the two median rows and the lines to print."""
    model = json.loads((model_dir / "llm_settings.json").read_text())["model_name"]
    log_path = BUILD_DIR / "benchmark-openai.log"
    with running_openai_api(grpc, model_dir, log_path) as url:
        base_url = f"{url}/v1"
        through_openai(requests[:2], base_url, model)  # warm-up
        direct_runs, front_runs = [], []
        for _ in range(repeats):
            direct, wall = through_server(requests, grpc, concurrent=True)
            direct_runs.append(server_row("server, continuous, gRPC streaming (paired)", direct, wall, None))
            front, wall = through_openai(requests, base_url, model)
            front_runs.append(server_row("server, continuous, through the OpenAI front", front, wall, None))
            if [r.text for r in front] != [r.text for r in direct]:
                log("WARNING: the OpenAI front's greedy texts differ from gRPC streaming's")
        log(f"  TTFT under load: {2 * repeats} runs of {len(requests)} requests, half through the front")
        under_load = ttft_added_under_load(requests, grpc, base_url, model, runs=2 * repeats)
        alone_pairs = 20 * repeats
        log(f"  TTFT alone: {alone_pairs} pairs of one request")
        alone = ttft_added_alone({**requests[0], "max_tokens": 4}, grpc, base_url, model, alone_pairs)
    log("  gRPC output tok/s of each run: " + ", ".join(f"{r.tokens_per_s:.1f}" for r in direct_runs))
    log("  front output tok/s of each run: " + ", ".join(f"{r.tokens_per_s:.1f}" for r in front_runs))
    speed = statistics.median(f.tokens_per_s / d.tokens_per_s for d, f in zip(direct_runs, front_runs))
    ttft = statistics.median((f.ttft_p50 - d.ttft_p50) * 1000 for d, f in zip(direct_runs, front_runs))
    quartiles = np.percentile(under_load, [25, 75])
    lines = [f"OpenAI front vs gRPC streaming, {len(requests)} concurrent streams, median of {repeats} pairs of runs: "
             f"output tokens/s x{speed:.3f} ({(speed - 1) * 100:+.1f} %), median TTFT {ttft:+.1f} ms",
             f"TTFT the front adds, same load ({2 * repeats} runs of {len(requests)} concurrent streams, half through "
             f"the front): median over requests {statistics.median(under_load):+.1f} ms (quartiles "
             f"{quartiles[0]:+.1f} / {quartiles[1]:+.1f} ms)",
             f"TTFT the front adds, one request alone ({alone_pairs} pairs): median {statistics.median(alone):+.1f} ms"]
    return [median_run(direct_runs), median_run(front_runs)], "\n".join(lines)


def padding_counters(metrics_port: int, strategy: str) -> tuple[float, float]:
    values = read_metrics(f"127.0.0.1:{metrics_port}", strategy=strategy)
    return values.get("llm_padding_tokens_total", 0.0), values.get("llm_computed_tokens_total", 0.0)


def cpu_seconds() -> dict[str, float]:
    """CPU time used so far by this process (the client) and by the server's processes, by name."""
    import psutil

    me = psutil.Process()
    totals = {"benchmark client": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            cmdline, times = child.cmdline(), child.cpu_times()
        except psutil.Error:
            continue
        model = next((Path(a).parent.parent.name for a in cmdline if a.endswith("model.py")), None)
        name = f"{model} model" if model else Path(cmdline[0]).name if cmdline else child.name()
        totals[name] = totals.get(name, 0.0) + times.user + times.system
    return totals


def cpu_line(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    parts = [f"{name} {cpu:.1f} s" for name, cpu in sorted(used.items(), key=lambda kv: -kv[1]) if cpu >= 0.05]
    return (f"  CPU in these runs: {', '.join(parts)}; {sum(used.values()):.1f} of "
            f"{wall * os.cpu_count():.1f} CPU-seconds the machine had")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--strategies", default="continuous,dynamic,static")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each batched row; the table shows the median run by output tokens/s")
    parser.add_argument("--skip-sequential", action="store_true",
                        help="skip sending the requests one at a time through the server (slow)")
    parser.add_argument("--skip-openai", action="store_true", help="skip the OpenAI front's paired runs")
    parser.add_argument("--only-openai", action="store_true",
                        help="only the OpenAI front's paired runs (no in-process rows, no other strategies)")
    parser.add_argument("--model-dir", type=Path, default=default_model_dir())
    parser.add_argument("--runtime", default="onnxruntime", choices=RUNTIMES,
                        help="the server's llm runtime (the in-process baselines stay on onnxruntime's CPU provider)")
    parser.add_argument("--variants", help="also the weight variants side by side, e.g. export,fp32,int4 "
                                           "(scripts/bench/variant_benchmark.py), each served from its own folder")
    parser.add_argument("--export-dir", type=Path, default=EXPORT_DIR,
                        help="the fp32 export, beside which the variants' folders lie")
    parser.add_argument("--peers", action="store_true",
                        help="with --variants: llama.cpp's server and onnxruntime-genai's generator on the same "
                             "workload beside them (scripts/bench/peers.py; build once: make benchmark-peers)")
    parser.add_argument("--output", type=Path, help="default: build/benchmark.json (--only-openai: "
                                                     "build/benchmark-openai.json)")
    args = parser.parse_args(argv)
    args.output = args.output or BUILD_DIR / ("benchmark-openai.json" if args.only_openai
                                                           else "benchmark.json")
    requests = workload(args.requests)
    if args.only_openai:
        rows, raw_decode, lengths_alone = [], None, None
        args.strategies, args.skip_sequential = "", True
    else:
        rows, raw_decode, lengths_alone = in_process(requests, args.model_dir, args.repeats)
    front_line = None
    log_path = BUILD_DIR / "benchmark-server.log"
    with running_server(repository_for(args.runtime), log_path=log_path, explicit_models=SERVED_MODELS) as ports:
        http, grpc = f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}"
        for strategy in filter(None, args.strategies.split(",")):
            log(f"server: strategy {strategy}, {len(requests)} concurrent requests")
            reload_llm(http, max_batch_size=len(requests), batching_strategy=strategy,
                       static_batch_size=len(requests))
            through_server(requests[:2], grpc, concurrent=True)  # warm-up
            runs, cpu_before = [], cpu_seconds()
            for _ in range(args.repeats):
                before = padding_counters(ports.metrics, strategy)
                results, wall = through_server(requests, grpc, concurrent=True)
                after = padding_counters(ports.metrics, strategy)
                padded, computed = after[0] - before[0], after[1] - before[1]
                runs.append(server_row(f"server, {strategy}", results, wall, padded / computed if computed else None))
                if [r.output_tokens for r in results] != lengths_alone:
                    log(f"WARNING: {strategy} produced different output lengths than the in-process run")
            log("  output tok/s of each run: " + ", ".join(f"{r.tokens_per_s:.1f}" for r in runs))
            log(cpu_line(cpu_before, cpu_seconds(), sum(r.wall_s for r in runs)))
            rows.append(median_run(runs))
        if not args.skip_sequential:
            log("server: one at a time (continuous)")
            reload_llm(http, max_batch_size=len(requests), batching_strategy="continuous")
            results, wall = through_server(requests, grpc, concurrent=False)
            first_server_row = next(i for i, r in enumerate(rows) if r.runner.startswith("server"))
            rows.insert(first_server_row, server_row("server, one at a time", results, wall, None))
        if not args.skip_openai:
            log(f"OpenAI front: {len(requests)} concurrent streaming completions, paired with gRPC streaming")
            reload_llm(http, max_batch_size=len(requests), batching_strategy="continuous")
            front_rows, front_line = openai_front_rows(requests, grpc, args.model_dir, args.repeats)
            rows += front_rows
    if raw_decode is not None:
        print_table(rows, raw_decode, len(requests))
    variant_rows = []
    if args.variants:
        log(f"weight variants: {args.variants}")
        variant_rows = variant_benchmark.run(args.variants.split(","), args.export_dir, requests, args.repeats)
        print("\n" + variant_benchmark.table(variant_rows, len(requests)))
    peer_rows = []
    if args.peers:
        peer_rows = peers.peer_rows(requests)
        print("\n" + variant_benchmark.comparison_table(variant_rows, peer_rows, len(requests)))
    if front_line:
        print("\n" + front_line)
        if args.only_openai:
            for r in rows:
                print(f"  {r.runner}: {r.tokens_per_s:.1f} output tok/s, TTFT p50 {r.ttft_p50:.3f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"requests": len(requests), "raw_decode_tokens_per_s": raw_decode,
                                       "openai_front": front_line,
                                       "variants": [asdict(r) for r in variant_rows], "peers": peer_rows,
                                       "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows]},
                                      indent=2))
    log(f"wrote {args.output}")
    return 0


def print_table(rows: list[Row], raw_decode: float, n: int) -> None:
    def find(prefix):
        return next((r for r in rows if r.runner.startswith(prefix)), None)

    one = find("server, one at a time") or find("plain onnxruntime loop, one at a time")
    static = find("plain onnxruntime loop, static")

    def fmt(value, pattern="{:.2f}"):
        return "-" if value is None else pattern.format(value)

    print(f"\n{n} requests, {rows[0].output_tokens} useful output tokens each run; raw onnxruntime decode at batch "
          f"{n}: {raw_decode:.0f} tokens/s\n")
    print(f"| runner | output tok/s | vs {one.runner} | vs {static.runner} | TTFT p50 / p95 (s) | "
          "latency p50 / p95 (s) | padding waste |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.runner} | {r.tokens_per_s:.1f} | {r.tokens_per_s / one.tokens_per_s:.2f}x | "
              f"{r.tokens_per_s / static.tokens_per_s:.2f}x | {fmt(r.ttft_p50)} / {fmt(r.ttft_p95)} | "
              f"{fmt(r.latency_p50)} / {fmt(r.latency_p95)} | {fmt(r.padding_waste, '{:.1%}')} |")


if __name__ == "__main__":
    sys.exit(main())
