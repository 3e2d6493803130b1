"""Continuous batching with adapters: which requests run each step, and with how many tokens.

``schedule()`` gives each running request its next tokens, then admits waiting ones while the token budget, the
sequence limit, the KV cache and the adapter slots allow; ``postprocess()`` retires the finished. It knows nothing
about tensors. Admission, no starvation, preemption and the prefix cache: docs/engine.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorakit.engine.admission import Verdict, WaitingQueue
from lorakit.engine.finish import FinishReason
from lorakit.engine.kv_blocks import BASE, BlockManager, block_key
from lorakit.adapters.pool import AdapterRef, PoolFull
from lorakit.peft import AdapterError

__all__ = ["AdapterSlots", "BlockManager", "Request", "Scheduled", "Scheduler", "StepPlan"]

LOOKAHEAD = 32  # waiting requests whose adapters start their uploads each step, in queue order


class AdapterSlots(Protocol):
    """What the scheduler needs of the adapter pool (``AdapterPool`` has it), asked with the request's
    ``AdapterRef``, the version its engine ``claim``ed for it (the scheduler ``unclaim``s it when the request leaves).
    ``acquire`` raises ``PoolFull`` when every slot it would need is held (the request waits); ``ready``, ``prefetch``
    and ``acquire`` raise ``AdapterError`` for an adapter whose weights cannot be read (the request fails); anything
    else is a real failure of the step."""

    def ready(self, adapter: AdapterRef) -> bool: ...

    def prefetch(self, adapters: Iterable[AdapterRef]) -> list[AdapterRef]: ...

    def acquire(self, adapters: list[AdapterRef | None]) -> list[int]: ...

    def release(self, slots: Iterable[int]) -> None: ...

    def unclaim(self, adapter: AdapterRef) -> None: ...

    def pinned(self, name: str) -> bool:
        """Whether ``name`` is pinned in its slot (never drained for another adapter)."""
        ...


@dataclass(eq=False)
class Request:
    """One generation request and its progress. ``seq`` counts arrivals (the fairness order)."""

    request_id: str
    prompt_ids: list[int]
    adapter: AdapterRef | None  # the version it was prepared for, as resolved at the edge (None: the base model)
    max_tokens: int
    seq: int
    params: Any = None  # SamplingParams, opaque to the scheduler
    seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the KV cache
    blocks: list[int] = field(default_factory=list)
    slot: int = -1  # its adapter slot while running, -1 for the base model
    lora_start: int = 0  # positions before it run as the base model (an activated LoRA's invocation; 0: none)
    block_keys: list[bytes] = field(default_factory=list)  # the prefix-cache keys of its first full blocks
    num_cached: int | None = None  # prompt tokens its first admission found in the prefix cache
    num_pending: int = 0  # trailing output tokens still on the device (async scheduling): not hashed yet
    prefix_keys: tuple = ()  # (adapter_key, number of tokens, keys of its full blocks): computed once per admission
    computing: list[bytes] = field(default_factory=list)  # keys of the blocks it computes, not registered yet
    waited: int = 0  # steps spent waiting since arrival or preemption
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    claimed: bool = False  # it holds a claim on its adapter's version, given back when it leaves (``Scheduler.abort``)
    state: Any = None  # the engine's per-request state (stop ids, logprobs, grammar)

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    @property
    def adapter_key(self) -> bytes | None:
        """What the prefix cache keys its adapter's KV blocks by: the version's content hash (None: the base)."""
        return None if self.adapter is None else self.adapter.sha256.encode()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class Scheduled:
    """One request's share of a step: ``tokens`` are fed at positions ``start`` ..; ``sample`` is whether its
    last position's logits give a new token (False for a chunk in the middle of a prompt)."""

    request: Request
    start: int
    tokens: list[int]
    sample: bool
    all_logits: bool = False  # every position's logits are kept: the prompt's logprobs (``prompt_logprobs``)


@dataclass
class StepPlan:
    items: list[Scheduled]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.tokens) for i in self.items)


