"""The scheduler against a mock model and a mock pool: everything finishes, the adapter limit holds at every
step, nobody starves under adversarial arrivals, and abort and preemption lose nothing and leak nothing."""

from collections import OrderedDict

import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from lorakit.adapters.pool import AdapterRef
from lorakit.engine.scheduler import BlockManager, Request, Scheduler
from lorakit.peft import AdapterError
from lorakit.ops import cdiv


def ref(name: str | None, version: int = 1) -> AdapterRef | None:
    """A request's adapter as the engine hands it to the scheduler (None: the base model)."""
    return None if name is None else AdapterRef(name, version, f"sha-of-{name}-v{version}")


class FakePool:
    """max_loras slots; an upload takes ``delay`` steps to land (``tick`` advances time). Each version is an adapter
    of its own; one in ``gone`` cannot be served (its weights changed on disk), as the real pool's. ``claims``: the
    claims requests hold (the engine takes them, the scheduler gives them back)."""

    def __init__(self, slots: int, delay: int = 0):
        self.slots: list[AdapterRef | None] = [None] * slots
        self.gone: dict[AdapterRef, str] = {}
        self.claims: dict[AdapterRef, int] = {}
        self.refs = [0] * slots
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.landing: dict[int, int] = {}  # slot -> step its upload lands
        self.delay = delay
        self.now = 0

    def tick(self):
        self.now += 1

    def check(self, adapter):
        if adapter in self.gone:
            raise AdapterError(self.gone[adapter])

    def claim(self, adapter):
        self.claims[adapter] = self.claims.get(adapter, 0) + 1

    def unclaim(self, adapter):
        assert self.claims.get(adapter, 0) > 0, f"{adapter} unclaimed more often than claimed"
        self.claims[adapter] -= 1

    def ready(self, name):
        self.check(name)
        slot = self.slots.index(name) if name in self.slots else None
        return slot is not None and self.landing.get(slot, 0) <= self.now

    def prefetch(self, names):
        for name in names:
            self.check(name)
        for i, name in enumerate(names):
            if name in self.slots:
                continue
            free = [s for s in range(len(self.slots)) if self.slots[s] is None]
            # as the pool: never the slot of an adapter needed before this one
            victims = [s for s in self.lru if self.refs[s] == 0 and self.slots[s] not in names[:i]]
            slot = free[0] if free else victims[0] if victims else None
            if slot is None:
                continue
            self.slots[slot] = name
            self.lru[slot] = None
            self.lru.move_to_end(slot)
            self.landing[slot] = self.now + self.delay
        return [n for n in names if n in self.slots]

    def acquire(self, names):
        out = []
        for name in names:
            assert self.ready(name), f"{name} acquired before its upload landed"
            slot = self.slots.index(name)
            self.refs[slot] += 1
            self.lru.move_to_end(slot)
            out.append(slot)
        return out

    def pinned(self, name):
        return False

    def release(self, slots):
        for slot in slots:
            assert self.refs[slot] > 0
            self.refs[slot] -= 1


def token(request, index):
    """The mock model's deterministic output: what a request's index-th token is."""
    return (hash(request.request_id) + 7 * index) % 1000


