"""The service's one connection to Triton: a shared ``tritonclient.grpc.aio`` client, and one bidirectional gRPC stream
per choice to the decoupled ``ensemble`` model (its interface: docs/api.md; streaming: docs/architecture.md).

Every request carries the parameter ``tag_errors``, so the ensemble writes the error's code into its message
(``[INVALID_ARG] ...``, ``[UNAVAILABLE] ...``): over a gRPC stream Triton passes the message only, and the code is what
decides between a 400 and a 503. A request's stream ends with the response that carries ``finish_reason``;
``Generation.cancel()`` cancels the gRPC call before that, which makes the ensemble cancel the llm sequence."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from openai_api.errors import APIError, InvalidRequest, Unavailable
from openai_api.structured import Guide
from python_backend.errors import InvalidRequestError, UnavailableError, error_from_tagged

ENSEMBLE = "ensemble"
LLM = "llm"
CHECK_TIMEOUT_S = 2  # readiness and config look-ups


@dataclass
class EnsembleRequest:
    """One choice: what the ensemble is asked, in its own terms."""

    text: str
    max_tokens: int
    stream: bool
    temperature: float
    top_p: float | None = None
    seed: int | None = None
    prompt_ids: list[int] | None = None  # a conversation, templated and tokenized here; text is then its rendering
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    echo: bool = False
    log_probs: bool = False
    top_log_probs: int = 0
    prompt_log_probs: bool = False  # score the prompt (echo with logprobs): its tokens' log-probabilities
    cache_salt: str = ""
    guide: Guide | None = None  # structured output: the grammar the engine enforces
    priority: int = 0  # lower runs earlier; batch jobs' lines run with a positive one
    lora_name: str = ""  # the LoRA adapter to run with (empty: the base model)

    def inputs(self) -> list[grpcclient.InferInput]:
        tensors = [
            _tensor("text_input", np.array([[self.text.encode("utf-8")]], np.object_)),
            _tensor("max_tokens", np.array([[self.max_tokens]], np.int32)),
            _tensor("stream", np.array([[self.stream]], np.bool_)),
            _tensor("temperature", np.array([[self.temperature]], np.float32)),
            _tensor("apply_chat_template", np.array([[False]], np.bool_)),
            _tensor("return_num_input_tokens", np.array([[True]], np.bool_)),
            _tensor("return_num_output_tokens", np.array([[True]], np.bool_)),
        ]
        if self.prompt_ids is not None:
            tensors.append(_tensor("input_ids", np.array([self.prompt_ids], np.int32)))
        if self.top_p is not None:
            tensors.append(_tensor("top_p", np.array([[self.top_p]], np.float32)))
        if self.seed is not None:
            tensors.append(_tensor("seed", np.array([[self.seed]], np.uint64)))
        if self.stop:
            tensors.append(_tensor("stop_words", np.array([[s.encode("utf-8") for s in self.stop]], np.object_)))
        if self.presence_penalty:
            tensors.append(_tensor("presence_penalty", np.array([[self.presence_penalty]], np.float32)))
        if self.frequency_penalty:
            tensors.append(_tensor("frequency_penalty", np.array([[self.frequency_penalty]], np.float32)))
        if self.logit_bias:
            tensors.append(_tensor("logit_bias_ids", np.array([list(self.logit_bias)], np.int32)))
            tensors.append(_tensor("logit_bias_values", np.array([list(self.logit_bias.values())], np.float32)))
        if self.echo:
            tensors.append(_tensor("exclude_input_in_output", np.array([[False]], np.bool_)))
        if self.log_probs:
            tensors.append(_tensor("return_log_probs", np.array([[True]], np.bool_)))
        if self.top_log_probs:
            tensors.append(_tensor("num_top_log_probs", np.array([[self.top_log_probs]], np.int32)))
        if self.prompt_log_probs:
            tensors.append(_tensor("return_prompt_log_probs", np.array([[True]], np.bool_)))
        if self.cache_salt:
            tensors.append(_tensor("cache_salt", np.array([[self.cache_salt.encode("utf-8")]], np.object_)))
        if self.priority:
            tensors.append(_tensor("priority", np.array([[self.priority]], np.int32)))
        if self.lora_name:
            tensors.append(_tensor("lora_name", np.array([[self.lora_name.encode("utf-8")]], np.object_)))
        if self.guide:
            tensors.append(_tensor("guided_decoding_guide_type", np.array([[self.guide.type.encode()]], np.object_)))
            tensors.append(_tensor("guided_decoding_guide", np.array([[self.guide.text.encode("utf-8")]], np.object_)))
        return tensors


def _tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    datatype = "BYTES" if value.dtype == np.object_ else _DATATYPES[value.dtype.type]
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


_DATATYPES = {np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", np.bool_: "BOOL"}


@dataclass
class Piece:
    """One ensemble response: the text since the previous one, and, when asked, the tokens behind it."""

    text: str
    finish_reason: str | None = None
    input_tokens: int | None = None
    output_tokens: int = 0
    token_ids: list[int] | None = None
    token_logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    tool_calls: list[dict] | None = None  # OpenAI's, read from the text of a whole chat answer (openai_api.tools)
    # The first response of a prompt scored: per prompt token its log-probability (0.0 for the first) and top.
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None

    @classmethod
    def from_result(cls, result) -> Piece:
        out = _Outputs(result)
        input_tokens, output_tokens = out.numbers("num_input_tokens"), out.numbers("num_output_tokens")
        piece = cls(
            text=out.string("text_output") or "",
            finish_reason=out.string("finish_reason") or None,
            input_tokens=int(input_tokens[0]) if input_tokens is not None and input_tokens.size else None,
            output_tokens=int(output_tokens[0]) if output_tokens is not None and output_tokens.size else 0,
        )
        ids = out.numbers("output_ids")
        if ids is not None:
            piece.token_ids = ids.tolist()
            logprobs = out.numbers("output_log_probs")
            piece.token_logprobs = logprobs.tolist() if logprobs is not None else None
            top = out.numbers("top_log_probs")
            if top is not None:
                count = len(piece.token_ids)
                piece.top_logprobs = top.reshape(count, -1).tolist() if count else []
                piece.top_ids = out.numbers("top_log_prob_ids").reshape(count, -1).tolist() if count else []
        prompt = out.numbers("prompt_log_probs")
        if prompt is not None:
            piece.prompt_logprobs = prompt.tolist()
            top = out.numbers("prompt_top_log_probs")
            if top is not None:
                piece.prompt_top_logprobs = top.reshape(len(prompt), -1).tolist()
                piece.prompt_top_ids = out.numbers("prompt_top_log_prob_ids").reshape(len(prompt), -1).tolist()
        return piece

    @classmethod
    def join(cls, pieces: list[Piece]) -> Piece:
        """A whole answer from its pieces (one, unless the ensemble was asked to stream)."""
        if len(pieces) == 1:
            return pieces[0]
        joined = cls(text="".join(p.text for p in pieces), finish_reason=pieces[-1].finish_reason,
                     input_tokens=next((p.input_tokens for p in pieces if p.input_tokens is not None), None),
                     output_tokens=sum(p.output_tokens for p in pieces))
        for name in ("token_ids", "token_logprobs", "top_ids", "top_logprobs"):
            parts = [getattr(p, name) for p in pieces]
            if any(part is not None for part in parts):
                setattr(joined, name, [x for part in parts for x in (part or [])])
        for name in ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs"):  # the first response's
            setattr(joined, name, getattr(pieces[0], name))
        return joined


class _Outputs:
    """A response's output tensors, read from the raw bytes Triton's gRPC endpoint sends them in (tritonclient's
    as_numpy costs tens of microseconds an output, and this runs for every streamed token)."""

    def __init__(self, result):
        response = result.get_response()
        self._raw = {o.name: (o.datatype, raw) for o, raw in zip(response.outputs, response.raw_output_contents)}

    def string(self, name: str) -> str | None:
        """A one-element BYTES output (serialized as its 4-byte length, then the bytes)."""
        found = self._raw.get(name)
        return None if found is None or len(found[1]) < 4 else found[1][4:].decode("utf-8")

    def numbers(self, name: str) -> np.ndarray | None:
        """A numeric output, flattened."""
        found = self._raw.get(name)
        return None if found is None else np.frombuffer(found[1], _NUMPY[found[0]])


_NUMPY = {"INT32": np.int32, "UINT32": np.uint32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32}


class Generation:
    """One choice's ensemble responses, as Pieces, up to the one that carries finish_reason."""

    def __init__(self, call, url: str):
        self._call = call
        self._url = url
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Piece:
        if self.finished:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise APIError("Triton closed the stream before the answer was complete") from None
        except grpc.aio.AioRpcError as rpc_error:
            self.finished = True
            raise _rpc_error(rpc_error, self._url) from None
        if error is not None:
            self.finished = True
            raise model_error(error.message())
        piece = Piece.from_result(result)
        final = result.get_response().parameters.get("triton_final_response")
        if piece.finish_reason is not None or (final is not None and final.bool_param):
            self.finished = True
        return piece

    def cancel(self) -> None:
        """Before the final response: cancels the gRPC call, so the engine frees the sequence. After it: nothing."""
        if not self.finished:
            self.finished = True
            self._call.cancel()


