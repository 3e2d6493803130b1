"""The HTTP edge: what a connection may cost the server before a handler sees its request, and what a client sees.

Headers in time and size (``guarded_protocol``, a subclass of uvicorn's protocol: no middleware runs before a
request exists), a body's size and time (``BodyGate``), all bodies in flight (``BodyBudget``), a half-close told
apart from a client gone. Every refusal is in OpenAI's error shape, with ``connection: close``. Limits and why:
docs/serve.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
from pathlib import Path

from fastapi.responses import JSONResponse

from lorakit.frontend.bodies import UNMAPPER, gather_map
from lorakit.serve.protocol import ApiError
from lorakit.serve.streaming import RAW_SEND, WRITE_BODY

__all__ = ["BODY_KEY", "MAX_HEADER_BYTES", "BodyBudget", "BodyGate", "default_bytes_in_flight", "guarded_protocol",
           "machine_memory", "uvicorn_config"]

BODY_KEY = "lorakit.body"  # the scope's key for the body BodyGate read: a handler may take it without a copy
MAX_HEADER_BYTES = 64 * 2**10  # a request line and headers; browsers and proxies stay under 16 KiB
LINGER = 2.0  # seconds a refused connection is read (and what it sends dropped) after its answer, before it closes
MEMORY_SHARE = 8  # the default budget for bodies in flight: one eighth of the machine's memory


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_bytes_in_flight(processes: int = 1) -> int:
    """The default budget for request bodies in flight, per process of ``processes`` serving one machine."""
    return machine_memory() // MEMORY_SHARE // processes


class BodyBudget:
    """Bytes of request bodies held at once, at most ``total``; only the event loop's thread changes ``held``."""

    def __init__(self, total: int):
        self.total, self.held = total, 0

    def take(self, size: int) -> bool:
        """Whether ``size`` more bytes fit; if so they are held until ``give``."""
        if self.held + size > self.total:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class _Refused(Exception):
    def __init__(self, error: ApiError, headers: dict[str, str] | None = None):
        self.error, self.headers = error, headers or {}