def simulate(arrivals, *, slots, num_blocks, block_size=4, max_num_seqs=4, budget=16, patience=4, delay=0,
             aborts=(), max_steps=20000):
    """arrivals: [(step, adapter, prompt_len, max_tokens)]. Runs to the end; returns requests and per-step stats."""
    pool = FakePool(slots, delay)
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(pool, blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, patience=patience)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    requests, started, arrived_at = [], {}, {}
    aborts = dict(aborts)  # step -> index of the request to abort
    step = 0
    while pending or sched.has_unfinished():
        assert step < max_steps, "did not finish"
        while pending and pending[0][1][0] <= step:
            i, (_, adapter, prompt_len, max_tokens) = pending.pop(0)
            r = Request(f"r{i}", list(range(prompt_len)), ref(adapter), max_tokens, sched.next_seq(),
                        claimed=adapter is not None)
            if adapter is not None:
                pool.claim(r.adapter)
            requests.append(r)
            arrived_at[r] = step
            sched.add(r)
        if step in aborts and aborts[step] < len(requests):
            victim = requests[aborts[step]]
            if victim.finish_reason is None:
                sched.abort(victim)
                victim.finish_reason = "abort"
        plan = sched.schedule()
        # Invariants at every step.
        running_adapters = {r.adapter for r in sched.running if r.adapter is not None}
        assert len(running_adapters) <= slots
        for r in sched.running:
            assert (r.slot == -1) == (r.adapter is None)
            if r.adapter is not None:
                assert pool.slots[r.slot] == r.adapter
        held = sum(len(r.blocks) for r in sched.running)
        assert held + blocks.num_free == num_blocks
        assert plan.num_tokens <= budget and len(sched.running) <= max_num_seqs
        for item in plan.items:
            assert len(item.request.blocks) * block_size >= item.start + len(item.tokens)
            assert item.tokens == item.request.all_ids[item.start: item.start + len(item.tokens)]
            started.setdefault(item.request, step)
        if sched.draining is not None:  # no request of the adapter being drained starts while it drains
            assert all(started[i.request] < step for i in plan.items if i.request.adapter_name == sched.draining)
        sampled = {i.request: token(i.request, len(i.request.output_ids)) for i in plan.items if i.sample}
        finished = {r: "length" for r in sampled if len(r.output_ids) + 1 >= r.max_tokens}
        sched.postprocess(plan, sampled, finished)
        pool.tick()
        step += 1
    assert blocks.num_free == num_blocks and all(n == 0 for n in pool.refs)  # nothing leaked
    assert all(n == 0 for n in pool.claims.values())  # every claim given back, once
    return requests, started, arrived_at, step


arrival = st.tuples(st.integers(0, 30), st.sampled_from([None, "A", "B", "C", "D"]), st.integers(1, 20),
                    st.integers(1, 12))


@settings(deadline=None)
@given(arrivals=st.lists(arrival, min_size=1, max_size=25), slots=st.integers(1, 3), max_num_seqs=st.integers(1, 6),
       budget=st.integers(4, 32), extra_blocks=st.integers(0, 12), patience=st.integers(0, 8),
       delay=st.integers(0, 3), aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 24)), max_size=4))
def test_everything_finishes_within_a_bound_and_nothing_is_lost(arrivals, slots, max_num_seqs, budget, extra_blocks,
                                                                 patience, delay, aborts):
    block_size = 4
    longest = max(p + m for _, _, p, m in arrivals)
    num_blocks = cdiv(longest, block_size) + extra_blocks  # sometimes barely one request: preemption
    requests, started, arrived_at, _ = simulate(arrivals, slots=slots, num_blocks=num_blocks, block_size=block_size,
                                                max_num_seqs=max_num_seqs, budget=budget, patience=patience,
                                                delay=delay, aborts=aborts)
    for r in requests:
        if r.finish_reason == "abort":
            continue
        assert r.finish_reason == "length"
        # Nothing lost to preemption: exactly the tokens the mock model gives, in order.
        assert r.output_ids == [token(r, i) for i in range(r.max_tokens)]
    # Bounded wait: a request starts within patience plus the work of everything that arrived before it.
    for r in requests:
        if r in started:
            before = [q for q in requests if arrived_at[q] <= arrived_at[r]]
            work = sum(len(q.prompt_ids) + q.max_tokens for q in before) * (1 + max(q.preemptions for q in before))
            assert started[r] - arrived_at[r] <= patience + delay + work + 2


