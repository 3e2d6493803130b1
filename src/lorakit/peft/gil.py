"""Work beside a stepping engine that gives the GIL back to it.

A step of the engine is some Python, a wait for the GPU with the GIL released, and some more Python. A thread that
reads an adapter meanwhile (a push, a folder being loaded) takes the GIL while the engine waits. Back from its wait,
the engine's thread asks for the GIL, and CPython hands it over only once the switch interval (5 ms) has passed with
no release; each release by the reader (every torch call, every hashed chunk) wakes the waiting thread to find the
GIL taken again and starts its wait over. A reader doing many small calls so holds the engine off for as long as it
reads, the longer the more threads contend: with `bench_push.py --trace`'s stack samplers as two more, a bystander
stream's largest gap was 4.8 steps per HTTP push on an H200, and 2.5 paced (bench/results/push_stall_round7.md).

So the readers' loops call ``pause()`` between small pieces of work. On a thread inside ``yielding()`` it sleeps
``PAUSE`` (the GIL released) once per ``EVERY`` of work: long enough for a thread woken by the release to take the
GIL, so the engine waits at most about ``EVERY`` for it. Elsewhere (the engine's own thread, a script's) it costs a
lookup and does nothing. It sits in ``peft``, the ground floor, because the PEFT reader's loops are among those that
pause.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["EVERY", "PAUSE", "beside", "pause", "yielding", "yielding_here"]

EVERY = 0.0005  # seconds of work between two pauses
PAUSE = 0.00002  # seconds asked of sleep; with Linux's timer slack it sleeps about 0.1 ms

T = TypeVar("T")
_due = threading.local()


@contextlib.contextmanager
def yielding() -> Iterator[None]:
    """``pause()`` pauses on this thread within the block (nested blocks: the outermost ends it)."""
    outer = getattr(_due, "at", None)
    if outer is None:
        _due.at = time.perf_counter() + EVERY
    try:
        yield
    finally:
        if outer is None:
            _due.at = None


def beside(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` inside ``yielding()``: how a reader's thread runs work beside the engine."""
    with yielding():
        return fn(*args)


def pause() -> None:
    """Let a thread waiting for the GIL take it, when this one is ``yielding()`` and has worked ``EVERY`` since its
    last pause."""
    at = getattr(_due, "at", None)
    if at is not None and time.perf_counter() >= at:
        time.sleep(PAUSE)
        _due.at = time.perf_counter() + EVERY


def yielding_here() -> bool:
    """Whether this thread is inside ``yielding()``: work it hands to threads of its own yields as it would."""
    return getattr(_due, "at", None) is not None
