"""How a handler's reply reaches the client, within the limit on requests in flight.

A reply is a coroutine (one JSON response; a client that disconnects cancels it, which aborts its requests) or
an async iterator of chunks (server-sent events ``data: {...}``, then ``data: [DONE]``; an error once the stream
has started is an error event in OpenAI's shape). A request beyond ``max_concurrent`` in flight is refused with a
429, never queued. ``interleave`` merges the streams of a request's choices into one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lorakit.serve.protocol import ApiError

__all__ = ["ConcurrencyLimit", "Reply", "interleave", "respond"]

Reply = Coroutine[Any, Any, Any] | AsyncIterator[dict]
DONE = "data: [DONE]\n\n"


class ConcurrencyLimit:
    """At most ``limit`` requests in flight; one more is refused at once with a 429."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = asyncio.Semaphore(limit)

    def check(self) -> None:
        """ApiError 429 when no place is free."""
        if self._free.locked():
            raise ApiError(429, f"too many requests in flight (limit {self.limit}); retry later")

    @asynccontextmanager
    async def hold(self):
        """A place while the block runs (checked first: never waits for one)."""
        self.check()
        async with self._free:
            yield


async def respond(request: Request, reply: Reply, limit: ConcurrencyLimit):
    """The response to send for ``reply``: its JSON, or a stream of its chunks."""
    if asyncio.iscoroutine(reply):
        return await _answer(request, reply, limit)
    limit.check()  # refused while a 429 status can still be sent
    return StreamingResponse(_events(reply, limit), media_type="text/event-stream")


async def _answer(request: Request, reply: Coroutine, limit: ConcurrencyLimit):
    task = None
    try:
        async with limit.hold():
            task = asyncio.ensure_future(reply)
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    return JSONResponse({}, 499)
            return task.result()
    finally:
        if task is None:
            reply.close()  # refused: never started


async def _events(chunks: AsyncIterator[dict], limit: ConcurrencyLimit) -> AsyncIterator[str]:
    try:
        async with limit.hold():  # again: a place may have been taken since
            async for chunk in chunks:
                yield event(chunk)
    except ApiError as e:
        yield event(e.body())
    yield DONE


def event(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


async def interleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several async iterators as they come, each with its iterator's index. An error in one ends
    them all (re-raised here); leaving early cancels the rest."""
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
