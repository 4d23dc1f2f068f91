"""Send a prompt file to the `ensemble` model concurrently and write one JSON line per answer.

    python -m scripts.clients.client scripts/clients/demo_prompts.jsonl --protocol grpc --concurrency 8 --output answers.jsonl

The prompt file is JSONL (each line a dict of ensemble inputs, at least "text_input") or plain text (one prompt
a line, with --max-tokens)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.clients.llm_client import PROTOCOLS, RequestError, make_client


def load_requests(path: Path, default_max_tokens: int) -> list[dict]:
    requests = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        request = json.loads(line) if path.suffix == ".jsonl" else {"text_input": line}
        request.setdefault("max_tokens", default_max_tokens)
        requests.append(request)
    return requests


def run(requests: list[dict], client, concurrency: int) -> tuple[list[dict], float]:
    """Returns one record per request (in order) and the wall time."""

    def one(request: dict) -> dict:
        try:
            completion = client.complete(request)
        except RequestError as error:
            return {**request, "error": str(error)}
        return {**request, "text_output": completion.text, "output_tokens": completion.output_tokens,
                "latency_s": round(completion.latency_s, 3)}

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, requests))
    return records, time.perf_counter() - started


def summary(records: list[dict], wall_s: float) -> str:
    tokens = sum(r.get("output_tokens", 0) for r in records)
    failed = sum("error" in r for r in records)
    return (f"{len(records)} requests ({failed} failed), {tokens} output tokens in {wall_s:.1f} s: "
            f"{tokens / wall_s:.1f} output tokens/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--protocol", choices=PROTOCOLS, default="http")
    parser.add_argument("--http-url", default="127.0.0.1:8000")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64, help="for requests that do not set it")
    parser.add_argument("--output", type=Path, default=None, help="JSONL file (default: stdout)")
    args = parser.parse_args(argv)
    records, wall_s = run(load_requests(args.prompts, args.max_tokens), make_client(
        args.protocol, args.http_url, args.grpc_url), args.concurrency)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if args.output:
        args.output.write_text(lines, encoding="utf-8")
    else:
        sys.stdout.write(lines)
    print(summary(records, wall_s), file=sys.stderr)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
