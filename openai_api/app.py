"""The OpenAI-compatible HTTP service in front of Triton's ``ensemble`` model (FastAPI).

POST /v1/completions and /v1/chat/completions (whole answers or SSE streams), GET /v1/models[/{id}], GET /health/ready
and /health/live; LoRA adapters are models whose parent is the base (a request's model picks one), loaded and unloaded
with vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A request is validated here as far as it can be
(fields, model id, context length) before it reaches Triton; what only the ensemble can judge comes back tagged and
keeps its status. A stream's 200 is sent only once every choice's first response is in, so an error the ensemble
finds is still a real 400 or 503. Chat messages are rendered with the model's own chat template here, and the
ensemble gets the rendered text as a raw prompt."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_api.auth import ApiKeyMiddleware, tenant_salt
from openai_api.batch.config import BatchConfig
from openai_api.batch.routes import batch_router, owner
from openai_api.batch.runner import BatchRunner, RunnerConfig
from openai_api.batch.store import Store
from openai_api.errors import APIError, InvalidRequest, NotFound, TooLarge, Unavailable, unknown_model
from openai_api.generation import Choice, complete, first_pieces, stream_events
from openai_api.metrics import ApiMetrics, MetricsMiddleware
from openai_api.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoraAdapterRequest,
                                 UnloadLoraAdapterRequest, parse_adapter_request, parse_request)
from openai_api.responses import ChatFormat, ChatLogprobs, CompletionFormat, CompletionLogprobs
from openai_api.token_text import TokenTexts
from openai_api.tools import CallStream, ToolUse, generic_messages, native_messages
from openai_api.triton_backend import EnsembleRequest, TritonBackend
from python_backend.model_files import DEFAULT_MODEL_DIR, SETTINGS_FILE, ModelSettings
from python_backend.serving.tokenization import PromptTokenizer

log = logging.getLogger("openai_api")
MAX_BODY_BYTES = 1 << 20  # the ensemble takes prompts of up to 64 KiB; this bounds the tokenization done here
DISCONNECT_POLL_S = 0.2  # how often a request that has not answered yet looks whether its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Named in the 404 of a route that is not served (OpenAI's Responses API, say).
SERVED_ROUTES = ("/v1/chat/completions, /v1/completions, /v1/models, /v1/files, /v1/batches, "
                 "/v1/load_lora_adapter and /v1/unload_lora_adapter")


@dataclass(frozen=True)
class ServiceConfig:
    triton_url: str = "127.0.0.1:8001"
    model_dir: Path = Path(DEFAULT_MODEL_DIR)  # relative to the working directory
    served_model_name: str | None = None  # default: llm_settings.json's model_name
    health_url: str | None = None  # e.g. the supervisor's http://127.0.0.1:8003/health/ready
    default_max_tokens: int | None = None  # chat without max_tokens; default: the rest of the context
    api_keys: tuple[str, ...] = ()  # none: the API is open (then bind it to loopback only)
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters the llm model loads at start: (name, path)
    batch: BatchConfig = BatchConfig()


class ClientGone(Exception):
    pass


class Service:
    def __init__(self, config: ServiceConfig):
        settings = ModelSettings.load(config.model_dir)
        self.config = config
        self.model = config.served_model_name or settings.model_name
        self.tokenizer = PromptTokenizer(config.model_dir)
        self.vocab_size = len(self.tokenizer.tokenizer)
        self.texts = TokenTexts(self.tokenizer.tokenizer)
        self.template_knows_tools = "tools" in str(self.tokenizer.tokenizer.chat_template or "")
        self.backend = TritonBackend(config.triton_url, settings.max_position_embeddings)
        self.created = int((Path(config.model_dir) / SETTINGS_FILE).stat().st_mtime)  # when the model was exported
        # LoRA adapters by name (the request's model), with the folder each was loaded from; the llm model holds them
        self.adapters: dict[str, str] = dict(config.lora_modules)

    def check_model(self, model: str) -> str:
        """The LoRA adapter a request's model names ("" for the base model); 404 for a model not served."""
        if model == self.model:
            return ""
        if model in self.adapters:
            return model
        raise unknown_model(model)

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "triton-llm"}

    def adapter_card(self, name: str) -> dict:
        """vLLM's card of an adapter: its base as parent, its folder as root."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "triton-llm",
                "parent": self.model, "root": self.adapters[name]}

    async def model_card_with_batch(self) -> dict:
        """The card, and (an extension) the engine's max_batch_size, from which batch runners size their
        concurrency; left out while Triton does not answer."""
        try:
            return {**self.model_card(), "max_batch_size": await self.backend.max_batch_size()}
        except Unavailable:
            return self.model_card()

    def render_chat(self, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
        """A conversation's prompt ids, by the model's own chat template, ready for the assistant's turn. The
        messages' contents are encoded as text: "<|im_start|>system" in a message does not open a system turn.
        Tools, and earlier calls, go to a template that knows them, or else in the generic format (openai_api.tools)."""
        if not self.tokenizer.has_chat_template:
            raise InvalidRequest("This model has no chat template: use /v1/completions", param="messages")
        try:
            if not self.template_knows_tools:
                return self.tokenizer.encode_conversation(generic_messages(messages, tools))
            if tools is None:
                return self.tokenizer.encode_conversation(native_messages(messages))
            shown = [{"type": "function", "function": f.signature()} for f in tools.functions]
            return list(self.tokenizer.tokenizer.apply_chat_template(  # encode_conversation's settings, and the tools
                native_messages(messages), tools=shown, add_generation_prompt=True, tokenize=True, return_dict=False,
                sanitize_control_tokens=True))
        except TemplateError as error:  # a template that refuses a conversation (roles out of order, ...)
            raise InvalidRequest(f"The chat template refused the messages: {error}", param="messages") from None

    async def problems(self) -> list[str]:
        problems = await self.backend.problems()
        if self.config.health_url:
            problem = await asyncio.to_thread(_health_url_problem, self.config.health_url)
            if problem:
                problems.append(problem)
        return problems

    async def budget(self, prompt: str | list[int], param: str, max_tokens: int | None,
                     default: int | None = None) -> int:
        """max_tokens for this prompt (text, or ids): as asked (it must fit the context with the prompt), else the
        default (capped by what is left), else what is left of the context."""
        context = await self.backend.context_length()
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(
            self.tokenizer.encode(prompt, apply_chat_template=False))
        left = context - prompt_tokens
        if left < 1:
            raise InvalidRequest(f"This model's maximum context length is {context} tokens. However, your prompt is "
                                 f"{prompt_tokens} tokens.", param=param)
        if max_tokens is None:
            return left if default is None else min(default, left)
        if max_tokens > left:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        return max_tokens


def _health_url_problem(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except OSError as error:  # HTTPError (a 503) included
        return f"{url}: {error}"


def create_app(config: ServiceConfig) -> FastAPI:
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        await runner.stop()
        store.close()
        await service.backend.close()

    app = FastAPI(title="OpenAI-compatible API for Triton", lifespan=lifespan, openapi_url=None)
    app.state.service = service
    metrics = ApiMetrics()
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)  # inside the metrics: 401s are counted
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        message = str(error.detail)
        if error.status_code == 404 and message == "Not Found":  # no such route: OpenAI's words, and what is served
            message = f"Invalid URL ({request.method} {request.url.path}): this server serves {SERVED_ROUTES}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("request failed")
        return JSONResponse(APIError(f"{type(error).__name__}: {error}").body(), status_code=500)

    async def completion_choices(raw: bytes, owner: str) -> tuple[list[Choice], CompletionFormat, bool]:
        body: CompletionRequest = parse_request(CompletionRequest, raw, service.vocab_size)
        lora_name = service.check_model(body.model)
        scored = body.scores_prompt
        # A token-id prompt is sent as its ids; its text (special tokens kept) is what echo puts in front. A text
        # prompt scored is tokenized here, as the ensemble would, so that its tokens can be named.
        ids = [p if isinstance(p, list) else service.tokenizer.encode(p, apply_chat_template=False) if scored else None
               for p in body.prompt]
        param = "prompt" if len(body.prompt) == 1 else "prompt[{}]"
        budgets = [await service.budget(prompt if prompt_ids is None else prompt_ids, param.format(p),
                                        body.completion_max_tokens)
                   for p, (prompt, prompt_ids) in enumerate(zip(body.prompt, ids))]
        shared = dict(stream=bool(body.stream), echo=bool(body.echo), log_probs=body.logprobs is not None,
                      top_log_probs=body.logprobs or 0, prompt_log_probs=scored, **body.sampling(),
                      cache_salt=tenant_salt(owner, body.cache_salt), lora_name=lora_name)
        n = body.choices_per_prompt
        texts = [p if isinstance(p, str) else service.tokenizer.tokenizer.decode(p, skip_special_tokens=False)
                 for p in body.prompt]

        def logprobs(prompt_ids: list[int] | None) -> CompletionLogprobs | None:
            if body.logprobs is None:
                return None
            return CompletionLogprobs(service.texts, prompt_ids if body.echo else None)

        choices = [
            Choice(p * n + j, p, service.backend.generate(
                EnsembleRequest(text, max_tokens, seed=body.seed_of(j), prompt_ids=prompt_ids, **shared)),
                logprobs(prompt_ids))
            for p, (prompt_ids, text, max_tokens) in enumerate(zip(ids, texts, budgets)) for j in range(n)
        ]
        return choices, CompletionFormat(body.model, body.include_usage), bool(body.stream)

    async def chat_choices(raw: bytes, owner: str) -> tuple[list[Choice], ChatFormat, bool]:
        body: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw, service.vocab_size)
        lora_name = service.check_model(body.model)
        tools = body.tool_use()
        prompt_ids = service.render_chat([m.template_message() for m in body.messages], tools)
        max_tokens = await service.budget(prompt_ids, "messages", body.requested_max_tokens,
                                          config.default_max_tokens)
        prompt = service.tokenizer.tokenizer.decode(prompt_ids)  # text_input, for its byte limit; not tokenized again
        logprobs = bool(body.logprobs)
        shared = dict(stream=bool(body.stream), log_probs=logprobs, top_log_probs=body.top_logprobs or 0,
                      **body.sampling(), cache_salt=tenant_salt(owner, body.cache_salt), lora_name=lora_name)
        choices = [
            Choice(j, 0, service.backend.generate(EnsembleRequest(prompt, max_tokens, prompt_ids=prompt_ids,
                                                                  seed=body.seed_of(j), **shared)),
                   ChatLogprobs(service.texts) if logprobs else None, CallStream(tools) if tools else None)
            for j in range(body.choices_per_prompt)
        ]
        return choices, ChatFormat(body.model, body.include_usage), bool(body.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, *await completion_choices(await read_body(request), owner(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, *await chat_choices(await read_body(request), owner(request)))

    async def batch_line(endpoint: str, body: dict, owner: str) -> tuple[int, dict]:
        """A batch line's body through the live endpoint's code, behind live requests (a positive priority)."""
        if body.get("stream"):
            return 400, InvalidRequest("stream is not supported in a batch", param="stream").body()
        priority = body.get("priority")
        if not (isinstance(priority, int) and priority > 0):
            body = {**body, "priority": config.batch.line_priority}
        build = chat_choices if endpoint == "/v1/chat/completions" else completion_choices
        try:
            choices, fmt, _ = await build(json.dumps(body).encode("utf-8"), owner)
            return 200, await complete(choices, fmt)
        except APIError as error:
            return error.status, error.body()
        except Exception as error:  # noqa: BLE001 - what a live request would get as a 500: final, not retried
            log.exception("batch line failed")
            return 500, APIError(f"{type(error).__name__}: {error}").body()

    store = Store(config.batch.data_dir)
    runner = BatchRunner(store, batch_line, RunnerConfig(concurrency=config.batch.concurrency,
                                                         retention_s=config.batch.retention_days * 86400),
                         observer=metrics)
    app.include_router(batch_router(store, runner, config.batch))

    @app.get("/v1/models")
    async def models():
        adapters = [service.adapter_card(name) for name in sorted(service.adapters)]
        return {"object": "list", "data": [await service.model_card_with_batch(), *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if service.check_model(model_id):
            return service.adapter_card(model_id)
        return await service.model_card_with_batch()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's route: the llm model reads and checks the PEFT folder (a 400 names what does not fit)."""
        body = parse_adapter_request(LoadLoraAdapterRequest, await read_body(request))
        if body.lora_name == service.model:
            raise InvalidRequest(f"{body.lora_name!r} is the base model's name", param="lora_name")
        # (another folder under a loaded name: the llm model's store refuses it, comparing the folders resolved)
        await service.backend.control_adapter(body.lora_name, path=body.lora_path)
        service.adapters[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = parse_adapter_request(UnloadLoraAdapterRequest, await read_body(request))
        if body.lora_name not in service.adapters:
            raise NotFound(f"The lora adapter '{body.lora_name}' cannot be found", param="lora_name",
                           code="model_not_found")
        await service.backend.control_adapter(body.lora_name, unload=True)
        del service.adapters[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health/ready")
    async def ready():
        problems = await service.problems()
        if problems:
            return JSONResponse({"ready": False, "reason": "; ".join(problems)}, status_code=503)
        return {"ready": True}

    @app.get("/health/live")
    async def live():
        return {"live": True}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise TooLarge(f"The request body is {declared} bytes, more than {MAX_BODY_BYTES}")
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise TooLarge(f"The request body is {len(body)} bytes, more than {MAX_BODY_BYTES}")
    return body


async def respond(request: Request, choices: list[Choice], fmt, stream: bool | None) -> Response:
    try:
        if not stream:
            return JSONResponse(await _unless_disconnected(request, complete(choices, fmt)))
        firsts = await _unless_disconnected(request, first_pieces(choices))
    except ClientGone:
        return Response(status_code=499)
    return EventStream(stream_events(choices, firsts, fmt), media_type="text/event-stream", headers=SSE_HEADERS)


class EventStream(StreamingResponse):
    """Closes its events generator however the response ends (Starlette leaves it to the garbage collector when the
    client's disconnect interrupts a send), so the generator's Triton streams are cancelled at once."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, work):
    """Awaits work, looking every DISCONNECT_POLL_S whether the client is gone; if it is, cancels the work (which
    cancels its Triton streams) and raises ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
