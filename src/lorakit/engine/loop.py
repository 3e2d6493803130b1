"""The engine loop: the one place an ``Engine`` is driven, wherever it lives.

Between steps it runs its inbox's commands and the work that waited on a future, then steps and hands the outputs
to ``emit``. A step's failure no request is found to cause ends every request with an error; a
``FatalEngineError`` leaves ``run``. Its homes (a thread: ``AsyncEngine``; the core process) differ only in the
inbox and ``emit`` around it (``lorakit.frontend``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from lorakit.engine.engine import Engine
from lorakit.engine.errors import FatalEngineError
from lorakit.engine.outputs import RequestOutput
from lorakit.engine.stats import EngineStats

__all__ = ["EngineLoop", "Inbox", "ThreadInbox"]

logger = logging.getLogger("lorakit.engine")

WAITING_POLL = 0.005  # how long an idle loop waits for a command while work waits on a future (seconds)

Command = Callable[[], None]


class Waitable(Protocol):
    def done(self) -> bool: ...


class Inbox(Protocol):
    def take(self, timeout: float | None) -> list[Command]:
        """The commands that came, waiting up to ``timeout`` seconds (None: until one comes) while there are none."""
        ...


class ThreadInbox:
    """Commands posted from any thread (``post``), taken by the loop's thread."""

    def __init__(self):
        self._cond = threading.Condition()
        self._commands: list[Command] = []

    def post(self, command: Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def take(self, timeout: float | None) -> list[Command]:
        with self._cond:
            if not self._commands and timeout != 0:
                self._cond.wait(timeout)
            commands, self._commands = self._commands, []
        return commands

    def clear(self) -> list[Command]:
        """Take every command without running it (the loop is gone)."""
        with self._cond:
            commands, self._commands = self._commands, []
        return commands


class EngineLoop:
    """See the module docstring. ``emit(outputs)`` is called after every step (outputs may be empty) on the loop's
    thread; ``idle()`` just before the loop waits with nothing to do."""

    def __init__(self, engine: Engine, inbox: Inbox, emit: Callable[[list[RequestOutput]], None],
                 idle: Callable[[], None] | None = None):
        self.engine, self.inbox, self.emit, self.idle = engine, inbox, emit, idle
        self.steps = 0  # engine steps run
        self.step_seconds = 0.0  # wall time spent inside them (the rest of the loop's time is idle)
        self._waiting: list[tuple[Waitable, Callable]] = []
        self.pending: list[RequestOutput] = []  # to emit with the next step (requests refused between steps)
        self._deadline: float | None = None  # draining: when the requests still running are aborted
        self._drained: Callable[[], None] | None = None

    def after(self, future: Waitable, fn: Callable[[Waitable], None]) -> None:
        """Run ``fn(future)`` on the loop's thread, between steps, once ``future`` is done (a future, a grammar's
        ``Pending``: anything with ``done()``)."""
        self._waiting.append((future, fn))

    def put(self, output: RequestOutput) -> None:
        """An output to emit with the next step's (a request refused, or ended, between steps)."""
        self.pending.append(output)

    def drain(self, seconds: float, then: Callable[[], None] | None = None) -> None:
        """Stop taking new work: the running requests get ``seconds`` to finish, then those left are aborted, their
        last outputs emitted, ``then()`` called, and ``run`` returns."""
        self._deadline, self._drained = time.monotonic() + seconds, then

    def stats(self) -> EngineStats:
        """The engine's stats with this loop's step counters (safe from any thread)."""
        return dataclasses.replace(self.engine.stats(), steps=self.steps, step_seconds=self.step_seconds)

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.pending)

    def run(self) -> None:
        """Until drained; a ``FatalEngineError`` from a step is raised."""
        while True:
            timeout = 0 if self.busy or self._deadline is not None else WAITING_POLL if self._waiting else None
            if timeout is None and self.idle is not None:
                self.idle()
            for command in self.inbox.take(timeout):
                command()
            self.run_ready()
            if self._deadline is not None and (not self.engine.has_unfinished()
                                               or time.monotonic() >= self._deadline):
                self.engine.abort_all()
                self.step()  # emits the aborts
                if self._drained is not None:
                    self._drained()
                return
            if self.busy:
                self.step()

    def run_ready(self) -> None:
        """Run the work whose futures are done (``after``)."""
        while self._waiting and any(future.done() for future, _ in self._waiting):
            ready = [(f, fn) for f, fn in self._waiting if f.done()]
            self._waiting = [(f, fn) for f, fn in self._waiting if not f.done()]
            for future, fn in ready:
                fn(future)

    def step(self) -> None:
        """One engine step (when there is work), its outputs emitted."""
        engine, outputs = self.engine, self.pending
        self.pending = []
        if engine.has_unfinished():
            start = time.perf_counter()
            try:
                outputs += engine.step()
            except FatalEngineError:
                raise
            except Exception as e:  # noqa: BLE001 - not a request's fault (``Engine.step`` isolates those): all end
                logger.exception("a step failed")
                outputs += engine.fail_all(f"the engine step failed ({type(e).__name__}: {e})")
            self.steps += 1
            self.step_seconds += time.perf_counter() - start
        self.emit(outputs)