class Scheduler:
    def __init__(self, pool: AdapterSlots | None, blocks: BlockManager, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, patience: int = 16, max_prefill_tokens: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or patience < 0 or (max_prefill_tokens or 1) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_prefill_tokens must be >= 1, patience >= 0")
        self.pool = pool
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_prefill_tokens or max_num_batched_tokens  # while any request decodes
        self.queue = WaitingQueue(patience)
        self.running: list[Request] = []  # in admission order
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.failed: list[tuple[Request, str]] = []  # requests whose adapter could not be loaded, and why
        # the prefix cache, by adapter name (None: the base model): [prompt tokens admitted, of them found cached]
        self.prefix_stats: dict[str | None, list[int]] = {}
        self.computed_prompt_tokens = 0  # prompt positions run through the model (recomputations included)
        self._computing: dict[bytes, int] = {}  # keys of blocks running requests are computing -> how many
        self._on_the_way: set[AdapterRef] = set()  # adapters in a slot or uploading, as of this step's lookahead

    def next_seq(self) -> int:
        return next(self._seq)

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests in arrival order."""
        return self.queue.requests

    @property
    def draining(self) -> str | None:
        """The adapter no new request starts on, so that its slot frees for an overdue head."""
        return self.queue.draining

    def add(self, request: Request) -> None:
        self.queue.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is, freeing its blocks, its slot and its claim on its adapter's version."""
        if request in self.waiting:
            self.queue.remove(request)
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        self._unclaim(request)

    def _unclaim(self, request: Request) -> None:
        if request.claimed:
            request.claimed = False
            self.pool.unclaim(request.adapter)

    # One step.

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        # Prompt tokens (chunks, recomputation) this step may take: fewer while requests decode, so that a long
        # prompt is prefilled in chunks and the decodes' steps stay short.
        decoding = any(r.num_computed >= len(r.prompt_ids) for r in self.running)
        prefill = self.max_prefill_tokens if decoding else budget
        items: list[Scheduled] = []
        preempted: list[Request] = []
        for request in list(self.running):
            if request not in self.running:  # preempted by an earlier one in this loop
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            if n > 1 or request.num_computed < len(request.prompt_ids):  # a prompt chunk
                n = min(n, prefill)
                prefill -= n
            if n <= 0:
                continue
            while not self.blocks.can_grow(request.blocks, request.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                items = [i for i in items if i.request is not victim]
                if victim is request:
                    break
            if request not in self.running:
                continue
            self.blocks.grow(request.blocks, request.num_computed + n)
            items.append(self._item(request, n))
            budget -= n
        if not preempted:
            self._admit(items, budget, prefill)
        self.queue.tick()
        return StepPlan(items, preempted)

    def _admit(self, items: list[Scheduled], budget: int, prefill: int) -> None:
        """Admit waiting requests within ``budget`` tokens, of which ``prefill`` prompt tokens, in the order and
        under the rule of the waiting queue (``admission.py``)."""
        turn = self.queue.turn()
        ready = self._lookahead()  # adapter -> landed in a slot, or why it cannot be served (asked once a step)
        for request in turn.candidates:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            verdict = turn.check(request, len(self.running), self.max_num_seqs)
            if verdict is Verdict.STOP:
                break
            if verdict is Verdict.SKIP:
                continue
            if min(request.num_tokens, budget, prefill) <= 0:
                break
            waits = self._try_admit(request, items, budget, prefill, ready, turn.kept_for_head(request))
            if waits is None:
                n = len(items[-1].tokens)
                budget -= n
                prefill -= n
                turn.started(request)
            elif turn.waits(request, waits, self._head_blocks, self._drain_choice, self._on_the_way):
                break
        turn.end()

    def _head_blocks(self, request: Request) -> int:
        return self.blocks.blocks_for(min(request.num_tokens, self.max_prefill_tokens))

    def _try_admit(self, request: Request, items: list[Scheduled], budget: int, prefill: int,
                   ready: dict[AdapterRef, bool | AdapterError],
                   reserve: tuple[int, int] | None) -> str | None:
        """Admit ``request`` (its first chunk appended to ``items``) and return None, or return what it waits for:
        "slot" (its adapter is not in a slot yet, or every slot is held) or "blocks" (KV blocks, or blocks a running
        request is computing). ``reserve``: blocks to leave free (an overdue head's)."""
        if not self._adapter_ready(request, ready):
            return "slot"
        keys = self._prefix_keys(request)
        # A request that asks for its prompt's logprobs computes its whole prompt: a cached block has no logits.
        cached = [] if _scores_prompt(request) else self.blocks.lookup(keys)
        start = len(cached) * self.blocks.block_size
        n = min(request.num_tokens - start, budget, prefill)
        kept = 0 if reserve is None else reserve[0]
        if (any(k in self._computing for k in keys[len(cached):])  # being computed: take it once registered
                or self.blocks.blocks_for(start + n) - len(cached) + kept
                > self.blocks.num_free - self.blocks.idle_among(cached)):
            return "blocks"
        if request.adapter is not None:
            try:
                (request.slot,) = self.pool.acquire([request.adapter])
            except PoolFull:  # every slot held; keep waiting
                return "slot"
        self.queue.remove(request)
        self.running.append(request)
        request.waited = 0
        self.blocks.hold(cached)
        request.blocks, request.block_keys, request.num_computed = list(cached), keys[: len(cached)], start
        request.computing = keys[len(cached):]
        for key in request.computing:
            self._computing[key] = self._computing.get(key, 0) + 1
        if request.num_cached is None:  # its first admission: what the prefix cache served
            request.num_cached = min(start, len(request.prompt_ids))
            stats = self.prefix_stats.setdefault(request.adapter_name, [0, 0])
            stats[0] += len(request.prompt_ids)
            stats[1] += request.num_cached
        self.blocks.grow(request.blocks, start + n)
        items.append(self._item(request, n))
        return None

    def _drain_choice(self) -> str | None:
        """The adapter to drain for a head that waits for a slot: of those running requests hold (not pinned), the
        one whose longest remaining output is shortest (its slot frees first). None when none can be drained."""
        remaining: dict[str, int] = {}
        for r in self.running:
            if r.adapter is not None:
                left = r.max_tokens - len(r.output_ids) + max(0, len(r.prompt_ids) - r.num_computed)
                remaining[r.adapter.name] = max(remaining.get(r.adapter.name, 0), left)
        choices = [(left, name) for name, left in remaining.items() if not self.pool.pinned(name)]
        return min(choices)[1] if choices else None

    def _lookahead(self) -> dict[AdapterRef, bool | AdapterError]:
        """Start the uploads of the adapters the first ``LOOKAHEAD`` waiting requests need, in queue order (the head's
        first), into free slots or slots no running request holds; ``prefetch`` never evicts one of them for another
        and skips what finds no room. Returns what ``_adapter_ready`` asks: each adapter's readiness (or its error)."""
        wanted = list(dict.fromkeys(r.adapter for r in self.waiting[:LOOKAHEAD] if r.adapter is not None))
        found: dict[AdapterRef, bool | AdapterError] = {}
        if not wanted:
            self._on_the_way = set()
            return found
        try:
            self._on_the_way = set(self.pool.prefetch(wanted))
        except AdapterError:  # one of them cannot be served: one at a time, to find which
            self._on_the_way = set()
            for adapter in wanted:
                try:
                    self._on_the_way.update(self.pool.prefetch([adapter]))
                except AdapterError as e:
                    found[adapter] = e
        return found

    def _who(self, request: Request, block: int) -> bytes:
        """Whose weights compute the keys and values of ``request``'s ``block``: the base model's (the base's
        requests, and the blocks wholly before an activated LoRA's invocation), its adapter's, or, for the block an
        invocation starts inside, its adapter's from that offset on (the same tokens activated at another position
        have other keys and values, and so another key)."""
        size, start = self.blocks.block_size, request.lora_start
        if request.adapter_key is None or (block + 1) * size <= start:
            return BASE
        if block * size < start:
            return request.adapter_key + b"@" + (start - block * size).to_bytes(4, "little")
        return request.adapter_key

    def _prefix_keys(self, request: Request) -> list[bytes]:
        """The keys of ``request``'s full blocks of known tokens, leaving at least one token to compute in a block
        of its own (computed once for its adapter version and length, however long it waits)."""
        if not self.blocks.prefix_cache:
            return []
        size = self.blocks.block_size
        limit = min(request.num_tokens - 1, request.num_tokens - request.num_pending) // size
        if request.prefix_keys[:2] != (request.adapter_key, limit):
            ids = request.all_ids if limit else ()
            keys, parent = [], b""
            for i in range(limit):
                parent = block_key(parent, self._who(request, i), ids[i * size: (i + 1) * size])
                keys.append(parent)
            request.prefix_keys = (request.adapter_key, limit, keys)
        return request.prefix_keys[2]

    def _done_computing(self, request: Request, keys) -> None:
        for key in keys:
            if key in request.computing:
                request.computing.remove(key)
                left = self._computing[key] - 1
                if left:
                    self._computing[key] = left
                else:
                    del self._computing[key]

    def _register(self, request: Request) -> None:
        """Register ``request``'s full blocks whose tokens are known and computed, in order."""
        if not self.blocks.prefix_cache:
            return
        size = self.blocks.block_size
        known = min(request.num_computed, request.num_tokens - request.num_pending) // size
        done = len(request.block_keys)
        if done >= known:
            return
        # the keys its admission computed for its prompt (same tokens, same weights), then the rest
        computed = request.prefix_keys[2] if request.prefix_keys[:1] == (request.adapter_key,) else []
        ids = request.all_ids if known > len(computed) else ()
        for i in range(done, known):
            key = computed[i] if i < len(computed) else block_key(
                request.block_keys[-1] if i else b"", self._who(request, i), ids[i * size: (i + 1) * size])
            request.block_keys.append(key)
            self.blocks.register(request.blocks[i], key)
        if request.computing:
            self._done_computing(request, request.block_keys[done:])

    def _adapter_ready(self, request: Request, ready: dict[AdapterRef, bool | AdapterError]) -> bool:
        """Whether ``request``'s adapter has landed in a slot (None: the base model, always); ``ready`` caches the
        answer per adapter version for this step. A request whose adapter cannot be served (its weights changed on
        disk, or turned out bad) fails."""
        adapter = request.adapter
        if adapter is None:
            return True
        state = ready.get(adapter)
        if state is None:
            try:
                state = self.pool.ready(adapter)
            except AdapterError as e:  # its weights cannot be read again, or turned out bad
                state = e
            ready[adapter] = state
        if isinstance(state, AdapterError):
            self.queue.remove(request)
            self._unclaim(request)
            self.failed.append((request, str(state)))
            return False
        return state

    def _item(self, request: Request, n: int) -> Scheduled:
        start = request.num_computed
        return Scheduled(request, start, request.all_ids[start: start + n], start + n == request.num_tokens,
                         _scores_prompt(request) and start < len(request.prompt_ids))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed = 0
        request.preemptions += 1
        self.num_preemptions += 1
        request.waited = 0
        self.queue.add(request)

    def _release(self, request: Request) -> None:
        self._register(request)
        self._done_computing(request, list(request.computing))
        self.blocks.free(request.blocks)
        request.block_keys = []
        if request.slot != -1:
            self.pool.release([request.slot])
            request.slot = -1

    def postprocess(self, plan: StepPlan, sampled: dict[Request, int],
                    finished: dict[Request, FinishReason] | None = None, pending: bool = False) -> None:
        """After the step ran: count the fed tokens as computed, append sampled tokens, retire finished ones
        (``finished`` maps a request to its finish reason, decided by the engine from the new token). ``pending``:
        the sampled tokens are placeholders for tokens still on the device (``resolve`` puts each in place later)."""
        for item in plan.items:
            request = item.request
            request.num_computed = item.start + len(item.tokens)
            self.computed_prompt_tokens += max(0, min(request.num_computed, len(request.prompt_ids)) - item.start)
            if request in sampled:
                request.output_ids.append(sampled[request])
                request.num_pending += pending
            self._register(request)
        for request, reason in (finished or {}).items():
            self.finish(request, reason)

    def resolve(self, request: Request, index: int, token: int) -> None:
        """The token sampled for output position ``index`` (a placeholder until now) has reached the host."""
        request.output_ids[index] = token
        request.num_pending -= 1

    def finish(self, request: Request, reason: FinishReason) -> None:
        """A request ended (the engine decided it from its new token, or it failed): dropped wherever it is (running,
        or preempted by the step after the one that finished it)."""
        request.finish_reason = reason
        self.abort(request)


def _scores_prompt(request: Request) -> bool:
    """Whether ``request`` asks for its prompt's logprobs (``SamplingParams.prompt_logprobs``)."""
    return request.params is not None and request.params.prompt_logprobs is not None
