"""Activated LoRA (aLoRA) against PEFT 0.21: the adapter applies from the last occurrence of its invocation
sequence in the prompt on (generated tokens included), never when the prompt lacks it."""

import copy
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel
from peft.tuners.lora.variants import calculate_alora_offsets

import lorakit
from _peft_models import VOCAB, save_adapter, tiny_model
from helpers import edit_config, rel_err
from lorakit.engine import Engine, SamplingParams
from lorakit.peft import AdapterError, activation_start

# Two activated LoRAs with different invocations, and a plain LoRA. Prompts draw their other tokens from
# FILLER, so an invocation occurs only where a test puts it.
INVOCATIONS = {"x": [7, 8, 9], "y": [11, 12]}
FILLER = (20, VOCAB)
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def alora_config(invocation, r=8, targets=LINEAR) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False,
                      task_type="CAUSAL_LM", alora_invocation_tokens=invocation)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("alora")
    base = tiny_model("llama", seed=4)
    saved = {name: save_adapter(base, name, alora_config(inv), tmp, seed=i, std=0.2)
             for i, (name, inv) in enumerate(INVOCATIONS.items())}
    plain = LoraConfig(r=4, lora_alpha=8, target_modules=LINEAR, init_lora_weights=False, task_type="CAUSAL_LM")
    saved["plain"] = save_adapter(base, "plain", plain, tmp, seed=5, std=0.2)
    return base, saved


def prompt(length: int, seed: int, inserts=()) -> list[int]:
    """Filler tokens with each (position, tokens) of ``inserts`` written in."""
    ids = torch.randint(*FILLER, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    for at, tokens in inserts:
        assert at + len(tokens) <= length
        ids[at: at + len(tokens)] = tokens
    return ids


# activation_start.

def brute_force(ids, inv):
    starts = [i for i in range(len(ids) - len(inv) + 1) if ids[i: i + len(inv)] == inv]
    return max(starts, default=None)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 3), max_size=30), inv=st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_activation_start_is_the_last_occurrence(ids, inv):
    start = activation_start(ids, inv)
    assert start == brute_force(ids, inv)
    if ids:  # PEFT counts its offset back from the end of the sequence
        config = {"a": alora_config(inv)}
        offset, = calculate_alora_offsets(config, "a", torch.tensor([ids]))
        assert start == (None if offset is None else len(ids) - offset)


def test_activation_start_needs_an_invocation():
    with pytest.raises(ValueError, match="non-empty"):
        activation_start([1, 2], [])


# The patched model, one forward.

ROWS = [  # (adapter, prompt inserts): the invocation twice (the last counts), at the start, at the very end
    ("x", [(3, INVOCATIONS["x"]), (9, INVOCATIONS["x"])]),
    ("y", [(0, INVOCATIONS["y"])]),
    ("x", [(11, INVOCATIONS["x"]), (4, INVOCATIONS["y"])]),
    ("y", [(12, INVOCATIONS["y"]), (2, INVOCATIONS["x"])]),
    ("plain", [(5, INVOCATIONS["x"])]),
    (None, [(5, INVOCATIONS["y"])]),
    ("x", [(5, INVOCATIONS["y"])]),  # x's invocation absent: the base model throughout
]
SEQ = 14


