"""Runs batches in the background of live traffic, in the API process: every line's body goes through the same code
as a live request (the handler), with a positive priority, so the engine serves waiting live requests first.

One asyncio task per active batch; at most ``concurrency`` lines in flight across all batches (the engine's rows
that batch work may take). A line whose request failed for a transient reason (503: a full queue, the engine
recovering; a lost connection to Triton) is retried with backoff until the batch's window closes; any other answer is
final and recorded at once. On start, batches that were validating, in progress, finalizing or cancelling go on where
they stopped: only lines without a recorded result run."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from openai_api.batch.input_file import error_line
from openai_api.batch.store import Line, Store, new_id

log = logging.getLogger("openai_api.batch")

# (endpoint, body, owner) -> (HTTP status, JSON body), as the live endpoint would answer.
Handler = Callable[[str, dict, str], Awaitable[tuple[int, dict]]]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
TRANSIENT = (429, 502, 503, 504)


def count_line(record: dict, status: int) -> dict:
    """The record with one more completed (200) or failed line in request_counts."""
    counts = dict(record["request_counts"])
    counts["completed" if status == 200 else "failed"] += 1
    return {**record, "request_counts": counts}


@dataclass(frozen=True)
class RunnerConfig:
    concurrency: int = 30  # lines in flight, all batches together
    retry_first_s: float = 0.5
    retry_max_s: float = 30.0
    retention_s: int = 30 * 86400  # ended batches, their files and uploaded files are deleted after this


def prefix_key(body: dict) -> tuple[str, str]:
    """Lines that share a prompt prefix sort together, so the prefix cache reuses it while it is warm."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        return json.dumps(messages[:-1], sort_keys=True), str(last.get("content") if isinstance(last, dict) else last)
    return "", json.dumps(body.get("prompt"))


