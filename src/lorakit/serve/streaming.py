"""How a handler's reply reaches the client, within the limit on sequences in flight.

A handler checks its request and returns a ``Reply``: its body, a coroutine (one JSON response; a client that
disconnects cancels it, which aborts its requests) or an async iterator of chunks (server-sent events ``data: {...}``,
then ``data: [DONE]``; an error once the stream has started, whatever it is, is an error event in OpenAI's shape),
and the number of sequences it runs. The limit counts sequences, one per prompt and sample: a request that would
pass it is refused with a 429, never queued, and one that alone runs more than the limit with a 400. ``interleave``
merges the streams of a request's choices into one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lorakit.serve.protocol import ApiError

__all__ = ["ConcurrencyLimit", "Reply", "interleave", "respond"]

logger = logging.getLogger("lorakit.serve")
DONE = "data: [DONE]\n\n"


@dataclass
class Reply:
    """A checked request's response, not started: ``body`` is a coroutine of its JSON or an async iterator of its
    chunks (a stream); ``sequences``, how many sequences it runs (one per prompt and sample)."""

    body: Coroutine[Any, Any, Any] | AsyncIterator[dict]
    sequences: int = 1


class ConcurrencyLimit:
    """At most ``limit`` sequences in flight: a request that would pass it is refused at once (429), and one that
    alone runs more than the limit is refused always (400)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # only the event loop's thread changes it

    def check(self, sequences: int = 1) -> None:
        """ApiError 400 when ``sequences`` alone pass the limit, 429 when they do with those in flight."""
        if sequences > self.limit:
            raise ApiError(400, f"this request runs {sequences} sequences (prompts x n), more than this server runs "
                                f"at once ({self.limit}, --max-concurrent); send fewer prompts or a lower n", "n")
        if self.held + sequences > self.limit:
            raise ApiError(429, f"too many requests in flight (limit {self.limit} sequences, {self.held} running, "
                                f"this request runs {sequences}); retry later")

    @asynccontextmanager
    async def hold(self, sequences: int = 1):
        """Places for ``sequences`` while the block runs (checked first: never waits for them)."""
        self.check(sequences)
        self.held += sequences
        try:
            yield
        finally:
            self.held -= sequences


async def respond(request: Request, reply: Reply, limit: ConcurrencyLimit):
    """The response to send for ``reply``: its JSON, or a stream of its chunks."""
    if asyncio.iscoroutine(reply.body):
        return await _answer(request, reply, limit)
    limit.check(reply.sequences)  # refused while a 429 status can still be sent
    return StreamingResponse(_events(reply, limit), media_type="text/event-stream")


async def _answer(request: Request, reply: Reply, limit: ConcurrencyLimit):
    task = None
    try:
        async with limit.hold(reply.sequences):
            task = asyncio.ensure_future(reply.body)
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    return JSONResponse({}, 499)
            return task.result()
    finally:
        if task is None:
            reply.body.close()  # refused: never started


async def _events(reply: Reply, limit: ConcurrencyLimit) -> AsyncIterator[str]:
    try:
        async with limit.hold(reply.sequences):  # again: places may have been taken since
            async for chunk in reply.body:
                yield event(chunk)
    except ApiError as e:
        yield event(e.body())
    except Exception as e:  # noqa: BLE001 - a bug: the client still gets an error event, not a stream cut short
        logger.exception("a stream failed")
        yield event(ApiError(500, f"internal error ({type(e).__name__}); the server log has the details").body())
    yield DONE


def event(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


async def interleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several async iterators as they come, each with its iterator's index. An error in one ends
    them all (re-raised here); leaving early cancels the rest."""
    if len(streams) == 1:  # the common case, without a task and a queue per item
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, end, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the reader
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