def test_mixed_batch_matches_peft(setup):
    base, saved = setup
    input_ids = torch.tensor([prompt(SEQ, seed=b, inserts=ins) for b, (_, ins) in enumerate(ROWS)])
    names = [name for name, _ in ROWS]
    # PEFT: one model holding every adapter, each row's adapter by adapter_names (alora offsets from input_ids).
    peft = PeftModel.from_pretrained(copy.deepcopy(base), saved["x"].path, adapter_name="x")
    for name in ("y", "plain"):
        peft.load_adapter(saved[name].path, adapter_name=name)
    peft.eval()
    with torch.no_grad():
        ref = peft(input_ids=input_ids, adapter_names=[n or "__base__" for n in names], use_cache=False).logits

    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=4)
    for a in saved.values():
        handle.load_adapter(a.name, a.path)
    ids = handle.ids(names)[:, None].repeat(1, SEQ)
    for b, name in enumerate(names):
        inv = INVOCATIONS.get(name)
        if inv is not None:
            start = activation_start(input_ids[b].tolist(), inv)
            ids[b, : SEQ if start is None else start] = -1
    assert (ids[-1] == -1).all() and (ids[0, :9] == -1).all() and (ids[0, 9:] >= 0).all()
    with torch.no_grad():
        out = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
        plain = base(input_ids=input_ids, use_cache=False).logits
    for b, name in enumerate(names):
        err = rel_err(out[b], ref[b])
        assert err < 1e-5, f"row {b} ({name}): relative error {err:.2e}"
    assert rel_err(out[-1], plain[-1]) < 1e-6  # absent invocation: the base model
    assert rel_err(out[0, :9], plain[0, :9]) < 1e-6 and rel_err(out[0, 9:], plain[0, 9:]) > 1e-3


# The engine.

def reference(base, saved, ids, adapter, max_tokens):
    """PEFT's greedy generate with the adapter alone (it finds the invocation in the prompt itself)."""
    model = base if adapter is None else saved[adapter].peft_model
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


REQUESTS = [  # (arrival step, adapter, prompt length, inserts, max_tokens)
    (0, "x", 23, [(17, INVOCATIONS["x"])], 9),  # the invocation inside the second prefill chunk
    (0, None, 9, [(2, INVOCATIONS["x"])], 7),
    (1, "y", 6, [(4, INVOCATIONS["y"])], 10),  # at the prompt's end
    (1, "plain", 19, [(3, INVOCATIONS["y"])], 8),
    (2, "x", 30, [(1, INVOCATIONS["x"]), (14, INVOCATIONS["x"]), (20, INVOCATIONS["y"])], 6),
    (3, "y", 12, [(5, INVOCATIONS["x"])], 9),  # y's invocation absent
    (5, "x", 16, [], 8),  # absent
    (6, "y", 27, [(0, INVOCATIONS["y"])], 7),
]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_mixed_engine_batch_equals_peft_generate(setup, tight):
    base, saved = setup
    prompts = [prompt(n, seed=i, inserts=ins) for i, (_, _, n, ins, _) in enumerate(REQUESTS)]
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                    num_blocks=13 if tight else 200, max_seq_len=48, patience=3,
                    adapters={n: a.path for n, a in saved.items()})
    got, step, pending = {}, 0, list(enumerate(REQUESTS))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, adapter, _, _, max_tokens) = pending.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                     adapter, request_id=str(i))
            got[rid] = []
        for out in engine.step():
            got[out.request_id] += out.token_ids
        step += 1
        assert step < 500
    changed = 0
    for i, (_, adapter, _, _, max_tokens) in enumerate(REQUESTS):
        want = reference(base, saved, prompts[i], adapter, max_tokens)
        assert got[str(i)][: len(want)] == want, (i, adapter)
        changed += adapter is not None and want != reference(base, saved, prompts[i], None, max_tokens)
    assert changed >= 3  # the adapters change what is generated (the comparison can fail)
    absent = [i for i, (_, a, _, _, _) in enumerate(REQUESTS) if a in INVOCATIONS and
              activation_start(prompts[i], INVOCATIONS[a]) is None]
    assert absent == [5, 6]
    for i in absent:  # PEFT's rule, restated: the base model's tokens
        want = reference(base, saved, prompts[i], None, REQUESTS[i][4])
        assert got[str(i)][: len(want)] == want
    assert (engine.scheduler.num_preemptions > 0) == tight
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_request_lora_start(setup):
    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4, adapters={n: a.path for n, a in saved.items()})
    assert [engine.pool.info(n).invocation_tokens for n in ("x", "y", "plain")] == [(7, 8, 9), (11, 12), None]
    cases = [("x", [(9, INVOCATIONS["x"])], 9), ("y", [], None), ("plain", [(2, INVOCATIONS["x"])], 0),
             (None, [(2, INVOCATIONS["x"])], 0)]
    for adapter, inserts, want in cases:
        rid = engine.add_request(prompt(14, 0, inserts), SamplingParams(max_tokens=2), adapter)
        start = engine._requests[rid].lora_start
        assert start == want if want is not None else start > 10**15, (adapter, start)
        engine.abort(rid)