class BatchRunner:
    def __init__(self, store: Store, handler: Handler, config: RunnerConfig = RunnerConfig(), observer=None):
        self.store, self.handler, self.config = store, handler, config
        self.observer = observer  # gets line_done(ok: bool, output_tokens: int) and batch_status(counts)
        self._slots = asyncio.Semaphore(config.concurrency)
        self._tasks: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        # The flag as well as the cancel: Python 3.11's wait_for swallows a cancel that arrives as the event it waits
        # on is set (a batch that ends wakes the loop), and the loop would then go on, and stop() wait for ever.
        self._stopping = True
        tasks = list(self._tasks.values()) + ([self._loop_task] if self._loop_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        last_sweep = 0.0
        while not self._stopping:
            for record in await asyncio.to_thread(self.store.batches_in, ACTIVE):
                if record["id"] not in self._tasks:
                    self._tasks[record["id"]] = asyncio.create_task(self._run_logged(record["id"]))
            if time.monotonic() - last_sweep > 3600:
                last_sweep = time.monotonic()
                await asyncio.to_thread(self.sweep, int(time.time()))
            if self.observer is not None:
                self.observer.batch_status(await asyncio.to_thread(self.store.status_counts))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=5)
            except asyncio.TimeoutError:
                pass

    async def _run_logged(self, batch_id: str) -> None:
        try:
            await self._run(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one batch's fault must not stop the others
            log.exception("batch %s failed", batch_id)
            record = await asyncio.to_thread(self.store.get_batch, None, batch_id)
            if record is not None:
                await self._set(record, "failed", errors={"object": "list", "data": [
                    {"code": "server_error", "message": "the batch runner failed; see the server log", "line": None}]})
        finally:
            self._tasks.pop(batch_id, None)
            self.wake()

    async def _run(self, batch_id: str) -> None:
        record = await asyncio.to_thread(self.store.get_batch, None, batch_id)
        owner = await asyncio.to_thread(self.store.batch_owner, batch_id)
        if record["status"] == "validating":
            record = await self._set(record, "in_progress")
        if record["status"] == "in_progress":
            await self._update_counts(batch_id)  # after a crash the record may lag the lines: counted once here
            pending = await asyncio.to_thread(self.store.pending_lines, batch_id)
            pending.sort(key=lambda line: prefix_key(line.request))
            lines = [asyncio.create_task(self._line(record, owner, line)) for line in pending]
            try:
                await asyncio.gather(*lines)
            finally:
                for task in lines:
                    task.cancel()
            record = await asyncio.to_thread(self.store.get_batch, None, batch_id)
            if record["status"] == "in_progress":
                # Lines left without a result only when the window closed on them.
                if time.time() > record["expires_at"] or await asyncio.to_thread(self.store.pending_lines, batch_id):
                    await self._finish(record, owner, "expired")
                    return
                record = await self._set(record, "finalizing")
        await self._finish(record, owner, {"finalizing": "completed", "cancelling": "cancelled"}[record["status"]])

    async def _line(self, record: dict, owner: str, line: Line) -> None:
        batch_id, delay = record["id"], self.config.retry_first_s
        while True:
            if self._closed(batch_id):
                return
            async with self._slots:
                if self._closed(batch_id):
                    return
                status, body = await self._call(record["endpoint"], line.request, owner)
            if status not in TRANSIENT:
                break
            left = record["expires_at"] - time.time()
            if left <= 0:
                return  # the window closed: the batch expires, and this line gets its batch_expired error line
            await asyncio.sleep(min(delay * (0.5 + random.random()), left))
            delay = min(2 * delay, self.config.retry_max_s)
        result = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": body.get("id") or new_id("req_"), "body": body},
                  "error": None}
        if await asyncio.to_thread(self.store.finish_line, batch_id, line.line, result, status != 200):
            if self.observer is not None:
                self.observer.line_done(status == 200, (body.get("usage") or {}).get("completion_tokens", 0))
            await asyncio.to_thread(self.store.change_batch, batch_id, lambda current: count_line(current, status))

    async def _call(self, endpoint: str, body: dict, owner: str) -> tuple[int, dict]:
        try:
            return await self.handler(endpoint, body, owner)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a lost connection to Triton: transient
            log.warning("batch line failed: %s: %s", type(error).__name__, error)
            return 503, {"error": {"message": f"{type(error).__name__}: {error}", "type": "server_error",
                                   "param": None, "code": None}}

    def _closed(self, batch_id: str) -> bool:
        """Cancelled, or past its window: no new line starts."""
        record = self.store.get_batch(None, batch_id)
        return record is None or record["status"] != "in_progress" or time.time() > record["expires_at"]

    async def _update_counts(self, batch_id: str) -> None:
        """request_counts recounted from the lines (a scan of the batch's lines: at a start and at status changes;
        each finished line adds itself, count_line)."""
        counts = await asyncio.to_thread(self.counts, batch_id)
        await asyncio.to_thread(self.store.change_batch, batch_id, lambda record: {**record, "request_counts": counts})

    def counts(self, batch_id: str) -> dict:
        total, completed, failed = self.store.counts(batch_id)
        return {"total": total, "completed": completed, "failed": failed}

    async def _finish(self, record: dict, owner: str, ending: str) -> None:
        """Writes the output and error files from the recorded lines, then the batch ends (completed, cancelled, or
        expired: then each line left gets an error line). Until then its status stays active, so that a crash
        here finalizes it again at the next start."""
        batch_id = record["id"]
        if ending == "expired":
            for line in await asyncio.to_thread(self.store.pending_lines, batch_id):
                await asyncio.to_thread(self.store.finish_line, batch_id, line.line, error_line(
                    line.custom_id, "batch_expired", "This line was not executed before the batch expired."), True)
        files = await asyncio.to_thread(self._write_files, batch_id, owner)
        await self._set(record, ending, **files)

    def _write_files(self, batch_id: str, owner: str) -> dict:
        ids = {}
        expires = int(time.time()) + self.config.retention_s
        for failed, key, suffix in ((False, "output_file_id", "output"), (True, "error_file_id", "error")):
            results = self.store.results(batch_id, failed)
            if not results:
                ids[key] = None
                continue
            with tempfile.NamedTemporaryFile("w", dir=self.store.files_dir, delete=False, suffix=".part") as out:
                out.writelines(json.dumps(r) + "\n" for r in results)
            file_id = f"file-{batch_id}-{suffix}"
            self.store.delete_file(owner, file_id)  # a finalize cut short by a crash left one: write it again
            ids[key] = self.store.add_file(owner, f"{batch_id}_{suffix}.jsonl", f"batch_{suffix}", Path(out.name),
                                           Path(out.name).stat().st_size, expires, file_id).id
        return ids

    async def _set(self, record: dict, status: str, **fields) -> dict:
        """Moves the batch to ``status``, unless someone else moved it first (a cancel while it was validating):
        returns the record as it now is."""
        expected = record["status"]
        counts = await asyncio.to_thread(self.counts, record["id"])

        def change(current: dict) -> dict | None:
            if current["status"] != expected:
                return None
            stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                     "failed": "failed_at", "expired": "expired_at", "cancelled": "cancelled_at"}.get(status)
            return {**current, **fields, "status": status, "request_counts": counts,
                    **({stamp: int(time.time())} if stamp else {})}

        return await asyncio.to_thread(self.store.change_batch, record["id"], change)

    def sweep(self, now: int) -> None:
        """Retention: ended batches and files older than retention_s are deleted."""
        for record in self.store.batches_in(ENDED):
            if record["created_at"] + self.config.retention_s < now:
                self.store.delete_batch(record["id"])
        for file in self.store.expired_files(now):
            self.store.delete_file(file.owner, file.id)