def test_one_slot_a_b_a_a_does_not_starve_b():
    """vLLM's and SGLang's starvation case: one slot, a stream of A requests, one B among them."""
    arrivals = [(0, "A", 4, 5), (1, "B", 4, 5)] + [(t, "A", 4, 5) for t in range(1, 400)]
    patience = 8
    requests, started, arrived_at, steps = simulate(arrivals, slots=1, num_blocks=64, max_num_seqs=8, budget=64,
                                                    patience=patience)
    b = next(r for r in requests if r.adapter_name == "B")
    assert started[b] - arrived_at[b] <= patience + 5 + 3  # patience, then the running As drain (5 tokens)
    # And with no patience at all, strict arrival order.
    requests, started, arrived_at, _ = simulate(arrivals, slots=1, num_blocks=64, max_num_seqs=8, budget=64,
                                                patience=0)
    b = next(r for r in requests if r.adapter_name == "B")
    assert started[b] - arrived_at[b] <= 5 + 3


def test_while_the_head_waits_for_a_slot_the_batch_stays_full():
    """One slot held by a stream of A requests, B overdue behind them, base requests arriving all along: A drains (no
    new A starts), the base requests keep the batch full meanwhile, and B starts once the running As end."""
    arrivals = ([(0, "A", 4, 20), (1, "B", 4, 5)] + [(t, "A", 4, 20) for t in range(1, 60)]
                + [(t, None, 4, 20) for t in range(2, 60)])
    patience = 4
    sizes = []
    pool = FakePool(1)
    blocks = BlockManager(512, 4)
    sched = Scheduler(pool, blocks, max_num_seqs=16, max_num_batched_tokens=64, patience=patience)
    requests = [Request(f"r{i}", list(range(p)), ref(a), m, sched.next_seq()) for i, (_, a, p, m) in enumerate(arrivals)]
    arrive = {r: t for r, (t, *_) in zip(requests, arrivals)}
    b = requests[1]
    started = {}
    for step in range(400):
        for r in requests:
            if arrive[r] == step:
                sched.add(r)
        plan = sched.schedule()
        for item in plan.items:
            started.setdefault(item.request, step)
        sizes.append(len(sched.running))
        sampled = {i.request: 1 for i in plan.items if i.sample}
        sched.postprocess(plan, sampled, {r: "length" for r in sampled if len(r.output_ids) >= r.max_tokens})
        pool.tick()
        if not sched.has_unfinished() and step > 60:
            break
    assert started[b] - arrive[b] <= patience + 20 + 3  # patience, then the running As' 20 tokens
    waiting_for_slot = range(arrive[b] + patience + 2, started[b])
    assert all(sizes[t] >= 10 for t in waiting_for_slot if t > 12)  # base requests fill the batch meanwhile
    assert not any(r.adapter_name == "A" and arrive[b] + patience + 1 < started[r] < started[b] for r in requests)
    assert all(r.finish_reason == "length" for r in requests)


def test_a_pinned_adapter_is_never_drained_for_the_head():
    class Pinned(FakePool):
        def pinned(self, name):
            return name == "P"

    pool = Pinned(2)
    sched = Scheduler(pool, BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, patience=0)
    for adapter, tokens in (("P", 2), ("A", 30), ("B", 2)):
        sched.add(Request(adapter, [1, 2], ref(adapter), tokens, sched.next_seq()))
        plan = sched.schedule()
        sched.postprocess(plan, {i.request: 1 for i in plan.items if i.sample})
    sched.schedule()
    assert [r.adapter_name for r in sched.running] == ["P", "A"] and sched.draining == "A"  # A ends later, but P is pinned


def test_preemption_when_the_cache_is_full_recomputes_and_continues():
    # Room for one long request at a time: the second preempts or waits, both finish with every token.
    arrivals = [(0, None, 6, 10), (0, "A", 6, 10), (1, None, 6, 10)]
    requests, started, _, _ = simulate(arrivals, slots=1, num_blocks=5, block_size=4, max_num_seqs=3, budget=8,
                                       patience=2)
    assert all(r.output_ids == [token(r, i) for i in range(10)] for r in requests)
    assert sum(r.preemptions for r in requests) >= 1


