"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with their HTTP status.

Everything that ends a request early raises an ``APIError``; the app turns it into a JSON response (or, once a stream
has started, into an SSE ``error`` event). A client's mistake is a 400 or 404, never a 500."""

from __future__ import annotations

RETRY_AFTER_S = 1


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class TooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Unavailable(APIError):
    """Triton's queue is full, the llm model is not running, or Triton cannot be reached: retry later."""

    status = 503
    type = "server_error"

    def __init__(self, message: str):
        super().__init__(message, code="service_unavailable")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)}


def unknown_model(model: str) -> NotFound:
    return NotFound(f"The model `{model}` does not exist", param="model", code="model_not_found")
