"""``AsyncEngine``: the engine loop on a thread of this process, streaming to asyncio code.

What tests, embedding code, ``create_app(engine)`` and Ray replicas use (``lorakit serve`` runs the same loop in a
process of its own: ``lorakit.frontend.core``). Only the engine thread touches the engine: callers post commands
to its inbox (add a request, abort one, register an adapter), which the loop runs between steps, and await their
results as futures, so an event loop never blocks on a step. Each step's outputs reach each event loop in one
wake-up; their text is made there, by each request's ``OutputProcessor`` (``frontend.streams``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable

from lorakit.engine.engine import Engine
from lorakit.engine.errors import EngineDead, FatalEngineError
from lorakit.engine.loop import EngineLoop, ThreadInbox
from lorakit.engine.outputs import FinishReason, OutputProcessor, RequestOutput
from lorakit.adapters.pool import AdapterRef
from lorakit.engine.sampling import SamplingParams
from lorakit.engine.stats import EngineStats
from lorakit.frontend.streams import RequestStream

__all__ = ["AsyncEngine"]

logger = logging.getLogger("lorakit.engine")


class AsyncEngine:
    """See the module docstring. A ``FatalEngineError`` from a step (a tensor-parallel worker gone) ends the thread,
    and so does any other exception that reaches it (a bug, logged): every waiting stream and call gets
    ``EngineDead``, so does everything asked afterwards, ``dead`` says why, and ``on_death`` is called once, from the
    engine thread. No request's delivery can end it: each request's failure is its own (``RequestStream.put``), and a
    closed event loop's requests are aborted."""

    def __init__(self, engine: Engine, on_death: Callable[[], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self.dead: str | None = None  # why the engine cannot step any more, once it cannot
        self._inbox = ThreadInbox()
        self._loop = EngineLoop(engine, self._inbox, self._emit)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}  # the engine thread's
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lorakit-engine", daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        """The engine's stats and the loop's step counters (from any thread: read without a lock)."""
        return self._loop.stats()

    def _post(self, fn: Callable, *args, wait: bool = True) -> concurrent.futures.Future | None:
        call = _Call(fn, args, concurrent.futures.Future() if wait else None)
        with self._lock:
            if wait and self.dead is not None:
                raise EngineDead(self.dead)
            if wait and self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._inbox.post(call)
        return call.future

    async def submit(self, prompt, params: SamplingParams | None = None, adapter: AdapterRef | str | None = None,
                     request_id: str | None = None) -> RequestStream:
        """Add the request to the engine: its stream, which gets its outputs with their text as they come (closing
        it before the end aborts it). A bad request raises here. Its grammar, if any, is compiled on a worker thread
        while this coroutine waits (``Engine.grammar``): never on the engine thread."""
        loop = asyncio.get_running_loop()
        grammar = None
        if params is not None and params.structured_output is not None:  # compiled first, off the engine thread
            grammar = await self.engine.grammar(params.structured_output, adapter).wait_async()
        tokenizer = self.engine.registry.tokenizer_for(adapter)
        outs: list[RequestStream] = []

        def add():  # the stream exists before the request can step: its first output finds it
            rid = self.engine.add_request(prompt, params, adapter, request_id, grammar)
            prompt_ids, admitted = self.engine.admitted(rid)
            processor = OutputProcessor(rid, prompt_ids, admitted, tokenizer)
            outs.append(RequestStream(processor, lambda: self.abort(rid)))
            self._queues[rid] = (loop, outs[0])

        await asyncio.wrap_future(self._post(add))
        return outs[0]

    async def generate(self, prompt, params: SamplingParams | None = None, adapter: AdapterRef | str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come, with their text; leaving early (a client gone) aborts it. A
        bad request raises here, before anything is yielded (``submit``)."""
        outs = await self.submit(prompt, params, adapter, request_id)
        try:
            async for out in outs:
                yield out
        finally:  # closed (and aborted, if unfinished) as soon as this generator is
            outs.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread; does not wait)."""
        def abort():
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)
        self._post(abort, wait=False)  # never raises: nobody waits for it

    async def call(self, fn: Callable, *args):
        """Run fn(*args) on the engine thread between steps (e.g. engine.register_adapter); its result."""
        return await asyncio.wrap_future(self._post(fn, *args))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``timeout`` seconds), then stop; the rest get an error."""
        with self._lock:
            self._stopping = True
            if self.dead is None:
                self._inbox.post(_Call(self._loop.drain, (timeout,), None))
        self._thread.join(timeout + 10)
        for call in self._inbox.clear():  # posted too late: their callers get the error
            call.fail(RuntimeError("the engine is shutting down"))
        self._fail_all(RuntimeError("the engine shut down before this request finished"))

    def end_requests(self, reason: str) -> None:
        """End every request in flight now (from any thread): each stream gets a last output, finish_reason "abort"
        with ``reason`` as its error, and the engine drops them between steps."""
        queues, self._queues = self._queues, {}
        for request_id, (loop, outs) in queues.items():
            loop.call_soon_threadsafe(outs.put, RequestOutput.ended(request_id, FinishReason.ABORT, error=reason))

        def abort():
            for request_id in queues:
                self.engine.abort(request_id)
        if queues:
            self._post(abort, wait=False)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """The engine thread's sink: each output to its request's queue, one wake-up per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            found = self._queues.get(out.request_id)
            if found is not None:
                batches.setdefault(found[0], []).append((found[1], out))
                if out.finished:
                    del self._queues[out.request_id]
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # its event loop is closed: nobody reads these requests any more
                for _, out in items:
                    self.abort(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        queues, self._queues = self._queues, {}
        for loop, outs in queues.values():
            loop.call_soon_threadsafe(outs.fail, error)

    def _run(self) -> None:
        try:
            self._loop.run()
        except FatalEngineError as e:
            self._die(e)
        except Exception as e:  # noqa: BLE001 - a bug ended the loop: the engine is as dead as after a fatal error
            logger.error("the engine thread failed", exc_info=e)
            self._die(e)

    def _die(self, error: Exception) -> None:
        """The engine cannot step any more: everything waiting fails with ``EngineDead``, and so will everything
        asked from now on."""
        logger.error("the engine cannot step any more (%s: %s); failing %d requests in flight", type(error).__name__,
                     error, len(self._queues))
        with self._lock:
            self.dead = f"the engine failed and cannot run any more steps ({type(error).__name__}: {error})"
            pending = self._inbox.clear()
        dead = EngineDead(f"{self.dead}; the server restarts, send the request again")
        for call in pending:
            call.fail(dead)
        self._fail_all(dead)
        if self.on_death is not None:
            self.on_death()


class _Call:
    """A command for the engine thread: ``fn(*args)``, its result or exception to ``future`` (None: nobody waits)."""

    __slots__ = ("fn", "args", "future")

    def __init__(self, fn: Callable, args: tuple, future: concurrent.futures.Future | None):
        self.fn, self.args, self.future = fn, args, future

    def __call__(self) -> None:
        try:
            result = self.fn(*self.args)
        except FatalEngineError as e:  # the loop ends; the caller hears why
            self.fail(e)
            raise
        except Exception as e:  # noqa: BLE001 - the caller gets it
            if self.future is None:
                logger.exception("a command of the engine thread failed")
            else:
                self._settle(self.future.set_exception, e)
        else:
            if self.future is not None:
                self._settle(self.future.set_result, result)

    @staticmethod
    def _settle(setter: Callable, value) -> None:
        try:
            setter(value)
        except concurrent.futures.InvalidStateError:  # its caller stopped waiting (cancelled): nobody to tell
            pass

    def fail(self, error: BaseException) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)


def _deliver(items: list) -> None:
    for outs, out in items:
        outs.put(out)