class _Held:
    """What one request holds of the budget; ``release`` gives it all back."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.size = budget, 0

    def take(self, size: int) -> None:
        if not self.budget.take(size):
            raise _Refused(ApiError(503, f"the server is receiving more request bodies than it holds at once "
                                         f"({self.budget.total} bytes, --max-body-bytes-in-flight); retry shortly"),
                           {"retry-after": "1"})
        self.size += size

    def release(self) -> None:
        self.budget.give(self.size)
        self.size = 0


async def _within(awaitable, seconds: float):
    """``await awaitable``, TimeoutError after ``seconds``: in the same task where asyncio can (3.11's
    ``asyncio.timeout``; ``wait_for`` made a task of it for every request)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class BodyGate:
    """Reads a request's body whole before the app runs, within its bounds (see the module), and hands it on in one
    message; after it, ``receive`` is the server's (a disconnect still reaches the app). Plain ASGI: streamed
    responses pass straight through."""

    def __init__(self, app, limit: int, budget: BodyBudget, timeout: float, limits: dict[str, tuple[int, str]] | None = None):
        """``limits``: path prefix -> (its own body limit, the flag that sets it), for routes that take large bodies
        (an adapter's weights)."""
        self.app, self.limit, self.budget, self.timeout = app, limit, budget, timeout
        self.limits = limits or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None
        limit, flag = next((v for prefix, v in self.limits.items() if scope["path"].startswith(prefix)),
                           (self.limit, "--max-body-bytes"))
        held, mapped = _Held(self.budget), None
        try:
            if declared is not None:
                if declared > limit:
                    raise _Refused(self._too_large(limit, flag))
                held.take(declared)
            try:
                body = await _within(self._read(receive, declared, held, limit, flag), self.timeout)
            except asyncio.TimeoutError:
                raise _Refused(ApiError(408, f"the request body did not arrive within {self.timeout:g} s "
                                             f"(--body-timeout); send it faster, or smaller")) from None
            if body is None:  # the client left while sending: nobody to answer
                return
            if isinstance(body, memoryview):  # gathered in a map: unmapped off the loop once its views are gone
                mapped = body.obj
            scope[BODY_KEY] = body
            handed = False

            async def replay():
                nonlocal handed
                if handed:
                    return await receive()
                handed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            await self.app(scope, replay, send)
        except _Refused as refused:
            e = refused.error
            await JSONResponse(e.body(), e.status, headers={"connection": "close", **refused.headers})(
                scope, receive, send)
        finally:
            held.release()
            if mapped is not None:
                scope.pop(BODY_KEY, None)
                UNMAPPER.release(mapped)

    async def _read(self, receive, declared: int | None, held: _Held, limit: int, flag: str
                    ) -> bytes | memoryview | None:
        """The whole body (None: the client left). A declared length is held already; the bytes of a chunked body
        are taken from the budget as they come. A body of several messages with a declared length is a view of the
        map it was gathered in (``bodies.gather_map``; unmapped by ``UNMAPPER`` once its views are gone): not copied
        again under the GIL."""
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        if not message.get("more_body", False) and declared is not None:  # most requests: one message
            return chunk
        buffer = gather_map(declared) if declared else None  # a memfd's: the engine core maps it, no copy sent
        chunks, size = [], 0
        try:
            while True:
                if declared is None:
                    if size + len(chunk) > limit:
                        raise _Refused(self._too_large(limit, flag))
                    held.take(len(chunk))
                    chunks.append(chunk)
                elif size + len(chunk) > declared:  # the server's parser frames the body: not expected
                    raise _Refused(ApiError(400, f"the request body is longer than its Content-Length ({declared})"))
                else:
                    buffer[size:size + len(chunk)] = chunk
                size += len(chunk)
                if not message.get("more_body", False):
                    if buffer is None:
                        return b"".join(chunks)
                    body, buffer = memoryview(buffer)[:size], None  # the view keeps the map
                    return body
                message = await receive()
                if message["type"] != "http.request":
                    return None
                chunk = message.get("body", b"")
        finally:
            if buffer is not None:  # refused, or the client left
                UNMAPPER.release(buffer)

    @staticmethod
    def _too_large(limit: int, flag: str) -> ApiError:
        return ApiError(413, f"the request body is larger than this server accepts ({limit} bytes, {flag})")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(ApiError(status, message).body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class _Lingering:
    """A transport whose ``close``, while the client may still be sending (``unread()``), sends the answer and an end
    of stream, then reads for up to LINGER seconds before it closes: closing a socket that has unread bytes sends a
    reset, and the client's system may drop the answer it had not read yet (a 413, 503 or 408 became "connection
    reset by peer"). Everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, unread, loop: asyncio.AbstractEventLoop):
        self._transport, self._unread, self._loop = transport, unread, loop
        self._closing = self.lingering = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def write(self, data) -> None:
        if not self.lingering:  # after the end of stream, a write would raise
            self._transport.write(data)

    def close(self) -> None:
        transport = self._transport
        if self._closing or transport.is_closing():
            return
        self._closing = True
        if not (self._unread() and transport.can_write_eof()):
            return transport.close()
        self.lingering = True
        transport.write_eof()  # after what is buffered
        transport.resume_reading()  # flow control may have paused it mid-body
        self._loop.call_later(LINGER, transport.close)


def _was_reset(sock) -> bool:
    """Whether the peer reset this connection (poll's hang-up or error; an end of its input alone is neither)."""
    if sock is None or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


def guarded_protocol(header_timeout: float, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``: its h11 or httptools one; default, the one it picks) with the bounds on
    headers of the module docstring.

    It hooks only what both of uvicorn's protocols have had for years: ``connection_made``, ``data_received``,
    ``on_response_complete``, ``connection_lost`` and the ``cycle`` of the current request (a new one exists once a
    request's headers are in; its ``more_body`` is False once its body is). Headers are awaited from the connection's
    start and from each response's end, until a new request begins. A connection closed while its client may still
    be sending (headers or a body not all in) lingers (``_Lingering``), so that the client reads its answer."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class Guarded(base):
        _clock = None  # the header timer while headers are awaited
        _header_bytes = 0  # bytes received since the last request began while no body was being received
        _awaited = None  # the request current when the clock started

        def connection_made(self, transport):
            super().connection_made(_Lingering(transport, self._unread, self.loop))
            self._await_headers()

        def _unread(self) -> bool:
            """Whether the client may be sending still: a request's headers or body are not all in."""
            return self._header_bytes > 0 or (self.cycle is not None and self.cycle.more_body is True)

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # answered and closing: what comes is dropped
                return
            cycle = self.cycle
            between = cycle is None or cycle.more_body is False  # not inside a body: these bytes are headers
            super().data_received(data)
            if self.cycle is not cycle:  # a request began
                self._header_bytes = 0
                if self._clock is not None:
                    self._clock.cancel()
                    self._clock = None
            elif between:
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._drop(431, "Request Header Fields Too Large", f"the request line and headers pass "
                               f"{MAX_HEADER_BYTES} bytes; send fewer or shorter headers")

        _half_closed = False  # the client ended its side once its request was in: answer it, then close
        _watch = None  # while half-closed: the timer that looks for the client having gone altogether

        def eof_received(self):
            """A client that half-closes (``shutdown(SHUT_WR)``) once its request is in still reads its answer: the
            connection stays open for the response, then closes. An end anywhere else closes it, as before.

            A client that closed its socket altogether (one that gave up) ends its side the same way; what tells
            them apart is what its system does with bytes sent to it: a closed socket answers with a reset. So a
            request whose answer has not begun is sent an interim ``100 Continue`` (HTTP/1.1 clients skip it), and
            the socket is watched for the reset (``_watch_gone``): then the connection is lost, as if the client
            had closed first, and its request ends (499)."""
            cycle = self.cycle
            if cycle is not None and cycle.more_body is False and not cycle.response_complete:
                self._half_closed = True
                if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    cycle.waiting_for_100_continue = False  # one interim answer, not two
                self._watch_gone(0.02)
                return True
            return super().eof_received()

        def _watch_gone(self, delay: float) -> None:
            """Look again in ``delay`` seconds (then less often, up to each second) whether the half-closed client's
            socket was reset; if so, drop the connection."""
            def look():
                self._watch = None
                if self.transport.is_closing():
                    return
                if _was_reset(self.transport.get_extra_info("socket")):
                    self.transport.abort()
                else:
                    self._watch_gone(min(2 * delay, 1.0))
            self._watch = self.loop.call_later(delay, look)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._half_closed:
                self.transport.close()
                return
            self._await_headers()

        def connection_lost(self, exc):
            for timer in (self._clock, self._watch):
                if timer is not None:
                    timer.cancel()
            self._clock = self._watch = None
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self._clock is not None:
                self._clock.cancel()
            self._clock = None
            if not self.transport.is_closing():
                self._awaited = self.cycle
                self._clock = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            self._clock = None
            cycle = self.cycle
            if cycle is self._awaited and (cycle is None or cycle.response_complete):
                if self._header_bytes:
                    self._drop(408, "Request Timeout", f"the request's headers did not arrive within "
                               f"{header_timeout:g} s (--header-timeout)")
                elif not self.transport.is_closing():
                    self.transport.close()  # idle: nothing to answer (a 408 might be read as the next reply)

        def _drop(self, status: int, reason: str, message: str) -> None:
            """Answer and close; abort if a response is being sent on this connection (its request ends)."""
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_raw_response(status, reason, message))
                self.transport.close()
            else:
                self.transport.abort()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class _WithRawSend:
    """``app`` with the server's own ``send`` in each scope (RAW_SEND), and where the server is uvicorn's httptools
    protocol a function that writes a body chunk at once (WRITE_BODY: ``body_writer``), for
    ``streaming.EventStream``."""

    def __init__(self, app):
        self.app, self.state = app, app.state

    async def __call__(self, scope, receive, send):
        scope[RAW_SEND] = send
        write = body_writer(send)
        if write is not None:
            scope[WRITE_BODY] = write
        await self.app(scope, receive, send)


_CYCLE = ("transport", "flow", "chunked_encoding", "response_started", "response_complete", "disconnected")


class BodyWriter:
    """For uvicorn's httptools protocol (whose ``send`` is its request cycle's method): ``write(body)`` writes one
    chunk of a chunked response body at once, as that ``send`` does for ``{"type": "http.response.body", "body":
    body, "more_body": True}``; call it only when ``ready()``: False where that ``send`` would wait (the connection's
    buffer is full: flow control) or could not write (the response not started, not chunked, complete, or the client
    gone)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle):
        self._cycle = cycle

    def ready(self) -> bool:
        cycle = self._cycle
        return not (cycle.flow.write_paused or cycle.disconnected or not cycle.response_started
                    or cycle.response_complete or cycle.chunked_encoding is not True)

    def write(self, body: bytes) -> None:
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


def body_writer(send) -> BodyWriter | None:
    """A ``BodyWriter`` for uvicorn's httptools protocol's ``send``; None for any other server."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or \
            not all(hasattr(cycle, name) for name in _CYCLE) or not hasattr(cycle.flow, "write_paused"):
        return None
    return BodyWriter(cycle)


def uvicorn_config(app, host: str, port: int, http: type[asyncio.Protocol] | None = None, **options):
    """uvicorn's Config for serving ``app`` (a ``create_app`` app, whose ServeConfig gives the header timeout) with
    the edge's bounds; ``http``: uvicorn's protocol class to guard (default, the one it picks); ``options``: other
    Config fields (log_level, timeout_graceful_shutdown, ...)."""
    import uvicorn

    config = app.state.server.config
    # h11 buffers an incomplete request line and headers up to this (16 KiB by default, and refuses more with a 400):
    # above MAX_HEADER_BYTES, so that the guard's 431 speaks for both protocols.
    return uvicorn.Config(_WithRawSend(app), host=host, port=port, http=guarded_protocol(config.header_timeout, http),
                          h11_max_incomplete_event_size=2 * MAX_HEADER_BYTES, **options)
