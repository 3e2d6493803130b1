"""One request's stream, as a server's coroutine reads it: the engine's outputs, given their text as they arrive.

Both homes of the engine hand each request's raw outputs (token ids, the engine's finish) to its ``RequestStream``
on the server's event loop, every output of a step in one pass: ``AsyncEngine`` once per step for the engine
thread's outputs, ``CoreClient`` once per ``Step`` message of the core. ``put`` runs the output through the request's
``OutputProcessor`` there and then (text, stop strings) and wakes the stream's reader only if it waits; outputs that
come while it is busy wait merged into one (a stream that fell behind catches up in one output, not one per token).
The stream aborts the request in the engine when a stop string ended it, or when its reader closes it before the
end (a client gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorakit.engine.outputs import OutputProcessor, RequestOutput

__all__ = ["RequestStream"]


class RequestStream:
    """A request's processed outputs, read with ``async for`` until the finished one (an error given to ``fail``
    is raised there, after the outputs before it). ``abort`` is called once if the request still runs in the engine
    when the stream ends: a stop string found here, or ``close`` before the end."""

    __slots__ = ("processor", "_abort", "_pending", "_error", "_waiter", "_done")

    def __init__(self, processor: OutputProcessor, abort: Callable[[], None]):
        self.processor, self._abort = processor, abort
        self._pending: RequestOutput | None = None  # processed, not read yet (merged)
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits
        self._done = False  # the engine has nothing more for it (finished, failed, aborted)

    def put(self, out: RequestOutput) -> None:
        """The engine's next output for this request (on the event loop)."""
        if self._done:
            return
        processed = self.processor.process(out)
        if processed.abort:  # a stop string: the engine does not know yet
            self._abort()
        out = processed.output
        if out is None:
            return
        self._done = out.finished
        self._pending = out if self._pending is None else self._pending.merged(out)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The request cannot go on (its engine is gone): the reader gets ``error`` after what is pending."""
        if not self._done:
            self._done, self._error = True, error
            self._wake()

    def close(self) -> None:
        """The reader leaves: the request is aborted in the engine if it still runs there."""
        if not self._done:
            self._done = True
            self._abort()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._pending is None:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._done:  # the finished output was read, or the error raised, or the stream closed
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        out, self._pending = self._pending, None
        return out
