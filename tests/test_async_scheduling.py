"""Async scheduling (``EngineConfig.async_scheduling``): the engine queues step N + 1 before it reads step N's tokens,
which reach step N + 1's inputs on the device. Its outputs must be exactly those of synchronous steps, for any
arrivals, adapters, chunked prompts, preemptions, aborts, seeded sampling, stop tokens and logprobs; requests that
need their last token on the host (penalties, logit bias, structured output) make steps synchronous while they run."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.engine import Engine, SamplingParams

ADAPTERS = {"a": 4, "b": 8}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    base = tiny_model("llama", seed=5)
    saved = {name: save_adapter(base, name, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS["llama"],
                                                       init_lora_weights=False), tmp, seed=i, std=0.2)
             for i, (name, r) in enumerate(ADAPTERS.items())}
    return base, {name: s.path for name, s in saved.items()}


def run(setup, requests, async_scheduling, tight, device="cpu"):
    """Every request's (tokens, logprobs, finish reason), stepping until all end; ``requests``: (arrival step,
    prompt, adapter, params, abort at step or None)."""
    base, paths = setup
    engine = Engine(copy.deepcopy(base).to(device), max_loras=1, max_num_seqs=3, max_num_batched_tokens=12, block_size=4,
                    num_blocks=12 if tight else 200, max_seq_len=48, adapters=paths, patience=2,
                    async_scheduling=async_scheduling)
    got, step, pending = {}, 0, list(enumerate(requests))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, adapter, params, _) = pending.pop(0)
            got[engine.add_request(prompt, params, adapter, request_id=str(i))] = [[], [], None]
        for i, (_, _, _, _, abort) in enumerate(requests):
            if abort == step:
                engine.abort(str(i))
        for out in engine.step():
            tokens, logprobs, _ = got[out.request_id]
            tokens += out.token_ids
            logprobs += [t.logprob for t in out.logprobs or []]
            if out.finished:
                got[out.request_id][2] = out.finish_reason
        step += 1
        assert step < 500
    return got, engine


request = st.tuples(
    st.integers(0, 6),                                   # arrival step
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    st.sampled_from([None, "a", "b"]),
    st.builds(SamplingParams, max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 0.8]),
              seed=st.integers(0, 99), logprobs=st.sampled_from([None, 2]),
              stop_token_ids=st.sampled_from([(), (3,), (5, 7)]), ignore_eos=st.just(True)),
    st.one_of(st.none(), st.integers(0, 10)),            # abort at step
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=6).map(lambda rs: sorted(rs, key=lambda r: r[0])),
       tight=st.booleans())
def test_async_outputs_equal_synchronous_outputs(setup, requests, tight):
    sync, _ = run(setup, requests, False, tight)
    overlapped, engine = run(setup, requests, True, tight)
    for k, (tokens, logprobs, reason) in sync.items():
        got, got_logprobs, got_reason = overlapped[k]
        if requests[int(k)][4] is not None and "abort" in (reason, got_reason):  # aborted at the same step, which
            n = min(len(got), len(tokens))  # found it further on in one run or the other: the same tokens so far
            assert got[:n] == tokens[:n]
            continue
        assert (got, got_reason) == (tokens, reason)
        assert got_logprobs == pytest.approx(logprobs, rel=1e-4, abs=1e-4)  # other batches: sums in another order
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks  # every block back


@pytest.mark.gpu
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=6).map(lambda rs: sorted(rs, key=lambda r: r[0])))
def test_async_outputs_equal_synchronous_outputs_on_cuda(setup, requests):
    """On CUDA, with decode and mixed-step graphs, pinned copies and events (float32: tokens compare exactly)."""
    requests = [(*r[:4], None) for r in requests]
    sync, _ = run(setup, requests, False, False, "cuda")
    overlapped, engine = run(setup, requests, True, False, "cuda")
    assert {k: (v[0], v[2]) for k, v in overlapped.items()} == {k: (v[0], v[2]) for k, v in sync.items()}
    assert engine.runner.graph_replays > 0 and engine.runner.timed_steps > 0


def test_steps_overlap_and_outputs_come_one_step_later(setup):
    base, paths = setup
    engine = Engine(copy.deepcopy(base), max_loras=1, block_size=4, max_seq_len=48, adapters=paths)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "a")
    assert engine.step() == [] and engine._flight is not None  # queued; nothing read back yet
    outs = engine.step()
    assert len(outs) == 1 and len(outs[0].token_ids) == 1
    # The next step's input is the token the device sampled, filled in there: the host list had a placeholder.
    request = next(iter(engine._requests.values()))
    assert request.output_ids[0] == outs[0].token_ids[0]


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.3), dict(logit_bias={3: 5.0}),
                                    dict(frequency_penalty=0.5)])
def test_requests_that_need_their_last_token_make_steps_synchronous(setup, params):
    base, paths = setup

    def tokens(async_scheduling):
        engine = Engine(copy.deepcopy(base), max_loras=1, block_size=4, max_seq_len=48, adapters=paths,
                        async_scheduling=async_scheduling)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "a")
        engine.add_request([4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **params))
        got = {}
        while engine.has_unfinished():
            outs = engine.step()
            assert engine._flight is None  # every step read back at once
            for out in outs:
                got.setdefault(out.request_id, []).extend(out.token_ids)
        return got

    assert tokens(True) == tokens(False)