# Config errors.

@pytest.fixture
def folder(setup, tmp_path):
    return Path(shutil.copytree(setup[1]["x"].path, tmp_path / "x"))


def base_handle(setup):
    return lorakit.patch(copy.deepcopy(setup[0]), max_loras=1)


@pytest.mark.parametrize("value", [[-1], [1.5], [True], ["7"], [[7]], 5, "7 8", [1] * 257, [2**40]])
def test_bad_invocation_tokens_are_refused(setup, folder, value):
    edit_config(folder, alora_invocation_tokens=value)
    with pytest.raises(AdapterError) as info:
        base_handle(setup).load_adapter("x", folder)
    msg = str(info.value)
    assert msg.startswith("adapter 'x'") and "alora_invocation_tokens must be null or a list" in msg, msg
    assert "set it to the ids of the invocation" in msg


@pytest.mark.parametrize("extra", [dict(target_modules=["q_proj", "embed_tokens"]),
                                   dict(target_modules=["q_proj", "lm_head"]),
                                   dict(target_modules=["q_proj"], trainable_token_indices=[3, 5])])
def test_alora_on_token_modules_is_refused(setup, tmp_path, extra):
    base = setup[0]
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM", **extra)
    saved = save_adapter(base, "t", cfg, tmp_path, seed=1)  # a plain LoRA, made activated by its config
    base_handle(setup).load_adapter("t", saved.path)
    edit_config(Path(saved.path), alora_invocation_tokens=[7, 8])
    for load in (base_handle(setup).load_adapter, lambda name, path: Engine(copy.deepcopy(base), adapters={name: path})):
        with pytest.raises(AdapterError) as info:
            load("t", saved.path)
        msg = str(info.value)
        assert "activated LoRA" in msg and "linear layers only" in msg and "retrain with target_modules" in msg, msg


def test_one_conversation_is_prefilled_once_for_the_base_and_every_alora(setup):
    """The prefix cache keys the blocks before an invocation as the base model's: a conversation sent to the base
    model and to both aLoRA adapters at once is computed once, and each adapter computes only its invocation
    (against the same requests with the cache off: the same tokens, three times the prefill)."""
    base, saved = setup
    conversation = prompt(24, seed=11)  # 6 blocks of 4
    work = [(conversation, None)] + [(conversation + INVOCATIONS[name], name) for name in INVOCATIONS]
    got, computed = {}, {}
    for cache in (True, False):
        engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                        num_blocks=64, max_seq_len=48, prefix_cache=cache,
                        adapters={n: saved[n].path for n in INVOCATIONS})
        ids = [engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), a)
               for p, a in work]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        got[cache], computed[cache] = [tokens[i] for i in ids], engine.scheduler.computed_prompt_tokens
    assert got[True] == got[False]
    assert computed[True] == len(conversation) + sum(map(len, INVOCATIONS.values()))
    assert computed[False] == 3 * len(conversation) + sum(map(len, INVOCATIONS.values()))


# The prefix cache under activated LoRAs: a block's key carries where inside it the adapter starts.

def greedy_one_by_one(engine: Engine, work) -> list[list[tuple[int, float]]]:
    """Each (prompt, adapter, max_tokens) alone, one after another (the cache, if on, keeps what each left): its
    greedy tokens with their log-probabilities."""
    got = []
    for ids, adapter, max_tokens in work:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
        rid = engine.add_request(ids, params, adapter)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens += [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
        assert len(tokens) == max_tokens
        got.append(tokens)
    engine.blocks.check()
    return got


def same_answers(got, want) -> bool:
    """The same tokens, and log-probabilities within float32 noise (KV served from the cache is the KV computed
    again, up to summation order): a block computed by other weights moves them far more."""
    return all([t for t, _ in g] == [t for t, _ in w] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g, w))
               for g, w in zip(got, want, strict=True))


