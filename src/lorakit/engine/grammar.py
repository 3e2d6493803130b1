"""One grammar, compiled off every loop that serves requests: ``build_grammar`` (on a worker thread of
``lorakit.engine.structured.Grammars``), ``Pending`` (a compile in flight, and its budget of seconds), ``Grammar``
(compiled and tried), and ``Constraint`` (one sequence's matcher, a copy of the grammar's).

llguidance releases the GIL while it compiles a grammar and while it computes a mask, so the loops keep running
beside a compile; copying a compiled matcher (``deep_copy``) holds it, for well under a millisecond once the
grammar's first mask is computed (that mask is computed once, on the worker, and every copy starts from it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from lorakit.ops import cdiv

__all__ = ["Constraint", "Grammar", "GrammarError", "Pending", "build_grammar", "unpack_mask"]

logger = logging.getLogger("lorakit.structured")

PROBE_TOKENS = 8  # first tokens a compiled grammar is tried on, each on a copy of its matcher
MESSAGE_CHARS = 300  # the most of llguidance's error a message or a log line quotes (it may quote the grammar)


class GrammarError(ValueError):
    """A grammar refused: past the budget, or one llguidance cannot compile or follow. The message is bounded."""


def bounded(text: str, limit: int = MESSAGE_CHARS) -> str:
    """An error as a message or a log line quotes it: one line, at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[:limit]}... ({len(line)} characters)"


class Constraint:
    """One sequence's matcher: which tokens may come next, advanced by each sampled token.

    ``error`` is set, and the request must end, when the matcher fails (a grammar past llguidance's parser
    limits, say); it never raises into the step, so no other request is touched.
    """

    def __init__(self, matcher, n_vocab: int):
        self._matcher = matcher
        self.words = cdiv(n_vocab, 32)  # the mask's width in int32 words, as the tokenizer's vocabulary needs
        self._own = torch.zeros((1, self.words), dtype=torch.int32)  # scratch for a batch of another width
        self.error: str | None = None

    def fill(self, row: Tensor) -> None:
        """Write the allowed next tokens into ``row`` (int32 words); ids past the tokenizer are never allowed."""
        row.zero_()
        if self.error is not None:
            return
        self._own.zero_()
        self._matcher.unsafe_compute_mask_ptr(self._own.data_ptr(), self._own.nbytes)
        if self._matcher.is_error():
            self._fail()
            return
        n = min(self._own.shape[1], row.shape[0])
        row[:n] = self._own[0, :n]

    def advance(self, token_id: int) -> None:
        """Feed the sampled token (one the mask allowed: always accepted, unless the matcher failed)."""
        if self.error is None and not self._matcher.consume_token(token_id):
            self._fail()

    def _fail(self) -> None:
        self.error = f"structured output failed: {bounded(self._matcher.get_error() or 'unknown error')}"
        logger.warning("%s", self.error)


class Grammar:
    """A grammar compiled for one tokenizer and tried on its first tokens. ``constraint()``: a sequence's own
    matcher, a copy of this one (its first mask computed already: a copy's first step costs microseconds)."""

    def __init__(self, matcher, n_vocab: int, tokenizer):
        self._matcher, self.n_vocab, self.tokenizer = matcher, n_vocab, tokenizer

    def constraint(self) -> Constraint:
        return Constraint(self._matcher.deep_copy(), self.n_vocab)


