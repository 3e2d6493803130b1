"""The prefix cache (engine/kv_blocks.py): it never changes an output and never loses a block.

- BlockManager under random operations keeps every block free, idle (cached, unheld) or held, exactly once.
- Random workloads of shared prefixes over the base model and adapters, with preemption, aborts and a hot-swap
  between two phases, give the same greedy tokens with the cache on as with it off, and end with every block free.
- A hot-swapped adapter (same name, new weights) never reaches the old version's blocks (vLLM #42125): its requests
  find nothing cached and generate what a fresh engine with the new weights generates; the old version's content,
  registered again, finds its blocks (the key is the content, not the name or the version number).
- The usage block reports the cached prompt tokens (completions, and the final streamed chunk).
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.engine import Engine, SamplingParams
from lorakit.engine.kv_blocks import BlockManager, block_key

BLOCK = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    base = tiny_model("llama", seed=3)
    saved = {}
    for seed, (name, rank) in enumerate({"a": 4, "b": 8, "b2": 8}.items()):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS["llama"], init_lora_weights=False)
        saved[name] = save_adapter(base, name, cfg, tmp, seed=seed + 10, std=0.2)
    return base, saved


def engine_for(setup, prefix_cache: bool, num_blocks: int = 200) -> Engine:
    base, saved = setup
    return Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, max_num_batched_tokens=16, block_size=BLOCK,
                  num_blocks=num_blocks, max_seq_len=64, patience=3, prefix_cache=prefix_cache,
                  adapters={"a": saved["a"].path, "b": saved["b"].path})


def run(engine: Engine, work: list, aborts: dict[int, int]) -> dict[str, list[int]]:
    """Each (arrival step, prompt, adapter, max_tokens) request's greedy tokens; ``aborts``: request -> step."""
    got, step, pending = {}, 0, list(enumerate(work))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, adapter, max_tokens) = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               adapter, request_id=str(i))
            got[str(i)] = []
        for i, at in aborts.items():
            if at == step:
                engine.abort(str(i))
        for out in engine.step():
            got[out.request_id] += out.token_ids
        step += 1
        assert step < 1000
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks, "a block is still held"
    return {k: v for k, v in got.items() if int(k) not in aborts}


@st.composite
def workloads(draw):
    systems = [draw(st.lists(st.integers(3, VOCAB - 1), min_size=6, max_size=18)) for _ in range(2)]
    work = []
    for _ in range(draw(st.integers(2, 7))):
        prompt = draw(st.sampled_from(systems)) + draw(st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=6))
        work.append((draw(st.integers(0, 6)), prompt, draw(st.sampled_from([None, "a", "b"])), draw(st.integers(1, 6))))
    work.sort(key=lambda w: w[0])
    aborts = draw(st.dictionaries(st.integers(0, len(work) - 1), st.integers(0, 10), max_size=2))
    return work, aborts


@given(phases=st.lists(workloads(), min_size=2, max_size=2), tight=st.booleans())
@settings(max_examples=12)
def test_the_cache_never_changes_an_output_and_never_leaks_a_block(setup, phases, tight):
    """Phase 1, then "b" hot-swapped to other weights, then phase 2 (its requests on "b" run the new weights)."""
    outputs = {}
    for on in (False, True):
        engine = engine_for(setup, on, num_blocks=24 if tight else 200)
        got = []
        for k, (work, aborts) in enumerate(phases):
            if k == 1:
                engine.register_adapter("b", setup[1]["b2"].path)
            got.append(run(engine, work, aborts))
        outputs[on] = got
    assert outputs[True] == outputs[False]


def test_a_hot_swapped_adapter_never_reads_the_old_versions_blocks(setup):
    """vLLM #42125: a new version under the same name must not be served the old version's keys and values."""
    base, saved = setup
    prompt = list(range(3, 3 + 4 * BLOCK + 2))  # four full blocks and a bit
    engine = engine_for(setup, True)
    first = run(engine, [(0, prompt, "b", 5)], {})["0"]
    again = run(engine, [(0, prompt, "b", 5)], {})["0"]
    assert again == first and engine.scheduler.prefix_stats["b"] == [2 * len(prompt), 4 * BLOCK]
    engine.register_adapter("b", saved["b2"].path)  # same name, other weights
    swapped = run(engine, [(0, prompt, "b", 5)], {})["0"]
    assert engine.scheduler.prefix_stats["b"] == [3 * len(prompt), 4 * BLOCK], "the new version hit old blocks"
    fresh = engine_for(setup, False)
    fresh.register_adapter("b", saved["b2"].path)
    assert swapped == run(fresh, [(0, prompt, "b", 5)], {})["0"]
    engine.register_adapter("b", saved["b"].path)  # the first weights again: their blocks are still cached
    assert run(engine, [(0, prompt, "b", 5)], {})["0"] == first
    assert engine.scheduler.prefix_stats["b"] == [4 * len(prompt), 8 * BLOCK]


