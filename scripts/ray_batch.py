"""Runs an OpenAI batch file through N servers on Ray Data: the batch runner's job (scripts/clients/run_batch.py) spread
over every replica of the server.

    python -m scripts.ray_batch --input in.jsonl --output out/ --servers http://h1:9000,http://h2:9000
    python -m scripts.ray_batch --input in.jsonl --output out/ --service triton-llm-headless:9000  # every pod

The lines, their checks and bad-line errors, the request (priority 1; retried with backoff on 503, 429, 502, 504 and
lost connections for up to --max-retry-s), the ordering of shared prefixes and the OpenAI output and error records
are run_batch's own. Ray Data reads the lines into blocks and maps them with an actor pool of one actor per server
(`num_cpus` --actor-cpus each): an actor keeps up to its server's `max_batch_size` (the model card's) requests in
flight with asyncio, and picks its server by index from a small assigner actor, which gives a restarted actor its old
server back. A worker killed mid-job is restarted by Ray (`max_restarts`) and its task re-run (`max_task_retries`).
A local Ray instance (no --ray-address) runs its workers at niceness 0, not Ray's 15: see init_ray.

Results are written by a Ray Data datasink as JSONL shards under --output: `part-NNNNN.jsonl` (output lines) and
`part-NNNNN.errors.jsonl` (error lines). Each write task writes to temporary names; the commit, once the whole map
is done, renames the shards of the write tasks that succeeded and deletes every other temporary file, so a retried
task leaves no second copy. The commit also checks the custom_ids across the shards and drops any second copy
(counted in the summary; Ray's retries have given none in the tests). Every custom_id appears exactly once across
the two kinds of shard; a bad line without one (null custom_id) appears once by its line number.

Ray's progress bars show the map; the summary gives lines done and failed, output tokens, wall time and tokens/s.
Exit codes: 0 when every line has its result, 1 when the run could not go on (no server, API key refused, a job
that Ray gave up on), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pandas as pd
import ray
from ray.data import ActorPoolStrategy
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from scripts.clients.run_batch import BatchLine, Fatal, order_key, parse_lines, send, server_concurrency

ACTOR_CPUS = 0.25  # the actors wait on HTTP: a fraction of a core each leaves the cores to the servers
MAX_RESTARTS = 5  # a killed actor is restarted this often, and each of its tasks retried as often
MAX_BLOCK_ROWS = 1024  # rows per block at most: what a task retried after a killed actor sends again
WRITE_TASKS = 1  # write tasks at once: a shard is small, and each worker process is a CPU-heavy start on a small node
TMP_PREFIX = ".tmp-"
WORKER_NICENESS_ENV = "RAY_worker_niceness"  # read by the raylet that ray.init starts


# --- the servers ---

def resolve_service(service: str) -> list[str]:
    """Every address a (headless) Service name resolves to, as OpenAI front URLs: host:port -> http://ip:port."""
    host, _, port = service.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--service must be host:port, not {service!r}")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = sorted({info[4][0] for info in infos})
    return [f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}" for ip in addresses]


async def _batch_sizes(urls: list[str], headers: dict, concurrency: int | None) -> list[int]:
    sizes = []
    for url in urls:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
            size = await server_concurrency(client)  # also checks that the server answers and takes the key
        sizes.append(concurrency or size)
    return sizes


@ray.remote(num_cpus=0)
class ServerAssigner:
    """Gives each map actor a server index: the least-taken one, and the same again to an actor Ray restarted."""

    def __init__(self, count: int):
        self.count, self.taken = count, {}

    def assign(self, actor_id: str) -> int:
        if actor_id not in self.taken:
            load = [list(self.taken.values()).count(i) for i in range(self.count)]
            self.taken[actor_id] = load.index(min(load))
        return self.taken[actor_id]


# --- the map: one actor per server ---

class ServerClient:
    """A Ray Data map actor: sends its rows to one server, at most that server's max_batch_size at a time."""

    def __init__(self, urls: list[str], sizes: list[int], assigner, headers: dict, max_retry_s: float,
                 timeout_s: float):
        actor_id = ray.get_runtime_context().get_actor_id()
        self.index = ray.get(assigner.assign.remote(actor_id))
        self.url, self.size = urls[self.index], sizes[self.index]
        self.headers, self.max_retry_s, self.timeout_s = headers, max_retry_s, timeout_s
        self.client = self.slots = None  # made in the actor's event loop, on the first call

    async def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        if self.client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.client = httpx.AsyncClient(base_url=self.url, headers=self.headers, limits=limits,
                                            timeout=httpx.Timeout(self.timeout_s, connect=10.0))
            self.slots = asyncio.Semaphore(self.size)
        rows = batch.to_dict("records")
        results = await asyncio.gather(*(self._one(row) for row in rows))
        return pd.DataFrame(results, columns=["custom_id", "ok", "output_tokens", "record"])

    async def _one(self, row: dict) -> dict:
        if row["record"]:  # a bad line: its error record was made when the file was read
            return {"custom_id": row["custom_id"], "ok": False, "output_tokens": 0, "record": row["record"]}
        line = BatchLine(int(row["number"]), row["custom_id"], row["url"], json.loads(row["body"]))
        async with self.slots:
            record, ok = await send(self.client, line, self.max_retry_s)
        tokens = (record["response"]["body"].get("usage") or {}).get("completion_tokens", 0) if ok else 0
        return {"custom_id": line.custom_id, "ok": ok, "output_tokens": tokens, "record": json.dumps(record)}


