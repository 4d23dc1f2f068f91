"""Batch jobs through the Batch API, one server, one run (about 6 minutes here):

    python -m scripts.bench.batch_benchmark                 # QUANT=int4's folder
    python -m scripts.bench.batch_benchmark --lines 200     # shorter

- Throughput: N greedy chat requests (the benchmark's prompts, max_tokens 16) sent by 32 concurrent clients with the
  official `openai` client, then the same N as one batch through the Batch API (upload, create, poll, download):
  output tokens/s of each, and whether the answers are the same text.
- Priority: a steady live load (2 clients, each sending one streaming chat request after another) alone for
  --live-s seconds, then again while the N-line batch runs: time to first token p50/p95 of the live requests, and
  the batch's own completion, and how fast it went during the window against alone.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from python_backend.model_files import MODEL_DIR_ENV
from scripts.bench.workload import log, percentile, workload
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import variant_dir

MAX_TOKENS = 16
LIVE_CLIENTS = 2
LIVE_QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is two plus two?",
                  "Say hello in Spanish.", "What is the largest planet?", "Name a fruit that is yellow."]


def bodies(model: str, n: int, max_tokens: int = MAX_TOKENS) -> list[dict]:
    return [{"model": model, "messages": [{"role": "user", "content": r["text_input"]}], "max_tokens": max_tokens,
             "temperature": 0} for r in workload(n)]


def live_clients(client: OpenAI, model: str, until: threading.Event) -> list[float]:
    """LIVE_CLIENTS loops of streaming chat requests until ``until`` is set: their times to first token."""
    ttfts: list[float] = []

    def loop(offset: int) -> None:
        i = offset
        while not until.is_set():
            started = time.perf_counter()
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": LIVE_QUESTIONS[i % len(LIVE_QUESTIONS)]}],
                max_tokens=MAX_TOKENS, temperature=0, stream=True)
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            ttfts.append(first if first is not None else time.perf_counter() - started)
            i += LIVE_CLIENTS

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(LIVE_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts


def submit_batch(client: OpenAI, requests: list[dict]) -> str:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(requests)]
    upload = client.files.create(file=("bench.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                 purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_batch(client: OpenAI, batch_id: str) -> tuple[dict[str, str], int]:
    """Polls until the batch ends: (custom_id -> answer text, output tokens)."""
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"the benchmark batch ended {batch.status}: {batch.request_counts}")
    answers, tokens = {}, 0
    for text in client.files.content(batch.output_file_id).text.splitlines():
        line = json.loads(text)
        body = line["response"]["body"]
        answers[line["custom_id"]] = body["choices"][0]["message"]["content"]
        tokens += body["usage"]["completion_tokens"]
    return answers, tokens


def concurrent_clients(client: OpenAI, requests: list[dict]) -> tuple[list[str], int, float]:
    started = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda body: client.chat.completions.create(**body), requests))
    wall = time.perf_counter() - started
    return [a.choices[0].message.content for a in answers], sum(a.usage.completion_tokens for a in answers), wall


def run(model_dir: Path, n: int, live_s: float, batch_concurrency: int | None = None,
        max_tokens: int = MAX_TOKENS) -> dict:
    log(f"batch jobs: {n} lines, on {model_dir}")
    extra = ("--batch-concurrency", str(batch_concurrency)) if batch_concurrency else ()
    shutil.rmtree(BUILD_DIR / "benchmark-batch-data", ignore_errors=True)  # no batch left from an earlier run
    server_log = BUILD_DIR / "benchmark-batch-server.log"
    with running_server(log_path=server_log, env={MODEL_DIR_ENV: str(model_dir)}) as ports, \
            running_openai_api(f"127.0.0.1:{ports.grpc}", model_dir, BUILD_DIR / "benchmark-batch-api.log",
                               data_dir=BUILD_DIR / "benchmark-batch-data", extra_args=extra) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        requests = bodies(model, n, max_tokens)
        concurrent_clients(client, requests[:32])  # warm-up

        live_answers, live_tokens, live_wall = concurrent_clients(client, requests)
        log(f"32 concurrent clients: {live_tokens} tokens in {live_wall:.1f} s = {live_tokens / live_wall:.1f} tok/s")
        started = time.perf_counter()
        batch_answers, batch_tokens = wait_batch(client, submit_batch(client, requests))
        batch_wall = time.perf_counter() - started
        log(f"Batch API: {batch_tokens} tokens in {batch_wall:.1f} s = {batch_tokens / batch_wall:.1f} tok/s")
        same = sum(batch_answers[f"line-{i}"] == a for i, a in enumerate(live_answers))

        stop = threading.Event()
        threading.Timer(live_s, stop.set).start()
        alone = live_clients(client, model, stop)
        log(f"live alone: {len(alone)} requests, TTFT p95 {percentile(alone, 95):.3f} s")
        batch_id = submit_batch(client, requests)
        while client.batches.retrieve(batch_id).request_counts.completed < 32:  # the batch fills the engine first
            time.sleep(0.2)
        stop = threading.Event()
        threading.Timer(live_s, stop.set).start()
        window_started, done_before = time.perf_counter(), client.batches.retrieve(batch_id).request_counts.completed
        during = live_clients(client, model, stop)
        window = time.perf_counter() - window_started
        progress = client.batches.retrieve(batch_id)
        still_running = progress.status == "in_progress"
        lines_in_window = progress.request_counts.completed - done_before
        log(f"live during the batch: {len(during)} requests, TTFT p95 {percentile(during, 95):.3f} s")
        background_answers, _ = wait_batch(client, batch_id)
    return {
        "model_dir": str(model_dir), "lines": n, "max_tokens": max_tokens, "live_max_tokens": MAX_TOKENS,
        "batch_concurrency": batch_concurrency or 30,
        "throughput": {"clients_tokens": live_tokens, "clients_wall_s": live_wall,
                       "clients_tokens_per_s": live_tokens / live_wall, "batch_tokens": batch_tokens,
                       "batch_wall_s": batch_wall, "batch_tokens_per_s": batch_tokens / batch_wall,
                       "ratio": (batch_tokens / batch_wall) / (live_tokens / live_wall), "same_answers": same},
        "priority": {"live_clients": LIVE_CLIENTS, "window_s": live_s, "alone_requests": len(alone),
                     "alone_ttft_p50": percentile(alone, 50), "alone_ttft_p95": percentile(alone, 95),
                     "during_requests": len(during), "during_ttft_p50": percentile(during, 50),
                     "during_ttft_p95": percentile(during, 95),
                     "ratio_p95": percentile(during, 95) / percentile(alone, 95),
                     "batch_ran_throughout": still_running, "batch_completed_lines": len(background_answers),
                     "batch_lines_during_window": lines_in_window,
                     "batch_lines_per_s_during_window": lines_in_window / window,
                     "batch_lines_per_s_alone": n / batch_wall},
    }


def print_table(result: dict) -> None:
    t, p = result["throughput"], result["priority"]
    print(f"\nBatch jobs: {result['lines']} chat requests, greedy, max_tokens {result['max_tokens']}; the Batch API "
          f"keeps {result['batch_concurrency']} lines in flight")
    print("| | output tokens | wall (s) | output tok/s |")
    print("| --- | --- | --- | --- |")
    print(f"| 32 concurrent clients (openai) | {t['clients_tokens']} | {t['clients_wall_s']:.1f} | "
          f"{t['clients_tokens_per_s']:.1f} |")
    print(f"| one batch through the Batch API | {t['batch_tokens']} | {t['batch_wall_s']:.1f} | "
          f"{t['batch_tokens_per_s']:.1f} |")
    print(f"| Batch API / clients | | | x{t['ratio']:.2f} ({t['same_answers']}/{result['lines']} same answers) |")
    print(f"\nLive load ({p['live_clients']} streaming clients, {p['window_s']:.0f} s) alone and while the batch runs:")
    print("| | requests | TTFT p50 (s) | TTFT p95 (s) |")
    print("| --- | --- | --- | --- |")
    print(f"| alone | {p['alone_requests']} | {p['alone_ttft_p50']:.3f} | {p['alone_ttft_p95']:.3f} |")
    print(f"| with the batch running | {p['during_requests']} | {p['during_ttft_p50']:.3f} | "
          f"{p['during_ttft_p95']:.3f} |")
    print(f"| with / alone, p95 | | | x{p['ratio_p95']:.2f} |")
    print(f"(the batch was still running at the end of the window: {p['batch_ran_throughout']}; it then completed "
          f"all {p['batch_completed_lines']} lines)")
    print(f"(the batch during the window: {p['batch_lines_during_window']} lines, "
          f"{p['batch_lines_per_s_during_window']:.2f} lines/s, against {p['batch_lines_per_s_alone']:.2f} alone)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--live-s", type=float, default=30.0)
    parser.add_argument("--batch-concurrency", type=int,
                        help="the front's batch lines in flight (default: its own, 30); fewer trade batch "
                             "throughput for live latency")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="the batch lines' (and the 32 clients') max_tokens; the live requests keep 16")
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-batch.json")
    args = parser.parse_args(argv)
    result = run(args.model_dir, args.lines, args.live_s, args.batch_concurrency, args.max_tokens)
    args.output.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"\n(written to {args.output})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
