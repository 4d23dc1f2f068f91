"""The service's own Prometheus metrics, on GET /metrics: requests by endpoint and HTTP status, and the time from a
request's arrival to the start of its response. A stream's 200 is sent only after Triton's first response
(app.py), so for streams that time is the time to first token as the client sees it, front included. And the
Batch API's: batches by status, batch lines ended, and their output tokens (a rate of it is the batch tokens/s)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/files", "/v1/batches")
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                  "cancelled")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ApiMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()  # one per app: tests create several apps in one process
        self.requests = Counter("openai_api_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.response_start = Histogram(
            "openai_api_response_start_seconds",
            "Arrival to the start of the response (for a stream: its first token)", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry)

        self.batches = Gauge("openai_api_batches", "Batches by status", ["status"], registry=self.registry)
        self.batch_lines = Counter("openai_api_batch_lines", "Batch lines ended, by result (completed: HTTP 200; "
                                   "failed: an error line)", ["result"], registry=self.registry)
        self.batch_output_tokens = Counter("openai_api_batch_output_tokens", "Output tokens of batch lines",
                                           registry=self.registry)

    # The batch runner's observer (openai_api/batch/runner.py).
    def line_done(self, ok: bool, output_tokens: int) -> None:
        self.batch_lines.labels("completed" if ok else "failed").inc()
        self.batch_output_tokens.inc(output_tokens)

    def batch_status(self, counts: dict[str, int]) -> None:
        for status in BATCH_STATUSES:
            self.batches.labels(status).set(counts.get(status, 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def endpoint_of(path: str) -> str | None:
    for prefix in ("/v1/models/", "/v1/files/", "/v1/batches/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return path if path in ENDPOINTS else None


class MetricsMiddleware:
    """ASGI middleware: counts each API request when its response starts (status known) and times it."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        endpoint = endpoint_of(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed_send(message):
            if message["type"] == "http.response.start":
                self.metrics.response_start.labels(endpoint).observe(time.perf_counter() - started)
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, timed_send)