# --- the output: sharded JSONL, committed once ---

@dataclass
class Written:
    done: int = 0
    failed: int = 0
    output_tokens: int = 0
    duplicates: int = 0
    shards: int = 0


class JsonlShards(Datasink):
    """Output lines to part-NNNNN.jsonl and error lines to part-NNNNN.errors.jsonl under one folder, committed by
    renaming only when the write has succeeded; a custom_id already committed is dropped from later shards."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.written = Written()

    def write(self, blocks, ctx) -> dict:
        shard = f"part-{ctx.task_idx:05d}"
        attempt = uuid.uuid4().hex[:8]
        kinds = {True: (f"{shard}.jsonl", []), False: (f"{shard}.errors.jsonl", [])}
        ids, tokens = [], 0
        for block in blocks:
            for row in BlockAccessor.for_block(block).iter_rows(public_row_format=False):
                kinds[bool(row["ok"])][1].append(row["record"])
                ids.append(row["custom_id"] if row["custom_id"] else json.loads(row["record"])["error"]["message"])
                tokens += int(row["output_tokens"])
        files = []
        for final, records in kinds.values():
            if records:
                temporary = self.folder / f"{TMP_PREFIX}{attempt}-{final}"
                temporary.write_text("".join(record + "\n" for record in records), encoding="utf-8")
                files.append((str(temporary), final))
        return {"files": files, "ids": ids, "done": len(kinds[True][1]), "failed": len(kinds[False][1]),
                "tokens": tokens}

    def on_write_complete(self, write_result) -> None:
        seen: set[str] = set()
        for result in write_result.write_returns:
            repeated = seen.intersection(result["ids"])
            seen.update(result["ids"])
            for temporary, final in result["files"]:
                path = Path(temporary)
                if repeated:
                    kept = [text for text in path.read_text(encoding="utf-8").splitlines()
                            if _result_id(text) not in repeated]
                    path.write_text("".join(text + "\n" for text in kept), encoding="utf-8")
                path.replace(self.folder / final)
                self.written.shards += 1
            totals = self.written
            totals.duplicates += len(repeated)
            totals.done += result["done"]
            totals.failed += result["failed"]
            totals.output_tokens += result["tokens"]
        if self.written.duplicates:  # counts are per write task: take them from the files instead
            self.written.done, self.written.failed = _count_lines(self.folder)
        _remove_temporary(self.folder)

    def on_write_failed(self, error: Exception) -> None:
        _remove_temporary(self.folder)


def _result_id(text: str) -> str:
    record = json.loads(text)
    return record["custom_id"] if record.get("custom_id") else record["error"]["message"]


def _count_lines(folder: Path) -> tuple[int, int]:
    errors = sum(len(p.read_text().splitlines()) for p in folder.glob("part-*.errors.jsonl"))
    everything = sum(len(p.read_text().splitlines()) for p in folder.glob("part-*.jsonl"))
    return everything - errors, errors


def _remove_temporary(folder: Path) -> None:
    for path in folder.glob(f"{TMP_PREFIX}*"):
        path.unlink(missing_ok=True)


# --- the job ---

def rows(raw_lines) -> list[dict]:
    """The dataset's rows: bad lines first, each with its error record made; then the lines to send, in run_batch's
    order (shared prefixes together). The body travels as JSON text, so that Arrow needs no schema of it."""
    lines, bad = parse_lines(raw_lines)
    items = [{"number": 0, "custom_id": record["custom_id"] or "", "url": "", "body": "",
              "record": json.dumps(record)} for record in bad]
    items += [{"number": line.number, "custom_id": line.custom_id, "url": line.url, "body": json.dumps(line.body),
               "record": ""} for line in sorted(lines, key=order_key)]
    return items


def run(items: list[dict], output: Path, urls: list[str], sizes: list[int], args) -> Written:
    """Maps the rows through one actor per server and writes the shards; returns what was written."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    assigner = ServerAssigner.remote(len(urls))
    # A task maps its whole block in one call, and an actor runs two calls at once; all their rows share the actor's
    # semaphore, so the server's batch is refilled across a block's end as within a block. Blocks of at least two
    # server batches and at most MAX_BLOCK_ROWS (what a killed actor re-runs), two per actor at least.
    block_rows = min(MAX_BLOCK_ROWS, max(2 * max(sizes), -(-len(items) // (4 * len(urls)))))
    blocks = min(len(items), max(2 * len(urls), -(-len(items) // block_rows)))
    dataset = ray.data.from_items(items, override_num_blocks=blocks)
    with warnings.catch_warnings():  # max_restarts and max_task_retries have no named parameter in Ray 2.60 yet
        warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated", category=DeprecationWarning)
        results = dataset.map_batches(
            ServerClient, batch_size=None, batch_format="pandas",
            fn_constructor_kwargs={"urls": urls, "sizes": sizes, "assigner": assigner, "headers": headers,
                                   "max_retry_s": args.max_retry_s, "timeout_s": args.timeout_s},
            compute=ActorPoolStrategy(size=len(urls), max_tasks_in_flight_per_actor=2,
                                      max_concurrent_calls_per_actor=2),
            num_cpus=args.actor_cpus, max_restarts=args.max_restarts, max_task_retries=args.max_restarts)
    sink = JsonlShards(output)
    results.write_datasink(sink, ray_remote_args={"num_cpus": args.actor_cpus}, concurrency=WRITE_TASKS)
    return sink.written


def summary(written: Written, servers: int, wall_s: float) -> str:
    wall_s = max(wall_s, 1e-6)
    extra = f", {written.duplicates} duplicate results dropped" if written.duplicates else ""
    return (f"{written.done} done, {written.failed} failed on {servers} server{'s' * (servers != 1)}; "
            f"{written.output_tokens} output tokens in {wall_s:.1f} s: {written.output_tokens / wall_s:.1f} output "
            f"tokens/s, {(written.done + written.failed) / wall_s:.2f} lines/s; {written.shards} shards{extra}")


def init_ray(address: str | None = None, **kwargs) -> None:
    """ray.init, with the workers of a local instance at the servers' niceness. Ray starts its workers at niceness 15
    by default; on a machine whose cores a server keeps busy, that starves the map actor, which then refills the
    server's batch late: a median of 25 requests in flight of 32, and 0.84 of run_batch's tokens/s, against 0.92-0.96
    at niceness 0 (docs/performance.md, Ray Data). A cluster's own setting (address given) is left alone."""
    if address is None:
        os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    ray.init(address=address, include_dashboard=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.ray_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input", type=Path, required=True, help="an OpenAI batch file (JSONL)")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="a folder for the shards (on storage every Ray node sees)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--servers", help="the OpenAI fronts, comma-separated: http://h1:9000,http://h2:9000")
    where.add_argument("--service", help="host:port of a headless Service: every address it resolves to")
    parser.add_argument("--api-key", help="sent as a bearer token (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--concurrency", type=int,
                        help="requests in flight per server (default: its model card's max_batch_size)")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards already in --output")
    parser.add_argument("--max-retry-s", type=float, default=600.0,
                        help="how long one line may be retried on 503/429/502/504 and connection errors")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="one request's timeout (then retried)")
    parser.add_argument("--actor-cpus", type=float, default=ACTOR_CPUS, help="num_cpus of each actor and write task")
    parser.add_argument("--max-restarts", type=int, default=MAX_RESTARTS,
                        help="restarts of a killed actor, and retries of each of its tasks")
    parser.add_argument("--ray-address", help="an existing Ray cluster (default: $RAY_ADDRESS, else a local one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.concurrency is not None and args.concurrency < 1:
        print("--concurrency must be at least 1", file=sys.stderr)
        return 2
    output = args.output
    if output.exists() and any(output.glob("part-*")) and not args.overwrite:
        print(f"{output} holds shards already: pass --overwrite to replace them", file=sys.stderr)
        return 2
    try:
        urls = resolve_service(args.service) if args.service else [u.strip().rstrip("/")
                                                                    for u in args.servers.split(",") if u.strip()]
    except (ValueError, OSError) as error:
        print(f"no servers: {error}", file=sys.stderr)
        return 1
    if not urls:
        print("no servers given", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        sizes = asyncio.run(_batch_sizes(urls, headers, args.concurrency))
    except Fatal as fatal:
        print(f"stopped: {fatal}", file=sys.stderr)
        return 1
    with open(args.input, "rb") as file:
        items = rows(file)
    output.mkdir(parents=True, exist_ok=True)
    for path in list(output.glob("part-*")) + list(output.glob(f"{TMP_PREFIX}*")):
        path.unlink()
    print(f"{len(items)} lines through {len(urls)} servers ({', '.join(urls)}), in flight per server: "
          f"{', '.join(map(str, sizes))}", flush=True)
    if not ray.is_initialized():
        init_ray(args.ray_address or os.environ.get("RAY_ADDRESS"))
    started = time.monotonic()
    try:
        written = run(items, output, urls, sizes, args) if items else Written()
    except Exception as error:  # a job Ray gave up on (a UDF error: Fatal from a refused key, retries spent)
        print(f"stopped: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(summary(written, len(urls), time.monotonic() - started), flush=True)
    if written.done + written.failed != len(items):
        print(f"{len(items) - written.done - written.failed} lines have no result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
