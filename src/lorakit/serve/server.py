"""The uvicorn server ``lorakit serve`` runs, and how it stops.

At SIGINT or SIGTERM it stops accepting connections, gives the requests in flight ``grace`` seconds, then ends each
one still running with a 503 (a stream: an error event, then ``[DONE]``); a second Ctrl-C stops waiting. Unlike
``uvicorn.Server`` it does not raise the signal again: ``run`` returns and ``lorakit serve`` exits with its own
status. Why: docs/serve.md (shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from lorakit.frontend.core import freeze_heap
from lorakit.serve.state import ServerState

__all__ = ["END_SECONDS", "Server"]

logger = logging.getLogger("lorakit.serve")

END_SECONDS = 5.0  # after the grace: for the ended requests to write their last event, before uvicorn cuts them


class Server(uvicorn.Server):
    """``uvicorn.Server`` with the shutdown above, for the app whose ``ServerState`` is ``state`` (its grace:
    ``state.config.shutdown_grace``). ``config``: uvicorn's (its ``timeout_graceful_shutdown`` is set here)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        self.state, self.grace = state, state.config.shutdown_grace
        config.timeout_graceful_shutdown = self.grace + END_SECONDS
        super().__init__(config)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        freeze_heap()  # what the startup built lives as long as the server

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        handled = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handled.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        ending = asyncio.get_running_loop().call_later(self.grace, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
        if self.force_exit:  # the lifespan's shutdown may have been skipped: the engine stops here (once)
            self.state.end_requests("the server was stopped at once (a second Ctrl-C)")
            self.state.stop()
            # ... and the lifespan is ended now (its shutdown only stops what is stopped): left waiting, it was
            # cancelled as the loop closed, and logged a traceback
            if getattr(self, "lifespan", None) is not None and not getattr(self.lifespan, "shutdown_event",
                                                                                 asyncio.Event()).is_set():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.lifespan.shutdown(), END_SECONDS)

    def _grace_over(self) -> None:
        logger.warning("shutting down: the %g s grace for the requests in flight is over; ending those still running",
                       self.grace)
        self.state.end_requests(f"the server is shutting down, and the {self.grace:g} s it gives the requests in "
                                f"flight (--shutdown-grace) ran out")
