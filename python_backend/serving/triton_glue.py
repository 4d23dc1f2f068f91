"""The few lines every Python-backend model shares: parameters, per-request error handling, tensor access.

``pb_utils`` is passed in (it only exists inside the Triton stub), so this module imports without a server."""

from __future__ import annotations

import json

from python_backend.errors import InvalidRequestError, UnavailableError, tagged_message


def model_config(args: dict) -> dict:
    return json.loads(args["model_config"])


def parameters(args: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config(args).get("parameters", {}).items()}


def getter(pb_utils, request):
    def get(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


def request_parameters(request) -> dict:
    """The request's Triton parameters (gRPC/HTTP request "parameters"), e.g. {"tag_errors": true}."""
    try:
        return json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        return {}


def error_response(pb_utils, error: Exception, tag: bool = False):
    """A bad request becomes INVALID_ARG (HTTP 400), a full queue UNAVAILABLE (HTTP 503), each with its message;
    anything else an INTERNAL error. tag: the code is also written into the message ("[INVALID_ARG] ..."), for
    clients of a gRPC stream, which carries only the message (the OpenAI front asks for it)."""
    message = tagged_message(error) if tag else (
        str(error) if isinstance(error, (InvalidRequestError, UnavailableError)) else f"{type(error).__name__}: {error}")
    if isinstance(error, InvalidRequestError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
    if isinstance(error, UnavailableError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
