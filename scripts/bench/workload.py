"""The benchmarks' shared workload (load-test prompts, max_tokens cycling 16/32/64/128), its rows and statistics,
and the run of a workload through the server over gRPC streaming."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from loadtests.workload import DEFAULT_PROMPTS as LOAD_TEST_PROMPTS
from scripts.clients.llm_client import Completion, GrpcStreamClient

MAX_TOKENS_CYCLE = (16, 32, 64, 128)
# SmolLM2's last vocabulary entry, which it practically never writes: as end_id, generation runs to max_tokens (and,
# given to transformers as eos_token_id too, both stop at the same place on a model that does write it).
NEVER_WRITTEN = 49151


@dataclass
class Row:
    runner: str
    output_tokens: int
    wall_s: float
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    latency_p50: float | None = None
    latency_p95: float | None = None
    padding_waste: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def percentile(values, q):
    return float(np.percentile(values, q)) if values else None


def workload(n: int) -> list[dict]:
    rows = [json.loads(line) for line in LOAD_TEST_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if 5 <= r["prompt_tokens"] <= 60]
    if len(rows) < n:
        rows = (rows * (n // len(rows) + 1))
    return [{"text_input": r["text_input"], "max_tokens": MAX_TOKENS_CYCLE[i % 4], "apply_chat_template": False}
            for i, r in enumerate(rows[:n])]


def log(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


def median_run(runs: list[Row]) -> Row:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def through_server(requests: list[dict], grpc_url: str, concurrent: bool,
                   concurrency: int | None = None) -> tuple[list[Completion], float]:
    """Sends the requests one at a time, or all at once (concurrent), or ``concurrency`` at a time (each client sends
    its next request as soon as its answer is in: a sustained load)."""
    client = GrpcStreamClient(grpc_url)
    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(concurrency or len(requests)) as pool:
            results = list(pool.map(client.complete, requests))
    else:
        results = [client.complete(r) for r in requests]
    return results, time.perf_counter() - started


def server_row(name: str, results: list[Completion], wall: float, waste: float | None) -> Row:
    ttft = [r.first_token_s for r in results if r.first_token_s is not None]
    latency = [r.latency_s for r in results]
    return Row(name, sum(r.output_tokens for r in results), wall, percentile(ttft, 50), percentile(ttft, 95),
               percentile(latency, 50), percentile(latency, 95), waste)

