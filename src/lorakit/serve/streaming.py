"""How a handler's reply reaches the client, within the limits on what is in flight.

A ``Reply`` is one JSON response or a stream of server-sent events; ``ConcurrencyLimit`` refuses (429, never
queued here) what would pass the sequences or tokens in flight. A ``Push`` stream writes each output's events on the
pass that delivers the engine's step; only a client that reads slowly is fed by a task, what it missed merged. An
output whose events cannot be made ends its stream alone with a 400 error event. Details: docs/serve-internals.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from lorakit.engine.outputs import Unread
from lorakit.frontend.streams import undeliverable
from lorakit.serve.protocol import ApiError

__all__ = ["ConcurrencyLimit", "Push", "Reply", "outputs", "pulled", "respond"]

logger = logging.getLogger("lorakit.serve")
DONE = b"data: [DONE]\n\n"
ERROR_EVENT = b'data: {"error"'  # how an error event starts (``event`` of ``ApiError.body()``)
LEAST_TOKENS = 2  # the fewest a sequence can occupy: one prompt token and one generated
RELEASES_SECONDS = 10.0  # how far back Retry-After's estimate looks at the requests that ended
MAX_RETRY_AFTER = 60  # seconds; an estimate past a minute says little more than "later"


@dataclass
class Reply:
    """A checked request's response, not started: ``body`` is a coroutine of its JSON or an async iterator of its
    chunks (a stream); ``sequences``, how many sequences it runs (one per prompt and sample); ``tokens``, what they
    can occupy in the KV cache together (each one's prompt and max_tokens, fitted to the context)."""

    body: Coroutine[Any, Any, Any] | AsyncIterator[dict]
    sequences: int = 1
    tokens: int = 0
    push: Push | None = None  # a stream's events as its outputs come (``body`` is ``pulled(push)``)


@dataclass
class Push:
    """How a stream's events are made: ``first``, the chunks before any output; ``start(listener)`` submits its
    ``jobs`` jobs, whose outputs go to ``listener(i, out)`` (``ServerState.submit``; an error: ``listener(i,
    error)``); ``chunk(i, out)``, job ``i``'s output's chunks (none, one or more; called once per output, in order:
    it may keep state); ``last()``, the chunks after the last output."""

    first: list[dict]
    start: Callable[[Callable[[int, Any], None]], Awaitable[Any]]
    jobs: int
    chunk: Callable[[int, Any], list[dict]]
    last: Callable[[], list[dict]]


async def pulled(push: Push) -> AsyncIterator[dict]:
    """``push``'s chunks, read with ``async for``."""
    for c in push.first:
        yield c
    async for i, out in outputs(push.start, push.jobs):
        for c in _chunks(push, i, out):
            yield c
    for c in push.last():
        yield c


class _Gathered:
    """A listener for submitted jobs (``ServerState.submit``) that keeps their outputs, merged per job, and the first
    error, until ``items`` reads them. ``direct(i, out)``, when given, is offered each output first: True when it
    took it (written at once), False to keep it; what it raises is that output's failure (``_failed``), kept as the
    error."""

    def __init__(self, jobs: int, direct: Callable[[int, Any], bool] | None = None):
        self.pending = Unread()
        self.errors: list[BaseException] = []
        self.left, self.direct, self._waiter = jobs, direct, None

    def __call__(self, i: int, item) -> None:
        if isinstance(item, BaseException):
            self.errors.append(item)
        else:
            self.left -= item.finished
            try:
                taken = self.direct is not None and self.direct(i, item)
            except Exception as e:  # noqa: BLE001 - this stream's failure, on the pass that delivers the others
                self.errors.append(_failed(item.request_id, e))
            else:
                if not taken:
                    self.pending.add(i, item)
                elif self.left > 0:
                    return  # taken, and more to come: nothing for the reader
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def items(self) -> AsyncIterator[tuple[int, Any]]:
        """(job index, output) of what was kept, as it comes, until every job finished; the first error raised after
        the outputs before it."""
        while True:
            if self.pending:
                yield self.pending.pop()
            elif self.errors:
                raise self.errors[0]
            elif self.left <= 0:
                return
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter


async def outputs(start: Callable[[Callable[[int, Any], None]], Awaitable[Any]], jobs: int
                  ) -> AsyncIterator[tuple[int, Any]]:
    """The outputs of ``jobs`` jobs that ``start(listener)`` submits, each with its job's index, until every one
    finished; a job's error ends them all (raised here, after the outputs before it), and leaving early closes the
    handle ``start`` gave (aborting what still runs). A job's outputs that come while the reader is busy are merged
    into one."""
    gathered = _Gathered(jobs)
    submitted = await start(gathered)
    try:
        async for item in gathered.items():
            yield item
    finally:
        submitted.close()


class ConcurrencyLimit:
    """At most ``sequences`` sequences and ``tokens`` tokens in flight (None: tokens are not bounded). A request that
    would pass either is refused at once (429, with Retry-After), and one that alone passes one is refused always
    (400, naming the flag that raises it).

    Retry-After is an estimate from the requests that ended in the last RELEASES_SECONDS: the seconds until, at the
    pace they gave their sequences or tokens back, as many would be free as this request lacks; 1 when none ended
    (nothing to go by), at most MAX_RETRY_AFTER. Only the event loop's thread calls it."""

    def __init__(self, sequences: int, tokens: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.sequences, self.tokens, self._clock = sequences, tokens, clock
        self.held_sequences = self.held_tokens = 0
        self._ended: collections.deque[tuple[float, int, int]] = collections.deque()  # (when, sequences, tokens)
        self._given = [0, 0]  # the sequences and tokens of the ends in _ended, added up

    def precheck(self, sequences: int) -> None:
        """``check`` before the prompts are tokenized: each sequence at its fewest tokens."""
        self.check(sequences, LEAST_TOKENS * sequences)

    def check(self, sequences: int = 1, tokens: int = 0) -> None:
        """ApiError 400 when ``sequences`` or ``tokens`` alone pass a limit, 429 when they do with those in
        flight."""
        if sequences > self.sequences:
            raise ApiError(400, f"this request runs {sequences} sequences (prompts x n), more than this server runs "
                                f"at once ({self.sequences}, --max-concurrent); send fewer prompts or a lower n", "n")
        if self.tokens is not None and tokens > self.tokens:
            raise ApiError(400, f"this request can occupy {tokens} tokens of the KV cache (each of its sequences' "
                                f"prompt and max_tokens), more than this server holds in flight at once "
                                f"({self.tokens}, --max-queued-tokens); send fewer prompts, a lower n or a lower "
                                f"max_tokens", "max_tokens")
        if self.held_sequences + sequences > self.sequences:
            seconds = self._retry_after(self.held_sequences + sequences - self.sequences, 0)
            raise ApiError(429, f"too many requests in flight: {self.held_sequences} sequences are running, of this "
                                f"server's limit of {self.sequences} (--max-concurrent), and this request runs "
                                f"{sequences}; retry after {seconds} s", headers={"retry-after": str(seconds)})
        if self.tokens is not None and self.held_tokens + tokens > self.tokens:
            seconds = self._retry_after(self.held_tokens + tokens - self.tokens, 1)
            raise ApiError(429, f"too many requests in flight: they hold {self.held_tokens} tokens of the KV cache, "
                                f"of this server's limit of {self.tokens} (--max-queued-tokens), and this request "
                                f"needs {tokens}; retry after {seconds} s", headers={"retry-after": str(seconds)})

    @asynccontextmanager
    async def hold(self, sequences: int = 1, tokens: int = 0):
        """Places for ``sequences`` and ``tokens`` while the block runs (checked first: never waits for them), given
        back however it ends."""
        self.check(sequences, tokens)
        self.held_sequences += sequences
        self.held_tokens += tokens
        try:
            yield
        finally:
            self.held_sequences -= sequences
            self.held_tokens -= tokens
            self._ended.append((self._clock(), sequences, tokens))
            self._given[0] += sequences
            self._given[1] += tokens
            self._forget()

    def _retry_after(self, lacking: int, kind: int) -> int:
        """Seconds until ``lacking`` sequences (``kind`` 0) or tokens (1) are given back, at the recent pace."""
        self._forget()
        given = self._given[kind]
        if not given:
            return 1
        span = max(self._clock() - self._ended[0][0], 1.0)
        return max(1, min(MAX_RETRY_AFTER, math.ceil(lacking * span / given)))

    def _forget(self) -> None:
        """Drop the ends older than RELEASES_SECONDS."""
        since = self._clock() - RELEASES_SECONDS
        while self._ended and self._ended[0][0] < since:
            _, sequences, tokens = self._ended.popleft()
            self._given[0] -= sequences
            self._given[1] -= tokens


async def respond(request: Request, reply: Reply, limit: ConcurrencyLimit):
    """The response to send for ``reply``: its JSON, or a stream of its chunks."""
    if asyncio.iscoroutine(reply.body):
        return await _answer(request, reply, limit)
    limit.check(reply.sequences, reply.tokens)  # refused while a 429 status can still be sent
    return EventStream(_ended(_events(reply, limit)), reply, limit)


RAW_SEND = "lorakit.raw_send"  # the scope key of the server's own ``send`` (``edge.uvicorn_config`` puts it there)
WRITE_BODY = "lorakit.write_body"  # ... and of an ``edge.BodyWriter``, where the server has one


class EventStream(Response):
    """A stream of server-sent events, sent with less per event than Starlette's ``StreamingResponse``: its start,
    its end and error events go through the app's middleware (which counts statuses and error events); every other
    event goes straight to the server's ``send`` (the scope's RAW_SEND, when there is one), one ASGI send an event,
    with no task group. One task waits for the client to leave and then cancels the stream (its requests are
    aborted as the iterator closes)."""

    def __init__(self, events: AsyncIterator[bytes], reply: Reply | None = None, limit: ConcurrencyLimit | None = None):
        self.status_code, self.background, self.body_iterator = 200, None, events
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]  # no length: chunked
        self._reply, self._limit = reply, limit

    async def __call__(self, scope, receive, send) -> None:
        raw = scope.get(RAW_SEND, send)
        writer = scope.get(WRITE_BODY)
        if writer is not None and self._reply is not None and self._reply.push is not None:
            await self.body_iterator.aclose()  # never started: the events are pushed instead
            self.body_iterator = _ended(_pushed(self._reply, self._limit, writer))
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        streaming, left = asyncio.current_task(), False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            async for event in self.body_iterator:
                await (send if event.startswith(ERROR_EVENT) else raw)(
                    {"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            if hasattr(streaming, "uncancel"):  # 3.11+: the task goes on (the middleware's ends), not cancelling
                streaming.uncancel()
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()


async def _answer(request: Request, reply: Reply, limit: ConcurrencyLimit):
    task = None
    try:
        async with limit.hold(reply.sequences, reply.tokens):
            task = asyncio.ensure_future(reply.body)
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    return JSONResponse({}, 499)
            error = task.exception()
            if error is not None:
                raise _failed(None, error)
            return task.result()
    finally:
        if task is None:
            reply.body.close()  # refused: never started


async def _ended(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events``, then ``[DONE]``; an error they raise is an error event before it (OpenAI's shape), whatever it
    is. Closing this closes ``events`` at once (a client gone: its requests are aborted then, not at collection)."""
    try:
        async with aclosing(events):
            async for data in events:
                yield data
    except ApiError as e:
        yield event(e.body())
    except Exception as e:  # noqa: BLE001 - a bug: the client still gets an error event, not a stream cut short
        logger.exception("a stream failed")
        yield event(ApiError(500, f"internal error ({type(e).__name__}); the server log has the details").body())
    yield DONE


async def _events(reply: Reply, limit: ConcurrencyLimit) -> AsyncIterator[bytes]:
    async with limit.hold(reply.sequences, reply.tokens):  # again: places may have been taken since
        async for chunk in reply.body:
            yield event(chunk)


async def _pushed(reply: Reply, limit: ConcurrencyLimit, writer) -> AsyncIterator[bytes]:
    """``_events`` of a ``Push`` reply: each output's events are written by ``writer`` (``edge.BodyWriter``) as
    they come (see the module docstring), and only what it was not ready for (the connection's buffer is full: the
    client reads slowly) comes out of this iterator, merged per job, together with the first and last events."""
    push, sending = reply.push, True  # sending: an event of this iterator is on its way (nothing may overtake it)

    def direct(i: int, item) -> bool:
        if gathered.pending or gathered.errors or sending or not writer.ready():
            return False
        data = b"".join(event(c) for c in push.chunk(i, item))
        if data:
            writer.write(data)
        return True

    gathered = _Gathered(push.jobs, direct)
    async with limit.hold(reply.sequences, reply.tokens):
        for c in push.first:
            yield event(c)
        sending = False
        submitted = await push.start(gathered)
        try:
            async for i, out in gathered.items():
                sending = True
                for c in _chunks(push, i, out):
                    yield event(c)
                sending = False
        finally:
            submitted.close()
        for c in push.last():
            yield event(c)


def _chunks(push: Push, i: int, out) -> list[dict]:
    """``push.chunk(i, out)``; its failure raised as the stream's ApiError (``_failed``)."""
    try:
        return push.chunk(i, out)
    except Exception as e:  # noqa: BLE001 - see _failed
        raise _failed(out.request_id, e) from None


def _failed(request_id: str | None, error: BaseException) -> ApiError:
    """What ends a request whose response could not be made from its outputs (a stream's events made or written;
    None: a JSON answer, of one or more engine requests): ``error`` itself when it is an ApiError, else a 400
    (``undeliverable``), its traceback logged."""
    if isinstance(error, ApiError):
        return error
    logger.error("request %s: its response could not be made from its outputs (%s); it ends with an error",
                 request_id or "(a JSON answer)", type(error).__name__, exc_info=error)
    return ApiError(400, undeliverable(request_id, error))


_encode = msgspec.json.Encoder().encode


def event(obj: dict) -> bytes:
    """One server-sent event (compact JSON)."""
    return b"data: " + _encode(obj) + b"\n\n"