def test_cached_tokens_skip_the_prefill_and_are_reported(setup):
    system = list(range(5, 5 + 5 * BLOCK))  # five full blocks
    engine = engine_for(setup, True)
    outs = {}
    for i, adapter in enumerate([None, None, "a", "a"]):
        rid = engine.add_request(system + [40 + i], SamplingParams(max_tokens=3, temperature=0.0), adapter)
        computed = engine.scheduler.computed_prompt_tokens
        while engine.has_unfinished():
            for out in engine.step():
                outs[rid] = out
        outs[rid] = (outs[rid].num_cached_tokens, engine.scheduler.computed_prompt_tokens - computed)
    n = len(system) + 1
    # the base model's and the adapter's blocks are kept apart: each computes the system prompt once
    assert list(outs.values()) == [(0, n), (5 * BLOCK, 1), (0, n), (5 * BLOCK, 1)]


def test_a_prefix_arriving_many_times_at_once_is_computed_once(setup):
    """Four requests with one 6-block prompt prefix arrive together: the first computes it, the others wait for its
    blocks and compute only their own last tokens, and each gets what it gets alone."""
    system = list(range(9, 9 + 6 * BLOCK))
    work = [(0, system + [50 + i], adapter, 4) for i, adapter in enumerate(["a", "a", "a", "a"])]
    engine = engine_for(setup, True)
    got = run(engine, work, {})
    assert engine.scheduler.computed_prompt_tokens == len(system) + 4
    off = engine_for(setup, False)
    assert run(off, work, {}) == got and off.scheduler.computed_prompt_tokens == 4 * (len(system) + 1)


def test_the_last_prompt_token_is_always_computed(setup):
    """A prompt of whole blocks, all cached: its last block is computed again (into a block of its own), since its
    last position's logits give the first token."""
    prompt = list(range(7, 7 + 3 * BLOCK))
    engine = engine_for(setup, True)
    first = run(engine, [(0, prompt, None, 4)], {})["0"]
    computed = engine.scheduler.computed_prompt_tokens
    assert run(engine, [(0, prompt, None, 4)], {})["0"] == first
    assert engine.scheduler.computed_prompt_tokens - computed == BLOCK


def test_keys_depend_on_every_part():
    parent = block_key(b"", b"base", [1, 2, 3, 4])
    keys = {parent, block_key(parent, b"base", [1, 2, 3, 4]), block_key(b"", b"sha-x", [1, 2, 3, 4]),
            block_key(b"", b"base", [1, 2, 3, 5]), block_key(b"", b"base", [1, 2, 3])}
    assert len(keys) == 5


class BlockMachine(RuleBasedStateMachine):
    """Requests take fresh and cached blocks, register full ones, free them; the manager never loses one."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(8, 2, prefix_cache=True)
        self.held: list[tuple[list[int], list[bytes]]] = []  # a request's blocks and the keys it registered

    @rule(n=st.integers(1, 4), tokens=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def admit(self, n, tokens):
        keys, parent = [], b""
        for i in range(n):
            parent = block_key(parent, b"base", tokens[: i + 1])
            keys.append(parent)
        cached = self.blocks.lookup(keys)
        if self.blocks.blocks_for(2 * n) - len(cached) > self.blocks.num_free - self.blocks.idle_among(cached):
            return
        self.blocks.hold(cached)
        blocks = list(cached)
        self.blocks.grow(blocks, 2 * n)
        for block, key in zip(blocks, keys):
            self.blocks.register(block, key)
        self.held.append((blocks, keys))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        blocks, _ = self.held.pop(i % len(self.held))
        self.blocks.free(blocks)

    @invariant()
    def consistent(self):
        self.blocks.check()
        assert self.blocks.num_free == self.blocks.num_blocks - len({b for bs, _ in self.held for b in bs})
        for blocks, keys in self.held:  # a held block keeps its content: its key still finds it
            for block, key in zip(blocks, keys):
                found = self.blocks.lookup([key])
                assert not found or found[0] == block or self.blocks._key_of.get(block) != key


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
