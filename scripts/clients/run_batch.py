"""Runs an OpenAI batch file against this project's OpenAI-compatible front, as vLLM's run_batch does, resumably.

    python -m scripts.run_batch -i in.jsonl -o out.jsonl [--url http://127.0.0.1:9000] [--api-key KEY]
                                [--concurrency N] [--resume | --overwrite] [--max-retry-s 600]

Each input line, `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"}`, is
sent with `"priority": 1` (batch work runs behind live requests) unless its body sets one. A 200 answer becomes an
OpenAI batch output line in the output file; a refused request (4xx, or a 5xx that outlived its retries) and a line
that is bad before sending go to the errors file beside it (out.jsonl -> out.errors.jsonl). Every custom_id appears
once across the two. 503, 429, 502, 504 and connection errors are retried with backoff for up to --max-retry-s.

Each result is appended in one write as it arrives, so an interrupted run loses only the lines in flight, and
`--resume` skips the custom_ids both files already hold. Lines run in an order that puts shared prompt prefixes
together, so that the server's prefix cache reuses them. Exit codes: 0 when every line has its result, 1 when the run
could not go on (no server, API key refused), 130 after Ctrl-C (SIGINT), 143 after SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
from tqdm import tqdm

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_PRIORITY = 1  # lower runs earlier; live requests have 0
DEFAULT_CONCURRENCY = 32  # when the model card has no max_batch_size
RETRIED_STATUSES = {429, 502, 503, 504}  # retried until --max-retry-s runs out
OTHER_5XX_RETRIES = 2  # a 500 is most likely the request's own fault: retried as often as the openai client does
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict


@dataclass
class Totals:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    output_tokens: int = 0

    def count(self, record: dict, ok: bool) -> None:
        if ok:
            self.done += 1
            self.output_tokens += (record["response"]["body"].get("usage") or {}).get("completion_tokens", 0)
        else:
            self.failed += 1


class Fatal(Exception):
    """A problem of the whole run, not of one line (no server, the API key refused): the run stops."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.run_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input-file", type=Path, required=True)
    parser.add_argument("-o", "--output-file", type=Path, required=True)
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the OpenAI front (default: %(default)s)")
    parser.add_argument("--api-key", help="sent as a bearer token (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--concurrency", type=int,
                        help=f"requests in flight (default: the model card's max_batch_size, or {DEFAULT_CONCURRENCY})")
    written = parser.add_mutually_exclusive_group()
    written.add_argument("--resume", action="store_true", help="skip the custom_ids already in the output files")
    written.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--max-retry-s", type=float, default=600.0,
                        help="how long one line may be retried on 503/429/502/504 and connection errors")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="one request's timeout (then retried)")
    return parser


def errors_path(output: Path) -> Path:
    return output.with_suffix(".errors.jsonl")


# --- the input file ---