def test_a_real_failure_in_acquire_surfaces_and_pool_full_only_waits():
    """PoolFull means "wait"; any other error of the pool (a CUDA out-of-memory while growing the slots is a
    RuntimeError) must end the step, not read as "pool full" and retry forever."""
    import pytest

    from lorakit.adapters.pool import PoolFull

    class Failing(FakePool):
        error: Exception | None = None

        def acquire(self, names):
            if self.error is not None:
                raise self.error
            return super().acquire(names)

    pool = Failing(1)
    sched = Scheduler(pool, BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=16)
    sched.add(Request("a", [1, 2, 3], ref("x"), 2, sched.next_seq()))
    pool.error = PoolFull("every slot held")
    assert sched.schedule().items == [] and len(sched.waiting) == 1  # waits
    pool.error = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        sched.schedule()
    assert not issubclass(PoolFull, RuntimeError)


def test_each_request_runs_on_its_version_and_one_that_cannot_be_served_fails_alone():
    """The version a request was admitted with (its tokens checked against that adapter's added tokens, its grammar
    compiled for its tokenizer) is the one it runs on: two versions of one name run side by side, each in a slot of
    its own, keyed apart in the prefix cache. A version the pool cannot serve fails its request alone, with the
    pool's why, and gives its claim back. The scheduler hands the pool each request's ``AdapterRef`` unchanged."""
    pool = FakePool(3)
    pool.gone[ref("y")] = "adapter 'y' at /a: changed on disk since it was registered"
    sched = Scheduler(pool, BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    made = [Request(r, [1, 2], a, 2, sched.next_seq(), claimed=a is not None)
            for r, a in (("old", ref("x", 1)), ("new", ref("x", 2)), ("bad", ref("y")), ("base", None))]
    old, new, bad, base = made
    for r in made:
        if r.claimed:
            pool.claim(r.adapter)
        sched.add(r)
    sched.schedule()
    items = sched.schedule().items  # the uploads started by the first schedule have landed
    assert [i.request for i in items] == [old, new, base] and old.slot != new.slot
    assert [(r, why) for r, why in sched.failed] == [(bad, pool.gone[ref("y")])] and pool.claims[ref("y")] == 0
    assert (old.adapter_key, new.adapter_key, base.adapter_key) == (b"sha-of-x-v1", b"sha-of-x-v2", None)


def test_prompts_are_chunked_to_max_prefill_tokens_while_others_decode():
    s = Scheduler(FakePool(2), BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=512, max_prefill_tokens=64)
    first = Request("a", list(range(300)), None, 4, s.next_seq())
    s.add(first)
    plan = s.schedule()  # nobody decodes yet: the whole budget
    assert [len(i.tokens) for i in plan.items] == [300]
    s.postprocess(plan, {first: 7}, {})
    second = Request("b", list(range(200)), None, 4, s.next_seq())
    s.add(second)
    for chunk in (64, 64, 64, 8):  # "a" decodes: "b" takes 64 prompt tokens a step
        plan = s.schedule()
        assert [len(i.tokens) for i in plan.items] == [1, chunk]
        s.postprocess(plan, {first: 7} | ({second: 9} if plan.items[1].sample else {}), {})
    assert second.num_computed == 200 and len(second.output_ids) == 1


def test_a_queue_that_waited_past_patience_is_admitted_together():
    """Requests that all waited past ``patience`` (queued behind a full batch) start in one step once the batch
    ends, within the budget: the rule that nothing passes an overdue head holds no one back once the head has
    started (it admitted one request a step, the rest of the queue each overdue in turn)."""
    sched = Scheduler(FakePool(1), BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, patience=2)
    first = [Request(f"a{i}", [1, 2, 3], None, 6, sched.next_seq()) for i in range(8)]
    queued = [Request(f"b{i}", [4, 5, 6], None, 4, sched.next_seq()) for i in range(8)]
    for r in first + queued:
        sched.add(r)
    while any(r.finish_reason is None for r in first):
        plan = sched.schedule()
        finished = {i.request: "length" for i in plan.items if i.sample and len(i.request.output_ids) + 1 >=
                    i.request.max_tokens}
        sched.postprocess(plan, {i.request: 1 for i in plan.items if i.sample}, finished)
    assert all(r.waited > 2 for r in queued)
    sched.schedule()
    assert sched.running == queued and not sched.waiting
