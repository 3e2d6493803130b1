"""One request's stream on a server's event loop: the engine's raw outputs in, given their text (``OutputProcessor``).

A stream is read with ``async for`` (outputs that come while its reader is busy wait merged, in an ``Unread``) or
handed to a listener at once (``listen``: how the server streams). A failure while one request's output is
delivered is that request's alone: it ends with an ERROR output (``undeliverable``) and is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Union

from lorakit.engine.outputs import FinishReason, OutputProcessor, RequestOutput, Unread

__all__ = ["Listener", "RequestStream", "undeliverable"]

logger = logging.getLogger("lorakit.frontend")

Listener = Callable[[Union[RequestOutput, BaseException]], None]  # an output, or the error that ends the request


class RequestStream:
    """A request's processed outputs, read with ``async for`` until the finished one (an error given to ``fail``
    is raised there, after the outputs before it). ``abort`` is called once if the request still runs in the engine
    when the stream ends: a stop string found here, or ``close`` before the end."""

    __slots__ = ("processor", "_abort", "_pending", "_error", "_waiter", "_done", "_listener")

    def __init__(self, processor: OutputProcessor, abort: Callable[[], None]):
        self.processor, self._abort = processor, abort
        self._pending = Unread()  # processed, not read yet
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits
        self._done = False  # the engine has nothing more for it (finished, failed, aborted)
        self._listener: Listener | None = None

    def put(self, out: RequestOutput) -> None:
        """The engine's next output for this request (on the event loop). Never raises: a failure here ends this
        request alone (see the module docstring)."""
        if self._done:
            return
        try:
            self._put(out)
        except Exception as e:  # noqa: BLE001 - any failure: this request's, never the pass that delivers the others'
            self._broke(e)

    def _put(self, out: RequestOutput) -> None:
        processed = self.processor.process(out)
        if processed.abort:  # a stop string: the engine does not know yet
            self._abort()
        out = processed.output
        if out is None:
            return
        self._done = out.finished
        self._give(out)

    def _give(self, out: RequestOutput) -> None:
        if self._listener is not None:
            self._listener(out)
            return
        self._pending.add(None, out)
        self._wake()

    def _broke(self, error: Exception) -> None:
        """Delivering an output failed with ``error``: the request gets a last output, finish_reason "error" (given
        as it is, not processed), is aborted in the engine if it still runs there, and the failure is logged."""
        request_id = self.processor.request_id
        logger.error("request %s: delivering its output failed (%s); it ends with an error, the other requests go on",
                     request_id, type(error).__name__, exc_info=error)
        self._done = True
        self._quietly(self._give, RequestOutput.ended(request_id, FinishReason.ERROR,
                                                      error=undeliverable(request_id, error)))
        self._quietly(self._abort)  # nothing when the engine had finished it already

    def fail(self, error: BaseException) -> None:
        """The request cannot go on (its engine is gone): the reader gets ``error`` after what is pending."""
        if not self._done:
            self._done, self._error = True, error
            if self._listener is not None:
                self._error = None
                self._quietly(self._listener, error)
                return
            self._wake()

    def _quietly(self, fn: Callable, *args) -> None:
        """``fn(*args)`` as this request's end, whose failure can only be logged: its listener or abort is broken."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - nothing more can reach this request; the others go on
            logger.exception("request %s: ending it failed too", self.processor.request_id)

    def listen(self, listener: Listener) -> None:
        """From now on every processed output, and the error of ``fail``, goes to ``listener`` as it comes instead of
        waiting to be read; what came before is given to it first. It is not read with ``async for`` then."""
        self._listener = listener
        pending, error, self._error = self._pending.take(), self._error, None
        for _, out in pending:
            listener(out)
        if error is not None:
            listener(error)

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
        while not self._pending:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._done:  # the finished output was read, or the error raised, or the stream closed
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._pending.pop()[1]


def undeliverable(request_id: str | None, error: BaseException) -> str:
    """What the client of a request whose output could not be delivered is told (with a 400, as vLLM answers a
    stream that fails): what failed, and the id the server's log names it by, when there is one."""
    where = f"as request {request_id}" if request_id is not None else "with its traceback"
    return f"the server could not turn this request's output into its response ({type(error).__name__}); its log has " \
           f"it {where}"
