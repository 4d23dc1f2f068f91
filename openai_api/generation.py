"""A request's choices on the ensemble: prompts x n, each its own gRPC stream, all started at once so that the engine
batches them. The first failure, or the client leaving, cancels every stream that is still running."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from openai_api.errors import APIError
from openai_api.responses import DONE, ChatLogprobs, CompletionLogprobs, Usage, _Format, sse
from openai_api.tools import CallStream
from openai_api.triton_backend import Generation, Piece

log = logging.getLogger("openai_api")


@dataclass
class Choice:
    index: int  # OpenAI's choice index: prompt_index * n + the choice's number among its prompt's n
    prompt_index: int
    generation: Generation
    logprobs: CompletionLogprobs | ChatLogprobs | None = None  # None: not asked
    calls: CallStream | None = None  # chat with tools: the answer may be tool calls
    started: bool = False  # its first chunk (the one with the role) is sent

    def chunk_logprobs(self, piece: Piece) -> dict | None:
        return self.logprobs.format(piece) if self.logprobs else None

    def release(self, piece: Piece) -> Piece | None:
        """The piece to answer with: as it came, or, with tools, the text held back so far or its calls; None while
        held back."""
        return self.calls.feed(piece) if self.calls else piece


def cancel_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.generation.cancel()


async def _each(choices: list[Choice], step):
    """step(choice) for every choice at once -> their results; any failure or cancellation cancels every stream."""
    if len(choices) == 1:  # the common case, without tasks
        try:
            return [await step(choices[0])]
        except BaseException:
            cancel_all(choices)
            raise
    tasks = [asyncio.ensure_future(step(choice)) for choice in choices]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        cancel_all(choices)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _whole(choice: Choice) -> Piece:
    return Piece.join([piece async for piece in choice.generation])


async def _first(choice: Choice) -> Piece:
    return await anext(choice.generation)


async def complete(choices: list[Choice], fmt: _Format) -> dict:
    """The whole answer of every choice, as one response body."""
    pieces = await _each(choices, _whole)
    usage = Usage()
    for choice, piece in zip(choices, pieces):
        usage.add(choice.prompt_index, piece)
    pieces = [choice.release(piece) for choice, piece in zip(choices, pieces)]
    return fmt.body([fmt.choice(c.index, p, c.chunk_logprobs(p)) for c, p in zip(choices, pieces)], usage)


async def first_pieces(choices: list[Choice]) -> list[Piece]:
    """Each choice's first response (or the first error): awaited before a stream's 200 is committed."""
    return await _each(choices, _first)


async def _following(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Piece]]:
    """The responses after the first ones, in the order they arrive."""
    live = [choice for choice in choices if not choice.generation.finished]
    if len(live) == 1:
        async for piece in live[0].generation:
            yield live[0], piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice):
        try:
            async for piece in choice.generation:
                queue.put_nowait((choice, piece, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((choice, None, error))
        else:
            queue.put_nowait((choice, None, None))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in live]
    try:
        remaining = len(live)
        while remaining:
            choice, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                remaining -= 1
            else:
                yield choice, piece
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(choices: list[Choice], firsts: list[Piece], fmt: _Format) -> AsyncIterator[bytes]:
    """SSE events: a chunk per response, the usage chunk if asked, then [DONE]. An error after the 200 is sent becomes
    an ``error`` event. Cancelled (the client left): every stream still running is cancelled."""
    usage = Usage()

    def events(choice: Choice, piece: Piece) -> list[bytes]:
        usage.add(choice.prompt_index, piece)
        piece = choice.release(piece)
        if piece is None:
            return []  # held back: it may be the start of tool calls
        first, choice.started = not choice.started, True
        if not (first or piece.text or piece.finish_reason or piece.token_ids):
            return []  # text held back (an unfinished UTF-8 character): nothing to say yet
        return [sse(fmt.chunk(c)) for c in fmt.chunk_choices(choice.index, piece, choice.chunk_logprobs(piece), first)]

    try:
        for choice, piece in zip(choices, firsts):
            for event in events(choice, piece):
                yield event
        async with aclosing(_following(choices)) as rest:
            async for choice, piece in rest:
                for event in events(choice, piece):
                    yield event
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(usage))
    except APIError as error:
        yield sse(error.body())
    except Exception as error:  # noqa: BLE001 - the stream has started: the client can only be told in it
        log.exception("stream failed")
        yield sse(APIError(f"{type(error).__name__}: {error}").body())
    finally:
        cancel_all(choices)
    yield DONE
