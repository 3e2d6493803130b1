"""One request's stream, as a server's coroutine reads it: the engine's outputs from a queue, given their text.

Both homes of the engine feed a per-request ``asyncio.Queue`` with its raw outputs (token ids, the engine's finish):
``AsyncEngine`` from the engine thread, ``CoreClient`` from the core's messages. ``stream`` is the one reader: it
merges what waited (a stream that fell behind catches up in one output, not one per token), runs it through the
request's ``OutputProcessor`` (text, stop strings), and aborts the request in the engine when a stop string ended it
or when its consumer leaves before the end (a client gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from lorakit.engine.outputs import OutputProcessor, RequestOutput

__all__ = ["stream"]


async def stream(queue: asyncio.Queue, processor: OutputProcessor, abort: Callable[[], None]
                 ) -> AsyncIterator[RequestOutput]:
    """The request's outputs from ``queue`` until the finished one (an exception in the queue is raised); ``abort``
    is called once if the request still runs in the engine when this ends (a stop string found here, or a consumer
    that left)."""
    pending, finished, aborted = None, False, False
    try:
        while not finished:
            out, pending = (pending if pending is not None else await queue.get()), None
            if isinstance(out, BaseException):
                raise out
            while not out.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    pending = later
                    break
                out = out.merged(later)
            processed = processor.process(out)
            if processed.abort:
                aborted = True
                abort()
            finished = processed.output.finished
            yield processed.output
    finally:
        if not finished and not aborted:
            abort()
