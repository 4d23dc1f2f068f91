"""A batch's input file read into lines: the whole file refused (400) when it is not a batch file for the endpoint
at all, each bad line kept with its own error for the error file, so that the rest of the batch runs."""

from __future__ import annotations

import json
from pathlib import Path

from openai_api.batch.store import Line, new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class BatchFileError(ValueError):
    """The input file cannot be a batch for this endpoint: batches.create answers 400 with this message."""


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def read_lines(path: Path, endpoint: str, max_lines: int, max_line_bytes: int) -> list[Line]:
    if endpoint not in ENDPOINTS:
        raise BatchFileError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    raw = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), start=1) if line.strip()]
    if not raw:
        raise BatchFileError("The input file has no lines: a batch file holds one JSON request per line")
    if len(raw) > max_lines:
        raise BatchFileError(f"The input file has {len(raw)} lines, more than the limit of {max_lines} per batch")
    lines, seen, parsed_any = [], set(), False
    for number, text in raw:  # numbered as in the file, blank lines counted
        line = _line(number, text, endpoint, max_line_bytes, seen)
        parsed_any |= line.request is not None or (line.result or {}).get("error", {}).get("code") != "invalid_json"
        lines.append(line)
    if not parsed_any:
        raise BatchFileError("The input file is not JSONL: no line is a JSON object (line 1 is not JSON)")
    return lines


def _line(number: int, text: bytes, endpoint: str, max_line_bytes: int, seen: set[str]) -> Line:
    def bad(code: str, message: str, custom_id=None) -> Line:
        return Line(number, custom_id, None, error_line(custom_id, code, f"line {number}: {message}"), failed=True)

    if len(text) > max_line_bytes:
        return bad("line_too_large", f"{len(text)} bytes, more than the limit of {max_line_bytes}")
    try:
        request = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        return bad("invalid_json", f"not JSON ({error})")
    if not isinstance(request, dict):
        return bad("invalid_json", "not a JSON object")
    url = request.get("url")
    if isinstance(url, str) and url != endpoint:
        raise BatchFileError(f"line {number}: url {url!r} does not match the batch's endpoint {endpoint}")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("invalid_line", "custom_id must be a non-empty string")
    if custom_id in seen:
        return bad("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", custom_id)
    seen.add(custom_id)
    unknown = set(request) - {"custom_id", "method", "url", "body"}
    if unknown:
        return bad("invalid_line", f"unknown fields {sorted(unknown)}", custom_id)
    if url is None:
        return bad("invalid_line", "url is required", custom_id)
    if request.get("method") != "POST":
        return bad("invalid_line", f"method must be POST, got {request.get('method')!r}", custom_id)
    if not isinstance(request.get("body"), dict):
        return bad("invalid_line", "body must be a JSON object", custom_id)
    return Line(number, custom_id, request["body"])