def build_grammar(llg, lltok, source: str, kind: str, n_vocab: int, tokenizer) -> Grammar:
    """``source`` (llguidance's grammar format) compiled for ``lltok``, its first mask computed, and each of up to
    PROBE_TOKENS of the tokens that mask allows consumed on a copy, with the mask after it: a grammar llguidance
    refuses, or cannot follow from its first token (a schema of hundreds of optional properties passes llguidance's
    own check and fails there), raises GrammarError. Blocking, most of it without the GIL: run it on a worker."""
    # verbose_errors off: llguidance's errors would quote the grammar and the parser's state
    matcher = llg.LLMatcher(lltok, source, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
    if matcher.is_error():
        raise GrammarError(f"invalid {kind} for structured output: {bounded(matcher.get_error())}")
    grammar = Grammar(matcher, n_vocab, tokenizer)
    mask = torch.zeros((1, cdiv(n_vocab, 32)), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.nbytes)
    allowed = [] if matcher.is_error() else unpack_mask(mask, n_vocab)[0].nonzero()[:, 0].tolist()
    probes = [matcher] if matcher.is_error() else []
    for token in allowed[::max(len(allowed) // PROBE_TOKENS, 1)][:PROBE_TOKENS]:
        probe = matcher.deep_copy()
        if probe.consume_token(token):
            probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.nbytes)
        probes.append(probe)
    for probe in probes:
        if probe.is_error():
            raise GrammarError(f"the {kind} is past what llguidance's parser can follow ({bounded(probe.get_error())});"
                               f" simplify it (e.g. fewer optional properties: list them in required)")
    return grammar


class Pending:
    """A grammar being compiled (or compiled, or refused). ``done()`` once it compiled, failed, or has run past its
    ``max_seconds`` (timed from the start of its compile, not from its wait for a worker); ``result()`` then gives
    the ``Grammar`` or raises ``GrammarError``. A compile past the budget is refused even if it finishes later
    (llguidance cannot be stopped: it finishes on its worker, and its refusal is what a cache keeps)."""

    def __init__(self, max_seconds: float, error: str | None = None):
        self.max_seconds = max_seconds
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None  # time.monotonic() when a worker took it, and when it finished
        self.finished: float | None = None
        if error is not None:
            self.started = self.finished = time.monotonic()
            self.future.set_exception(GrammarError(error))

    def run(self, build: Callable[[], Grammar]) -> None:
        """On a worker: ``build()``'s grammar, or its GrammarError (any other exception: logged, and a refusal)."""
        self.started = time.monotonic()
        try:
            result = build()
        except GrammarError as e:
            result = e
        except Exception as e:  # noqa: BLE001 - llguidance's own failure: this request's, said so, not the engine's
            logger.exception("compiling a grammar failed")
            result = GrammarError(f"the grammar could not be compiled ({type(e).__name__}: {bounded(str(e))})")
        self.finished = time.monotonic()
        if isinstance(result, GrammarError):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)

    def late(self) -> bool:
        """Whether its compile ran (or has run so far) past ``max_seconds``."""
        if self.started is None:
            return False
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.started > self.max_seconds

    def done(self) -> bool:
        return self.finished is not None or self.late()

    def result(self) -> Grammar:
        """The compiled grammar; GrammarError if it was refused or ran past the budget (call once ``done()``)."""
        if self.late():
            raise GrammarError(f"the grammar did not compile within {self.max_seconds:g} s (this server's "
                               f"--max-grammar-seconds); simplify it (fewer optional properties, alternatives or "
                               f"nested repetitions)")
        return self.future.result()  # set right after ``finished``

    def _left(self) -> float:
        """Seconds until it is surely done (a short poll while no worker has taken it yet)."""
        if self.started is None:
            return 0.05
        return max(self.started + self.max_seconds - time.monotonic(), 0.0) + 0.001

    def wait(self) -> Grammar:
        """Blocks until done (at most the budget once a worker has taken it); its result."""
        while not self.done():
            concurrent.futures.wait([self.future], timeout=self._left())
        return self.result()

    async def wait_async(self) -> Grammar:
        """As ``wait``, awaited: the event loop and its thread are free meanwhile. (Not ``asyncio.wrap_future``: a
        waiter that gives up would cancel the future every other waiter shares.)"""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake(_) -> None:  # on the worker; a loop closed meanwhile raises, which the future logs and drops
            loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
        self.future.add_done_callback(wake)
        while not self.done():
            await asyncio.wait({woken}, timeout=self._left())
        return self.result()


class Workers:
    """Daemon threads that run queued work in turn (daemons: a compile past its budget never holds up an exit)."""

    def __init__(self, count: int, name: str):
        self._count, self._name = count, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if len(self._threads) < self._count:  # started as the work comes: an engine without grammars has none
                thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except Exception:  # noqa: BLE001 - a bug in one piece of work must not stop the worker
                logger.exception("a %s worker's work failed", self._name)


def unpack_mask(packed: Tensor, vocab_size: int) -> Tensor:
    """[B, W] int32 bitmask -> [B, vocab_size] bool (True: allowed), on ``packed``'s device."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed[:, :, None] >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()