# Triton's words for a model it has not loaded (yet): a server that restarts answers so until its models are in.
NOT_LOADED = ("Request for unknown model", "has no available versions", "is not ready")


def model_error(message: str) -> APIError:
    error = error_from_tagged(message)
    if isinstance(error, InvalidRequestError):
        return InvalidRequest(str(error))
    if isinstance(error, UnavailableError):
        return Unavailable(str(error))
    if any(words in message for words in NOT_LOADED):
        return Unavailable(f"The model is not loaded (a server starting again?): {message}")
    return APIError(f"The model failed: {message}")


def _rpc_error(error: grpc.aio.AioRpcError, url: str) -> APIError:
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"Triton is not reachable at {url}: {error.details()}")
    return APIError(f"Triton's gRPC stream failed: {error.code().name}: {error.details()}")


class TritonBackend:
    """The shared client (created on first use, inside the running event loop), readiness and the context length."""

    def __init__(self, url: str, max_position_embeddings: int | None = None):
        self.url = url
        self._max_position_embeddings = max_position_embeddings
        self._client: grpcclient.InferenceServerClient | None = None
        self._config: dict | None = None

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def generate(self, request: EnsembleRequest) -> Generation:
        """Starts the request at once; its responses come from the returned Generation."""
        message = {"model_name": ENSEMBLE, "inputs": request.inputs(), "parameters": {"tag_errors": True}}
        return Generation(self.client.stream_infer(_once(message)), self.url)

    async def control_adapter(self, name: str, path: str | None = None, unload: bool = False) -> None:
        """Loads (path) or unloads a LoRA adapter in the llm model, which answers once it is done; its refusal is
        raised as the APIError it maps to (400 for a folder that does not fit)."""
        inputs = [_tensor("lora_name", np.array([[name.encode("utf-8")]], np.object_)),
                  # keyed: an error comes back as a data response with its code tagged (python_backend/errors.py)
                  _tensor("request_key", np.array([[secrets.token_hex(16).encode()]], np.object_))]
        if path is not None:
            inputs.append(_tensor("lora_path", np.array([[path.encode("utf-8")]], np.object_)))
        if unload:
            inputs.append(_tensor("lora_unload", np.array([[True]], np.bool_)))
        try:
            async for result, error in self.client.stream_infer(_once({"model_name": LLM, "inputs": inputs})):
                if error is not None:
                    raise model_error(error.message())
                message = _Outputs(result).string("error")
                if message:
                    raise model_error(message)
                return
        except grpc.aio.AioRpcError as rpc_error:
            raise _rpc_error(rpc_error, self.url) from None
        raise APIError("Triton closed the stream before the llm model answered")

    async def problems(self) -> list[str]:
        """Why Triton cannot serve now (empty: it can)."""
        try:
            if not await self.client.is_server_ready(client_timeout=CHECK_TIMEOUT_S):
                return [f"Triton at {self.url} is not ready"]
            return [f"model '{model}' is not ready" for model in (ENSEMBLE, LLM)
                    if not await self.client.is_model_ready(model, client_timeout=CHECK_TIMEOUT_S)]
        except InferenceServerException as error:
            return [f"Triton at {self.url} does not answer: {error.message()}"]

    async def _llm_config(self) -> dict:
        """The llm model's config, read from Triton once."""
        if self._config is None:
            try:
                config = await self.client.get_model_config(LLM, as_json=True, client_timeout=CHECK_TIMEOUT_S)
            except InferenceServerException as error:
                raise Unavailable(f"Triton at {self.url} does not answer: {error.message()}") from None
            self._config = config["config"]
        return self._config

    async def context_length(self) -> int:
        """prompt + max_tokens must fit here: the llm model's max_context_length, capped by the model's
        max_position_embeddings, as the llm model caps it."""
        configured = int((await self._llm_config())["parameters"]["max_context_length"]["string_value"])
        return min(configured, self._max_position_embeddings or configured)

    async def max_batch_size(self) -> int:
        """The engine's decode batch: how many requests a client keeps in flight to fill it."""
        return int((await self._llm_config())["max_batch_size"])


async def _once(message: dict):
    yield message  # then the request stream is closed: Triton ends the call after the final response
