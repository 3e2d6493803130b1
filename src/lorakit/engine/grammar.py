"""One grammar, compiled off every loop that serves requests: ``build_grammar`` (on a worker thread of
``lorakit.engine.structured.Grammars``), ``CompileQueue`` (those workers, fair between clients and bounded),
``Compile`` (one grammar's compile, shared), ``Pending`` (one request's wait for it, and its budget of seconds),
``Grammar`` (compiled and tried), and ``Constraint`` (one sequence's matcher, a copy of the grammar's).

llguidance releases the GIL while it compiles a grammar and while it computes a mask, so the loops keep running
beside a compile; copying a compiled matcher (``deep_copy``) holds it, for well under a millisecond once the
grammar's first mask is computed (that mask is computed once, on the worker, and every copy starts from it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from lorakit.engine.errors import Overloaded
from lorakit.ops import cdiv

__all__ = ["Compile", "CompileQueue", "Constraint", "Grammar", "GrammarError", "Pending", "build_grammar",
           "unpack_mask"]

logger = logging.getLogger("lorakit.structured")

PROBE_TOKENS = 8  # first tokens a compiled grammar is tried on, each on a copy of its matcher
POLL_SECONDS = 0.05  # how often a request waiting for a worker looks again
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


class Compile:
    """One grammar's compile, shared by every request that asks for it while a cache keeps it: queued (``started``
    None), running, finished (``future`` done), or ``dropped`` unstarted (``future`` holds ``Overloaded``).
    ``client``: who asked first, for the queue's fairness (None: nobody known, a client of its own); ``deadline``: when
    the last request waiting for it stops waiting (``time.monotonic()``); ``forget``: called when it is dropped (a
    cache lets go of a refusal that was not the grammar's doing)."""

    def __init__(self, max_seconds: float, client: Hashable = None, build: Callable[[], Grammar] | None = None,
                 forget: Callable[[], None] | None = None):
        self.max_seconds, self.client, self.build, self.forget = max_seconds, client, build, forget
        self.deadline = time.monotonic()
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None  # time.monotonic() when a worker took it, and when it finished
        self.finished: float | None = None
        self.dropped = False

    def refuse(self, error: Exception) -> None:
        """Refused before any work (too large, no tokenizer)."""
        self.started = self.finished = time.monotonic()
        self.future.set_exception(error)

    def drop(self, error: Overloaded) -> None:
        """Refused unstarted, for want of a worker: its waiters get ``error``."""
        self.dropped, self.finished = True, time.monotonic()
        self.future.set_exception(error)
        if self.forget is not None:
            self.forget()

    def run(self) -> None:
        """On a worker: ``build()``'s grammar, or its GrammarError (any other exception: logged, and a refusal)."""
        self.started = time.monotonic()
        try:
            result = self.build()
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
        """Whether it ran (or has run so far) past ``max_seconds`` on its worker."""
        if self.started is None:
            return False
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.started > self.max_seconds


def waited(max_seconds: float) -> Overloaded:
    """The refusal of a grammar no worker took within its budget."""
    return Overloaded(f"the grammar waited {max_seconds:g} s (this server's --max-grammar-seconds) for a grammar "
                      f"worker, all busy with other requests' grammars, and was not compiled; send it again later",
                      max_seconds)


class Pending:
    """One request's wait for a grammar (its ``Compile`` shared with the other requests that ask for the same one).
    Its budget of ``max_seconds`` counts from the request: a compile no worker has taken by then is refused
    (``Overloaded``: the server was busy, the grammar is not at fault); one a worker took in time gets ``max_seconds``
    on that worker, past which it is refused (GrammarError) even if it finishes later (llguidance cannot be stopped: it
    finishes on its worker, and its refusal is what a cache keeps). So a request waits at most twice the budget.
    ``done()`` once it is decided; ``result()`` then gives the ``Grammar`` or raises."""

    def __init__(self, max_seconds: float, error: str | None = None, compile: Compile | None = None):
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.compile = compile or Compile(max_seconds)
        self.compile.deadline = max(self.compile.deadline, self.deadline)  # kept queued while anyone waits for it
        if error is not None:
            self.compile.refuse(GrammarError(error))

    @property
    def future(self) -> concurrent.futures.Future:
        return self.compile.future

    @property
    def started(self) -> float | None:
        return self.compile.started

    @property
    def finished(self) -> float | None:
        return self.compile.finished

    def late(self) -> bool:
        """Whether its compile ran (or has run so far) past ``max_seconds`` on its worker."""
        return self.compile.late()

    def waited_out(self) -> bool:
        """Whether no worker took its compile within its budget."""
        started = self.compile.started
        return (time.monotonic() if started is None else started) > self.deadline

    def done(self) -> bool:
        return self.future.done() or self.late() or self.waited_out()

    def result(self) -> Grammar:
        """The compiled grammar; GrammarError if it was refused or ran past the budget, Overloaded if no worker took
        it in time (call once ``done()``)."""
        if self.late():
            raise GrammarError(f"the grammar did not compile within {self.max_seconds:g} s (this server's "
                               f"--max-grammar-seconds); simplify it (fewer optional properties, alternatives or "
                               f"nested repetitions)")
        if not self.future.done() and self.waited_out():
            raise waited(self.max_seconds)
        return self.future.result()  # set right after ``finished``

    def _left(self) -> float:
        """Seconds until it is surely done, or until a short poll while no worker has taken it."""
        now, started = time.monotonic(), self.compile.started
        if started is None:
            return min(max(self.deadline - now, 0.0), POLL_SECONDS) + 0.001
        return max(started + self.max_seconds - now, 0.0) + 0.001

    def wait(self) -> Grammar:
        """Blocks until done (at most twice the budget); its result."""
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


class CompileQueue:
    """Compiles waiting for a worker, and the daemon threads that run them (daemons: a compile past its budget never
    holds up an exit), started as the work comes.

    Fair between clients: a free worker takes the oldest compile of the next client in turn (round-robin), and one
    client runs at most ``workers - 1`` compiles at once (at least one), so that a worker is left to the others.
    Bounded: at most ``max_queued`` compiles wait, all clients together; past that a newcomer takes the place of the
    newest compile of the client with the most waiting, or is dropped (``Overloaded``) if that client has no more
    than one more than the newcomer's. A compile still queued at its deadline is dropped, never run."""

    def __init__(self, workers: int, max_queued: int, name: str):
        self.workers, self.max_queued, self._name = workers, max_queued, name
        self.per_client = max(workers - 1, 1)
        self._queues: OrderedDict[Hashable, deque[Compile]] = OrderedDict()  # by client, in turn order
        self._running: dict[Hashable, int] = {}
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    def put(self, job: Compile) -> None:
        """Queue ``job`` for a worker, or drop it (its waiters get ``Overloaded``) when the queue is full."""
        key = _key(job)
        with self._cond:
            self._expire()
            if sum(map(len, self._queues.values())) >= self.max_queued:
                longest = max(self._queues, key=lambda k: len(self._queues[k]))
                if len(self._queues[longest]) < len(self._queues.get(key, ())) + 2:
                    job.drop(self._full(job.max_seconds))
                    return
                self._queues[longest].pop().drop(self._full(job.max_seconds))
            self._queues.setdefault(key, deque()).append(job)
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()

    def _full(self, retry_after: float) -> Overloaded:
        """Each compile waiting leaves the queue within its budget: ``retry_after``."""
        return Overloaded(f"{self.max_queued} grammars are waiting for this server's {self.workers} grammar workers "
                          f"(its bound, --max-grammar-queue); send it again later", retry_after)

    def _expire(self) -> None:
        now = time.monotonic()
        for key, jobs in list(self._queues.items()):
            for job in [job for job in jobs if job.deadline < now]:
                jobs.remove(job)
                job.drop(waited(job.max_seconds))
            if not jobs:
                del self._queues[key]

    def _take(self) -> Compile:
        with self._cond:
            while True:
                self._expire()
                for key, jobs in self._queues.items():
                    if self._running.get(key, 0) < self.per_client:
                        job = jobs.popleft()
                        if jobs:
                            self._queues.move_to_end(key)
                        else:
                            del self._queues[key]
                        self._running[key] = self._running.get(key, 0) + 1
                        return job
                self._cond.wait()

    def _work(self) -> None:
        while True:
            job = self._take()
            try:
                job.run()
            except Exception:  # noqa: BLE001 - a bug in one compile must not stop the worker
                logger.exception("a %s worker's work failed", self._name)
            finally:
                with self._cond:
                    key = _key(job)
                    self._running[key] -= 1
                    if not self._running[key]:
                        del self._running[key]
                    self._cond.notify_all()


def _key(job: Compile) -> Hashable:
    """Whose turn a compile takes: its client's, or (nobody known) its own."""
    return job if job.client is None else ("client", job.client)


def unpack_mask(packed: Tensor, vocab_size: int) -> Tensor:
    """[B, W] int32 bitmask -> [B, vocab_size] bool (True: allowed), on ``packed``'s device."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed[:, :, None] >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()
