class InvalidRequestError(ValueError):
    """A request the server refuses: the message names the offending input and is returned to the client
    (HTTP 400 / gRPC INVALID_ARGUMENT)."""


class UnavailableError(RuntimeError):
    """The server cannot take the request now (a full queue): HTTP 503 / gRPC UNAVAILABLE; retry later."""


# Triton drops the error code of a response that a BLS caller receives (every error arrives as INTERNAL), so the
# llm model writes the code into the message of requests that come from the front model, which restores it.
_BY_TAG = {"INVALID_ARG": InvalidRequestError, "UNAVAILABLE": UnavailableError}


def tagged_message(error: Exception) -> str:
    for tag, kind in _BY_TAG.items():
        if isinstance(error, kind):
            return f"[{tag}] {error}"
    return f"{type(error).__name__}: {error}"


def error_from_tagged(message: str) -> Exception:
    for tag, kind in _BY_TAG.items():
        if message.startswith(f"[{tag}] "):
            return kind(message[len(tag) + 3:])
    if "Stub process" in message and "is not healthy" in message:  # Triton's words for a dead model process
        return UnavailableError(f"the llm model is not running ({message}); retry in a few seconds")
    return RuntimeError(message)
