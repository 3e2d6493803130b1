"""The engine's failures that are not a request's: ``FatalEngineError`` (the engine cannot step any more) and
``EngineDead`` (what a caller gets once it is gone).

A request's own failure (a grammar that fails, an adapter that cannot load) ends that request alone; the engine finds
it by running the failed step's requests one by one (``Engine._isolate``). A ``FatalEngineError`` is never looked at
that way: it means every request the engine holds is lost, and whatever carries the engine (the core process, the
in-process thread) stops and says so, so that a supervisor can start it again. ``Overloaded`` is work refused for want
of room now: the same request may pass later.
"""

from __future__ import annotations

__all__ = ["EngineDead", "FatalEngineError", "Overloaded", "TensorParallelError"]


class FatalEngineError(RuntimeError):
    """The engine cannot step any more: no request caused it, and none it holds can finish."""


class TensorParallelError(FatalEngineError):
    """A tensor-parallel worker failed or exited, or the ranks fell out of step; the engine cannot step any more."""


class EngineDead(RuntimeError):
    """The engine is gone (its core process exited, or it failed for good); nothing it held will answer."""


class Overloaded(ValueError):
    """Work refused for want of room now, not for what it asks (a full queue, a budget spent waiting in one): the
    same request may pass ``retry_after`` seconds later (a guess where it was not known: carried by name and message
    only, as the core's replies carry errors). A ValueError, so that every path that ends or refuses a request for a
    ValueError (the core's replies among them) does so for this one too."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after