def parse_lines(raw_lines) -> tuple[list[BatchLine], list[dict]]:
    """The valid lines, and an error record for each bad one (blank lines are ignored). A custom_id seen before is a
    duplicate: that line's record has custom_id null, so that each custom_id names exactly one result."""
    lines, errors, first_seen = [], [], {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            lines.append(parse_line(number, raw, first_seen))
        except BadLine as bad:
            errors.append(error_record(bad.custom_id, bad.code, f"line {number}: {bad}"))
    return lines, errors


class BadLine(ValueError):
    def __init__(self, message: str, custom_id: str | None = None, code: str = "invalid_line"):
        super().__init__(message)
        self.custom_id, self.code = custom_id, code


def parse_line(number: int, raw: bytes | str, first_seen: dict[str, int]) -> BatchLine:
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise BadLine(f"not JSON ({error})") from None
    if not isinstance(line, dict):
        raise BadLine("not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("custom_id must be a non-empty string")
    if custom_id in first_seen:
        raise BadLine(f"duplicate custom_id {custom_id!r} (first on line {first_seen[custom_id]})",
                      code="duplicate_custom_id")
    first_seen[custom_id] = number
    if line.get("method") != "POST":
        raise BadLine(f"method must be POST, not {line.get('method')!r}", custom_id)
    if line.get("url") not in ENDPOINTS:
        raise BadLine(f"url must be one of {', '.join(ENDPOINTS)}, not {line.get('url')!r}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise BadLine("body must be a JSON object", custom_id)
    if body.get("stream"):
        raise BadLine("a batch line cannot stream", custom_id)
    return BatchLine(number, custom_id, line["url"], body)


def order_key(line: BatchLine) -> tuple[str, str, str]:
    """Lines with the same key prefix run together: chat by every message but the last, then the last one's content;
    completions by the prompt."""
    body = line.body
    if line.url == "/v1/chat/completions":
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        last = messages[-1].get("content", "") if messages and isinstance(messages[-1], dict) else ""
        return line.url, json.dumps(messages[:-1]), last if isinstance(last, str) else json.dumps(last)
    prompt = body.get("prompt", "")
    return line.url, prompt if isinstance(prompt, str) else json.dumps(prompt), ""


# --- the output files ---

def read_done(path: Path) -> set[str | int]:
    """The results a file holds, by result_key. A last line cut short by a crash is cut off the file, so that
    appending starts on a fresh line."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as file:
            file.truncate(len(complete))
    done = set()
    for raw in complete.splitlines():
        try:
            done.add(result_key(json.loads(raw)))
        except (ValueError, AttributeError, TypeError):
            continue
    return done


def result_key(record: dict) -> str | int | None:
    """What a result is the result of: its custom_id, or for a bad line without one, its line number."""
    if record.get("custom_id") is not None:
        return record["custom_id"]
    match = re.match(r"line (\d+):", (record.get("error") or {}).get("message") or "")
    return int(match[1]) if match else None


class ResultFiles:
    """The output and errors files: each record is one unbuffered append, on disk as soon as it is written. The
    errors file is created with its first record."""

    def __init__(self, output: Path, append: bool):
        self.paths = {True: output, False: errors_path(output)}
        self.files = {True: open(output, "ab" if append else "wb", buffering=0)}
        if not append:
            errors_path(output).unlink(missing_ok=True)

    def write(self, record: dict, ok: bool) -> None:
        if ok not in self.files:
            self.files[ok] = open(self.paths[ok], "ab", buffering=0)
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[self.files[ok].write(data):]

    def close(self) -> None:
        for file in self.files.values():
            file.close()


def record_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def response_record(custom_id: str, response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    request_id = response.headers.get("x-request-id") or secrets.token_hex(16)
    return {"id": record_id(), "custom_id": custom_id,
            "response": {"status_code": response.status_code, "request_id": request_id, "body": body}, "error": None}


def error_record(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": record_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


# --- sending ---

def backoff_s(attempt: int) -> float:
    """0.5 s doubling to 30 s, each with jitter (a random half to all of it) so that retries do not come in waves."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** attempt) * random.uniform(0.5, 1.0)


async def send(client: httpx.AsyncClient, line: BatchLine, max_retry_s: float) -> tuple[dict, bool]:
    """Sends one line until it has a final answer; returns its record and whether it succeeded."""
    body = line.body if "priority" in line.body else {**line.body, "priority": BATCH_PRIORITY}
    deadline = time.monotonic() + max_retry_s
    for attempt in itertools.count():
        try:
            response = await client.post(line.url, json=body)
        except httpx.TransportError as error:  # connection refused or reset, timeouts
            response, problem = None, f"{type(error).__name__}: {error}"
        else:
            status, problem = response.status_code, f"HTTP {response.status_code}"
            if status == 401:
                raise Fatal(f"the server refused the API key (401): {response.text[:200]}")
            if status not in RETRIED_STATUSES and (status < 500 or attempt >= OTHER_5XX_RETRIES):
                record = response_record(line.custom_id, response)
                return record, status == 200 and isinstance(record["response"]["body"], dict)
        delay = max(backoff_s(attempt), retry_after_s(response))
        if time.monotonic() + delay > deadline:
            if response is not None:
                return response_record(line.custom_id, response), False
            return error_record(line.custom_id, "connection_error",
                                f"line {line.number}: {problem} (gave up after {max_retry_s:.0f} s)"), False
        await asyncio.sleep(delay)


def retry_after_s(response: httpx.Response | None) -> float:
    try:
        return min(float(response.headers.get("retry-after", "")), MAX_BACKOFF_S)
    except (AttributeError, ValueError):
        return 0.0


async def server_concurrency(client: httpx.AsyncClient) -> int:
    """The model card's max_batch_size (the engine's decode batch), else DEFAULT_CONCURRENCY. Also checks that a
    server answers, and takes the key."""
    try:
        response = await client.get("/v1/models")
    except httpx.TransportError as error:
        raise Fatal(f"no server answers at {client.base_url}: {type(error).__name__}: {error}") from None
    if response.status_code == 401:
        raise Fatal("the server refused the API key (401)")
    try:
        size = response.json()["data"][0]["max_batch_size"]
    except (ValueError, LookupError, TypeError):
        size = None
    return size if isinstance(size, int) and size > 0 else DEFAULT_CONCURRENCY


async def run_lines(todo: list[BatchLine], files: ResultFiles, totals: Totals, args) -> int | str | None:
    """Sends the lines, args.concurrency (or the server's) at a time, and writes each result as it comes. Returns
    why the run stopped early (the signal's number, or the fatal problem's message), or None when every line is
    done."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No pool limit: the workers are the limit (a pool's queue would wait outside the retry clock).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout, limits=limits) as client:
        concurrency = args.concurrency or await server_concurrency(client)
        pending = iter(todo)  # shared by the workers: each line goes to one
        progress = tqdm(total=len(todo), unit="req", dynamic_ncols=True, smoothing=0.1)
        started = time.monotonic()
        stopped: list[int | str] = []

        def stop(reason: int | str) -> None:
            stopped.append(reason)
            for task in workers:
                task.cancel()  # a cancelled request closes its connection: the front frees its sequence

        async def worker():
            try:
                for line in pending:
                    record, ok = await send(client, line, args.max_retry_s)
                    files.write(record, ok)
                    totals.count(record, ok)
                    progress.update(1)
                    progress.set_postfix_str(f"{totals.output_tokens / (time.monotonic() - started):.1f} tok/s",
                                             refresh=False)
            except Fatal as fatal:
                stop(str(fatal))

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(todo)))]
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop, signum)
        try:
            for result in await asyncio.gather(*workers, return_exceptions=True):
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            progress.close()
    return stopped[0] if stopped else None


def summary(totals: Totals, wall_s: float) -> str:
    wall_s = max(wall_s, 1e-6)
    sent = totals.done + totals.failed
    return (f"{totals.done} done, {totals.failed} failed, {totals.skipped} skipped (resumed); "
            f"{totals.output_tokens} output tokens in {wall_s:.1f} s: {totals.output_tokens / wall_s:.1f} output "
            f"tokens/s, {sent / wall_s:.2f} requests/s")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.url = args.url.rstrip("/")
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    output, errors = args.output_file, errors_path(args.output_file)
    if output == errors or (args.concurrency is not None and args.concurrency < 1):
        print("the output file must not end in .errors.jsonl, and --concurrency must be at least 1", file=sys.stderr)
        return 2
    existing = [str(path) for path in (output, errors) if path.exists()]
    if existing and not (args.resume or args.overwrite):
        print(f"{' and '.join(existing)} exist: pass --resume to go on, or --overwrite", file=sys.stderr)
        return 2
    with open(args.input_file, "rb") as file:
        lines, bad = parse_lines(file)
    done = read_done(output) | read_done(errors) if args.resume else set()
    todo = sorted((line for line in lines if line.custom_id not in done), key=order_key)
    new_bad = [record for record in bad if result_key(record) not in done]
    totals = Totals(failed=len(new_bad), skipped=len(lines) + len(bad) - len(todo) - len(new_bad))
    output.parent.mkdir(parents=True, exist_ok=True)
    files = ResultFiles(output, append=args.resume)
    started = time.monotonic()
    try:
        for record in new_bad:
            files.write(record, ok=False)
        stopped = asyncio.run(run_lines(todo, files, totals, args)) if todo else None
    except Fatal as fatal:
        stopped = str(fatal)
    except KeyboardInterrupt:  # before the run's own handler was in place
        stopped = signal.SIGINT
    finally:
        files.close()
    print(summary(totals, time.monotonic() - started), flush=True)
    if isinstance(stopped, int):
        print(f"interrupted: run again with --resume to finish ({output})", file=sys.stderr)
        return 128 + stopped  # 130 after Ctrl-C
    if stopped:
        print(f"stopped: {stopped}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
