"""/v1/files and /v1/batches in OpenAI's shapes, for the official client's ``files`` and ``batches``. Each owner (an
API key) sees only its own files and batches: another's are 404, as if absent."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from openai_api.batch.config import BatchConfig
from openai_api.batch.input_file import BatchFileError, read_lines
from openai_api.batch.runner import ACTIVE, BatchRunner
from openai_api.batch.store import Store, batch_record
from openai_api.errors import APIError, InvalidRequest, NotFound, TooLarge

UPLOAD_CHUNK = 1 << 20


class TooManyBatches(APIError):
    status = 429
    type = "rate_limit_exceeded"


def owner(request: Request) -> str:
    return request.scope.get("state", {}).get("owner", "")


def batch_router(store: Store, runner: BatchRunner, config: BatchConfig) -> APIRouter:
    router = APIRouter()

    def file_or_404(request: Request, file_id: str):
        record = store.get_file(owner(request), file_id)
        if record is None:
            raise NotFound(f"No such File object: {file_id}", param="file_id")
        return record

    def batch_or_404(request: Request, batch_id: str) -> dict:
        record = store.get_batch(owner(request), batch_id)
        if record is None:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
        return record

    @router.post("/v1/files")
    async def upload(request: Request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > config.max_file_bytes + UPLOAD_CHUNK:
            raise TooLarge(f"The upload is {declared} bytes, more than the file limit of {config.max_file_bytes}")
        form = await request.form(max_files=1, max_fields=4)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise InvalidRequest(f"purpose must be 'batch' (this server keeps files for batches), got {purpose!r}",
                                     param="purpose")
            if upload is None or isinstance(upload, str):
                raise InvalidRequest("file is required (a multipart file field)", param="file")
            with tempfile.NamedTemporaryFile(dir=store.files_dir, delete=False, suffix=".part") as out:
                size = 0
                while chunk := await upload.read(UPLOAD_CHUNK):
                    size += len(chunk)
                    if size > config.max_file_bytes:
                        out.close()
                        Path(out.name).unlink(missing_ok=True)
                        raise TooLarge(f"The file is more than the limit of {config.max_file_bytes} bytes")
                    out.write(chunk)
            expires = int(time.time()) + config.retention_days * 86400
            record = await asyncio.to_thread(store.add_file, owner(request), upload.filename or "upload.jsonl",
                                             "batch", Path(out.name), size, expires)
        finally:
            await form.close()
        return record.openai()

    @router.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10000):
        records = await asyncio.to_thread(store.list_files, owner(request), purpose, max(1, min(limit, 10000)))
        return {"object": "list", "data": [r.openai() for r in records], "has_more": False}

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str):
        return file_or_404(request, file_id).openai()

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        file_or_404(request, file_id)
        await asyncio.to_thread(store.delete_file, owner(request), file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        record = file_or_404(request, file_id)
        return FileResponse(store.file_path(record.id), media_type="application/octet-stream",
                            filename=record.filename)

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise InvalidRequest("The body is not JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("The body must be a JSON object")
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument supplied: {sorted(unknown)[0]}",
                                 param=sorted(unknown)[0])
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise InvalidRequest(f"{name} is required (a string)", param=name)
        if body["completion_window"] != "24h":
            raise InvalidRequest("completion_window must be '24h'", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise InvalidRequest("metadata must be at most 16 string pairs (keys up to 64, values up to 512 "
                                 "characters)", param="metadata")
        file = file_or_404(request, body["input_file_id"])
        if file.bytes > config.max_file_bytes:
            raise TooLarge(f"The input file is {file.bytes} bytes, more than the limit of {config.max_file_bytes}")
        active = sum(n for status, n in (await asyncio.to_thread(store.status_counts)).items() if status in ACTIVE)
        if active >= config.max_active_batches:
            raise TooManyBatches(f"{active} batches are running, the limit (max_active_batches); retry when one ends")
        try:
            lines = await asyncio.to_thread(read_lines, store.file_path(file.id), body["endpoint"], config.max_lines,
                                            config.max_line_bytes)
        except BatchFileError as error:
            raise InvalidRequest(str(error), param="input_file_id") from None
        record = batch_record(file.id, body["endpoint"], lines, metadata, int(time.time()),
                              config.completion_window_s)
        await asyncio.to_thread(store.add_batch, owner(request), record, lines)
        runner.wake()
        return record

    @router.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None):
        records = await asyncio.to_thread(store.list_batches, owner(request), max(1, min(limit, 100)) + 1, after)
        data = records[:max(1, min(limit, 100))]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(records) > len(data)}

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str):
        return batch_or_404(request, batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        batch_or_404(request, batch_id)

        def cancel(current: dict) -> dict | None:
            if current["status"] not in ("validating", "in_progress"):
                return None
            return {**current, "status": "cancelling", "cancelling_at": int(time.time())}

        record = await asyncio.to_thread(store.change_batch, batch_id, cancel)
        runner.wake()
        if record["status"] not in ("cancelling", "cancelled"):
            return JSONResponse(InvalidRequest(f"Cannot cancel a batch with status {record['status']}").body(),
                                status_code=400)
        return record

    return router