def cache_engine(setup, block_size: int, cache: bool) -> Engine:
    base, saved = setup
    return Engine(copy.deepcopy(base), max_loras=3, max_num_seqs=4, max_num_batched_tokens=64, block_size=block_size,
                  num_blocks=256, max_seq_len=64, prefix_cache=cache, adapters={n: a.path for n, a in saved.items()})


def test_two_activation_points_in_one_block_never_share_its_key(setup):
    """Issue 29's collision: A's last invocation starts at 18 and A's second block (16-31) ends with the first two
    invocation tokens; B is A's first 32 tokens and the third, so B's invocation starts at 30. Their second blocks
    hold the same tokens, but A's adapter computed 18-31 and B's only 30-31: B must not be served A's."""
    x = INVOCATIONS["x"]
    a = prompt(32, seed=3, inserts=[(18, x), (30, x[:2])])
    b = a[:32] + x[2:] + prompt(3, seed=4)
    assert (activation_start(a, x), activation_start(b, x)) == (18, 30)
    work = [(a, "x", 6), (b, "x", 6)]
    fresh = [greedy_one_by_one(cache_engine(setup, 16, False), [w])[0] for w in work]
    engine = cache_engine(setup, 16, True)
    cached = greedy_one_by_one(engine, work)
    assert same_answers(cached, fresh)
    assert engine.scheduler.prefix_stats["x"][1] == 16  # B found A's first block (the base model's) only


@st.composite
def alora_workloads(draw):
    """Requests that are prefixes of one conversation of invocations and short filler runs, many ending inside an
    invocation, some at a block's end: a longer prefix completes that invocation, which moves the activation point
    within the block (the case a key must tell apart). On the base model, the plain LoRA or an activated LoRA, in
    any order; and a block size."""
    block_size = draw(st.sampled_from([2, 4, 4, 8]))
    focus = draw(st.sampled_from(sorted(INVOCATIONS)))  # the activated LoRA most requests use
    conversation, inside = [], []  # inside: the cuts that end an invocation short
    for _ in range(draw(st.integers(2, 12))):
        if draw(st.integers(0, 2)):
            inv = INVOCATIONS[draw(st.sampled_from([focus] * 4 + sorted(INVOCATIONS)))]
            inside += [len(conversation) + k for k in range(1, len(inv))]
            conversation += inv
        else:
            conversation += prompt(draw(st.integers(1, 3)), seed=draw(st.integers(0, 10**6)))
    top = min(len(conversation), 44)
    cuts = st.integers(min(4, top), top)
    inside = [c for c in inside if 4 <= c <= top]
    aligned = [c for c in inside if c % block_size == 0]  # a block that ends inside an invocation
    for more in (inside, aligned, aligned, aligned):
        if more:
            cuts = st.one_of(cuts, st.sampled_from(more))
    adapters = st.sampled_from([None, "plain", *sorted(INVOCATIONS)] + [focus] * 4)
    work = [(conversation[: draw(cuts)], draw(adapters), draw(st.integers(1, 4)))
            for _ in range(draw(st.integers(2, 8)))]
    return block_size, work


@given(case=alora_workloads())
@settings(max_examples=60, deadline=None)
def test_with_the_cache_every_greedy_answer_is_the_fresh_engines(setup, case):
    """Whatever was cached before it, a request's greedy tokens are those of a fresh engine with the cache off."""
    block_size, work = case
    fresh = cache_engine(setup, block_size, False)
    want = [greedy_one_by_one(fresh, [w])[0] for w in work]
    assert same_answers(greedy_one_by_one(cache_engine(setup, block_size, True), work), want)
