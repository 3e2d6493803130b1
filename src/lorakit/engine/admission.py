"""Which waiting request may start next: the scheduler's policy, kept apart from its mechanism (the token budget, KV
blocks, adapter slots, the prefix cache), as vLLM keeps its request queue apart from its scheduler.

Requests wait in arrival order. A later one may pass the oldest (the head) while the head has waited at most
``patience`` steps. After that, nothing passes a head that waits for KV blocks or the budget; for a head that waits
for a slot, one adapter is drained (no new request of it starts) and the rest may pass as long as they leave the head
its first chunk's blocks and one sequence. docs/engine.md ("No starvation") says why the wait stays bounded.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Collection, Hashable
from typing import Protocol

__all__ = ["Request", "Turn", "Verdict", "WaitingQueue"]


class Request(Protocol):
    """What the policy reads of a waiting request (``scheduler.Request`` has it)."""

    seq: int  # its place in arrival order
    waited: int  # steps waited since arrival or preemption
    adapter: Hashable | None

    @property
    def adapter_name(self) -> str | None: ...


class Verdict(enum.Enum):
    TRY = "try"  # admit it if the mechanism allows
    SKIP = "skip"  # not this one (its adapter is being drained); the next may start
    STOP = "stop"  # nobody else this step


class WaitingQueue:
    """The waiting requests in arrival order (``seq``), and the adapter being drained for an overdue head."""

    def __init__(self, patience: int):
        self.patience = patience
        self.requests: list[Request] = []  # sorted by seq
        self.draining: str | None = None

    def add(self, request: Request) -> None:
        bisect.insort(self.requests, request, key=lambda r: r.seq)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def tick(self) -> None:
        """A step went by: every waiting request has waited one more."""
        for request in self.requests:
            request.waited += 1

    def turn(self) -> Turn:
        return Turn(self)


class Turn:
    """One step's pass over the queue: asked before each request is tried (``check``), told what became of it
    (``started`` / ``waits``), and closed with ``end``."""

    def __init__(self, queue: WaitingQueue):
        self.queue = queue
        self.candidates = list(queue.requests)
        self._new_head()
        self.promoted = False  # the head started this step, and the next in line became the head
        self.reserve: tuple[int, int] | None = None  # (blocks, sequences) an overdue head waiting for a slot keeps

    def _new_head(self) -> None:
        self.head = self.queue.requests[0] if self.queue.requests else None
        self.overdue = self.head is not None and self.head.waited > self.queue.patience

    def check(self, request: Request, running: int, max_num_seqs: int) -> Verdict:
        if request is self.head or not self.overdue:
            return Verdict.TRY
        if self.reserve is None:
            return Verdict.STOP  # the head waits for KV blocks or the budget: nobody passes it
        if request.adapter_name is not None and request.adapter_name == self.queue.draining:
            return Verdict.SKIP
        if running + self.reserve[1] >= max_num_seqs:
            return Verdict.STOP
        return Verdict.TRY

    def kept_for_head(self, request: Request) -> tuple[int, int] | None:
        """What ``request`` must leave free: the overdue head's reserve (None for the head itself)."""
        return None if request is self.head else self.reserve

    def started(self, request: Request) -> None:
        if request is self.head:  # the next in line is the head now, and may start too
            self.queue.draining = None
            self._new_head()
            self.promoted = True

    def waits(self, request: Request, what: str, head_blocks: Callable[[Request], int],
              drain: Callable[[], str | None], on_the_way: Collection) -> bool:
        """``request`` could not start: it waits for ``what`` ("slot" or "blocks"). True: nobody else this step.
        ``head_blocks``: the blocks of a request's first chunk; ``drain``: the adapter to drain for a slot (None:
        none can be); ``on_the_way``: adapters in a slot or uploading."""
        if request is not self.head or not self.overdue:
            return False
        if self.promoted:
            return True  # a new head, overdue, that cannot start: what may pass it is decided next step
        if what == "slot":
            self.reserve = (head_blocks(request), 1)
            if self.queue.draining is None and request.adapter not in on_the_way:
                self.queue.draining = drain()  # no slot is free or unheld: one is to be freed
        return False

    def end(self) -> None:
        if self.queue.draining is not None and (self.head is None or not self.overdue):
            self.queue.draining = None
