"""Where the load tests send their requests, how they read streamed answers, and the server's own words when one
fails. No Locust or gevent import here, so the tests can use it without patching grpcio.

Triton's HTTP endpoint says nothing about its gRPC port (GET /v2 gives name, version and extensions), so the gRPC
endpoint is derived from ``--host``: the same host, the HTTP port + 1, Triton's convention (8000/8001, and
``make serve HTTP_PORT=9000 GRPC_PORT=9001``). A guess is checked at start, before any request is sent."""

from __future__ import annotations

import json
from typing import Iterable, Iterator
from urllib.parse import urlsplit

OPENAI_PORT = 9000  # the OpenAI-compatible service's default port


class RequestFailed(Exception):
    """A request the server refused or failed; the message is the server's."""


class EndpointError(Exception):
    """An endpoint the load test cannot use; the message says what to pass instead."""


def _host_and_port(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url if "//" in url else f"//{url}")
    if not parts.hostname:
        raise EndpointError(f"no host in {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 literal
    return host, parts.port


def grpc_url_from_host(host: str | None) -> str:
    """host:port of Triton's gRPC endpoint beside the HTTP endpoint ``host`` (``--host``): its port + 1."""
    if not host:
        raise EndpointError("no --host to derive the gRPC endpoint from: pass --grpc-url HOST:PORT")
    name, port = _host_and_port(host)
    if port is None:
        raise EndpointError(f"--host {host} names no port, so the gRPC port cannot be derived: "
                            "pass --grpc-url HOST:PORT")
    return f"{name}:{port + 1}"


def openai_url_from_host(host: str | None) -> str:
    """Base URL of the OpenAI-compatible service: the host of ``--host``, port 9000."""
    if not host:
        raise EndpointError("no --host to derive the OpenAI service from: pass --openai-url http://HOST:PORT")
    return f"http://{_host_and_port(host)[0]}:{OPENAI_PORT}"


def error_text(error: BaseException) -> str:
    """What Locust should record for a failed request. Locust records repr(exception), and tritonclient's
    InferenceServerException has an empty repr ("InferenceServerException()"): its words are in message(),
    status() and debug_details()."""
    if callable(getattr(error, "message", None)) and callable(getattr(error, "status", None)):
        status = str(error.status() or "").removeprefix("StatusCode.")
        message = error.message() or (error.debug_details() if hasattr(error, "debug_details") else None)
        text = ": ".join(str(part) for part in (status, message) if part)
        return text or type(error).__name__
    if callable(getattr(error, "code", None)) and callable(getattr(error, "details", None)):  # grpc.RpcError
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, (RequestFailed, EndpointError)):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def http_error_text(status: int, body: bytes | str | None) -> str:
    """``HTTP <status>: <message>``, the message taken from Triton's ``{"error": "..."}`` (an SSE event from
    generate_stream), OpenAI's ``{"error": {"message": "..."}}``, or else the body itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        error = json.loads(text.strip().removeprefix("data:")).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        error = error.get("message")
    message = str(error) if error else text.strip()[:500]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def check_grpc(url: str, model: str, timeout_s: float = 10) -> None:
    """Raises EndpointError unless a Triton gRPC endpoint at url has `model` ready. A plain grpcio channel, closed
    once: tritonclient's client closes its channel in close() and again in __del__, and under gevent each close
    lowers grpcio's count of open channels; the extra one can stop the poller that other channels still use (seen:
    Locust hung at exit)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        try:
            reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelReady(
                service_pb2.ModelReadyRequest(name=model), timeout=timeout_s)
        except grpc.RpcError as error:
            raise EndpointError(f"no Triton gRPC endpoint at {url}: {error_text(error)}") from None
    if not reply.ready:
        raise EndpointError(f"the Triton gRPC endpoint at {url} has no model {model!r} ready")


def first_model_id(openai_url: str, timeout_s: float = 10) -> str:
    """The first model id of the OpenAI-compatible service's GET /v1/models."""
    import urllib.error
    import urllib.request

    url = f"{openai_url.rstrip('/')}/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            models = json.loads(response.read()).get("data") or []
    except urllib.error.HTTPError as error:
        raise EndpointError(f"GET {url}: {http_error_text(error.code, error.read())}") from None
    except (OSError, ValueError) as error:
        raise EndpointError(f"no OpenAI-compatible service at {openai_url} (GET {url}: {error_text(error)})") \
            from None
    if not models or not models[0].get("id"):
        raise EndpointError(f"GET {url} lists no model: pass --model")
    return models[0]["id"]


def sse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream's ``data:`` lines, up to OpenAI's ``data: [DONE]``. An
    ``{"error": ...}`` payload (Triton's string, OpenAI's object) raises RequestFailed with its message."""
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            raise RequestFailed(str(error.get("message", error) if isinstance(error, dict) else error))
        yield event


def chat_deltas(chunks: Iterable[dict]) -> Iterator[tuple[str, int]]:
    """(content, tokens) per chunk of a streamed chat completion. The API does not say how many tokens a chunk
    carries: 1 per content chunk, unless the chunk reports usage, then the rise in usage.completion_tokens. The
    usage chunk at the end (no content) carries the tokens not counted yet, so the tokens add up to its total."""
    counted = 0
    for chunk in chunks:
        choices = chunk.get("choices") or []
        content = ((choices[0].get("delta") or {}).get("content") or "") if choices else ""
        total = (chunk.get("usage") or {}).get("completion_tokens")
        tokens = total - counted if total is not None else int(bool(content))
        counted += tokens
        if content or tokens:
            yield content, tokens
