"""The engine against Hugging Face generate with PEFT, request by request: a mixed batch (the base model and
adapters of different ranks, prompts of different lengths arriving at different steps, prefilled in chunks,
with preemption) gives each request exactly the greedy tokens it gets alone."""

import asyncio
import copy
import time

import pytest
import torch
from peft import LoraConfig

from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit import AdapterError
from lorakit.engine import LLM, Engine, SamplingParams

RANKS = {"r4": 4, "r8": 8, "r16": 16}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    base = tiny_model("llama", seed=3)
    saved = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        targets = TARGETS["llama"] if rank == 8 else ["q_proj", "v_proj", "down_proj", "lm_head"]
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        saved[name] = save_adapter(base, name, cfg, tmp, seed=seed, std=0.2)
    return base, saved


def reference(base, saved, prompt, adapter, max_tokens):
    model = base if adapter is None else saved[adapter].peft_model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


REQUESTS = [  # (arrival step, prompt length, adapter, max_tokens)
    (0, 5, None, 8), (0, 23, "r8", 10), (1, 3, "r4", 12), (2, 40, "r16", 6), (2, 11, None, 9), (4, 17, "r4", 7),
    (6, 30, "r8", 11), (9, 2, "r16", 5),
]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_mixed_batch_equals_generate_alone(setup, tight):
    base, saved = setup
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for _, n, _, _ in REQUESTS]
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                    num_blocks=13 if tight else 200, max_seq_len=48, adapters={n: a.path for n, a in saved.items()}, patience=3)
    got, step, pending = {}, 0, list(enumerate(REQUESTS))
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, _, adapter, max_tokens) = pending.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0), adapter,
                                     request_id=str(i))
            got[rid] = []
        for out in engine.step():
            got[out.request_id] += out.token_ids
        step += 1
        assert step < 500
    for i, (_, _, adapter, max_tokens) in enumerate(REQUESTS):
        assert got[str(i)] == reference(base, saved, prompts[i], adapter, max_tokens), (i, adapter)
    assert (engine.scheduler.num_preemptions > 0) == tight
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_llm_generate_and_bad_requests(setup):
    base, saved = setup
    llm = LLM(copy.deepcopy(base), max_loras=2, adapters={"r4": saved["r4"].path}, max_num_seqs=4, block_size=4)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)  # eos (2) stops it, as it stops generate
    outs = llm.generate(prompts, greedy, adapters=["r4", None])
    assert [o.token_ids for o in outs] == [reference(base, saved, prompts[0], "r4", 6),
                                           reference(base, saved, prompts[1], None, 6)]
    assert [o.finish_reason for o in outs] == ["length", "stop"]  # the base request ends on eos
    # Seeded sampling is reproducible whatever else shares the batch.
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, adapters=["r4"])[0].token_ids
    mixed = llm.generate([prompts[1], prompts[0], prompts[0]], [greedy, seeded, seeded], adapters=[None, "r4", "r4"])
    assert mixed[1].token_ids == alone and mixed[2].token_ids == alone
    # Logprobs of the chosen token and the top ones.
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True))[0]
    assert len(out.logprobs) == 3 and all(len(t.top) == 2 and max(t.top.values()) == pytest.approx(t.logprob)
                                          for t in out.logprobs)
    # Bad requests are refused and disturb nothing.
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], greedy)
    with pytest.raises(ValueError, match="at most 63 fit"):
        engine.add_request([1] * 64, greedy)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([VOCAB], greedy)
    with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
        engine.add_request([1], greedy, adapter="nope")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished()
    assert llm.generate(prompts, greedy, adapters=["r4", None])[0].token_ids == outs[0].token_ids


def test_abort_frees_everything(setup):
    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=1, adapters={"r4": saved["r4"].path}, block_size=4,
                    num_blocks=64)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), "r4")
    b = engine.add_request([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort(a)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs if o.request_id == a] == ["abort"]
    assert [o.finish_reason for o in outs if o.finished and o.request_id == b] == ["length"]
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(s is None or s["holders"] == 0 for s in engine.pool.memory()["slots"])


def test_admitted_and_stats_are_what_callers_read(setup):
    """``admitted``: a request's prompt ids and its params as queued (max_tokens cut to the context), until it ends.
    ``stats()``: the scheduler's, pool's and blocks' figures, by adapter, with the loop's counters left 0."""
    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=1, adapters={"r4": saved["r4"].path}, block_size=4,
                    num_blocks=64, max_seq_len=16, max_num_seqs=1)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True), "r4")
    b = engine.add_request([4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    prompt_ids, params = engine.admitted(a)
    assert prompt_ids == [1, 2, 3] and params.max_tokens == 13
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.steps, stats.max_loras) == (1, 1, 0, 1)
    assert stats.running_by_adapter == {"r4": 1} and stats.waiting_by_adapter == {"": 1}
    assert stats.residency == {"r4": "gpu"} and 0 < stats.kv_usage <= 1
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(KeyError):
        engine.admitted(b)
    assert engine.stats().kv_usage == 0


def test_steps_of_base_tokens_run_no_lora_kernels(setup, monkeypatch):
    """A step whose tokens all use the base model runs with the LoRA ops silenced (ops.no_adapter_tokens): every
    expand of the base requests' steps computes nothing, while a step with an adapter token computes its delta; each
    request still gets the greedy tokens it gets alone."""
    from lorakit.ops import _checks, expand

    base, saved = setup
    silenced = []
    real = expand._expand_torch
    monkeypatch.setattr(expand, "_expand_torch",
                        lambda *a, **k: silenced.append(_checks.adapter_tokens_skipped()) or real(*a, **k))
    engine = Engine(copy.deepcopy(base), max_loras=2, adapters={n: a.path for n, a in saved.items()}, block_size=4,
                    max_num_batched_tokens=16)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 20, 5)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(adapters):
        got = {engine.add_request(p, greedy, a): [] for p, a in zip(prompts, adapters)}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.token_ids
        return list(got.values())

    assert run([None, None, None]) == [reference(base, saved, p, None, 6) for p in prompts]
    runner = engine.runner
    assert runner.base_steps == runner.eager_steps > 0 and silenced and all(silenced)
    before, silenced[:] = runner.base_steps, []
    adapters = [None, "r8", None]  # every step of this run holds an r8 token (its 20-token prompt is chunked)
    assert run(adapters) == [reference(base, saved, p, a, 6) for p, a in zip(prompts, adapters)]
    assert runner.base_steps == before and silenced and not any(silenced)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3", "phi3", "gpt2"])
def test_other_architectures_equal_generate(arch, tmp_path):
    """No per-architecture code: the same engine on other transformers models (Gemma's softcap and sliding
    window, Phi-3's fused projections, GPT-2's learned positions)."""
    base = tiny_model(arch, seed=5)
    targets = TARGETS[arch][:3]
    adapter = save_adapter(base, "a", LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
                           tmp_path, seed=1, std=0.2)
    saved = {"a": adapter}
    engine = Engine(copy.deepcopy(base), max_loras=1, adapters={"a": adapter.path}, block_size=4,
                    max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (13, 4)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0), name)
           for p, name in zip(prompts, ["a", None])]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    for rid, prompt, name in zip(ids, prompts, ["a", None]):
        assert got[rid] == reference(base, saved, prompt, name, 6), (arch, name)


def test_async_engine_streams_and_aborts_when_the_client_leaves(setup):
    import asyncio

    from lorakit import AsyncEngine

    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=2, adapters={n: a.path for n, a in saved.items()}, block_size=4)
    prompts = {"r4": [1, 2, 3], None: [4, 5, 6, 7], "r16": [8, 9]}
    greedy = SamplingParams(max_tokens=7, temperature=0.0)  # stops on eos, as generate does
    aborted, abort = [], engine.abort
    engine.abort = lambda request_id: (aborted.append(request_id), abort(request_id))

    async def collect(runner, prompt, name):
        outs = [out async for out in runner.generate(prompt, greedy, name)]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        return [t for o in outs for t in o.token_ids]

    async def leave_early(runner):
        stream = runner.generate([3, 3, 3], SamplingParams(max_tokens=50, ignore_eos=True), "r8")
        async for _ in stream:
            break  # the client goes away after its first token
        await stream.aclose()

    async def main():
        runner = AsyncEngine(engine)
        try:
            results = await asyncio.gather(*(collect(runner, p, n) for n, p in prompts.items()), leave_early(runner))
        finally:
            runner.shutdown()
        return results[:-1]

    results = asyncio.run(main())
    assert len(aborted) == 1  # the client that left
    for tokens, (name, prompt) in zip(results, prompts.items()):
        assert tokens == reference(base, saved, prompt, name, 7), name
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks
    assert all(s is None or s["holders"] == 0 for s in engine.pool.memory()["slots"])


def test_unregistering_an_adapter_ends_its_waiting_requests_only(setup):
    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=1, max_num_seqs=1, block_size=4,
                    adapters={"r4": saved["r4"].path, "r8": saved["r8"].path})
    running = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), "r4")
    waiting = engine.add_request([4, 5], SamplingParams(max_tokens=6, ignore_eos=True), "r8")
    engine.step()  # r4 runs; r8 waits (one sequence at a time)
    engine.unregister_adapter("r8")
    engine.unregister_adapter("r4")  # running: finishes on the version it holds
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    finished = {o.request_id: o for o in outs if o.finished}
    assert {rid: o.finish_reason for rid, o in finished.items()} == {waiting: "error", running: "length"}
    assert "adapter 'r8' was unloaded before this request could run" in finished[waiting].error  # not an empty end


def test_a_request_runs_on_the_version_it_was_admitted_with_to_its_last_token(setup):
    """A hot-swap while requests of the name run and wait: each ends on the version it was admitted with, token for
    token as PEFT with that version's weights; the new request gets the new weights. The old version goes (its image
    and slot) once its last request ends."""
    base, saved = setup
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=1, block_size=4, adapters={"x": saved["r4"].path})
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = {"running": [1, 2, 3], "waiting": [4, 5], "new": [6, 7, 8, 9]}
    engine.add_request(prompts["running"], greedy, "x", request_id="running")
    engine.add_request(prompts["waiting"], greedy, "x", request_id="waiting")
    got = {k: [] for k in prompts}
    for out in engine.step():  # "running" runs; "waiting" waits (one sequence at a time)
        got[out.request_id] += out.token_ids
    assert engine.register_adapter("x", saved["r16"].path) == 2
    engine.add_request(prompts["new"], greedy, "x", request_id="new")
    assert engine.pool.memory()["claimed_old_versions"] == 1
    ends = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            if out.finished:
                ends[out.request_id] = out.finish_reason
    assert ends == dict.fromkeys(prompts, "length")
    for rid, folder in (("running", "r4"), ("waiting", "r4"), ("new", "r16")):
        assert got[rid] == reference(base, saved, prompts[rid], folder, 5), rid
    memory = engine.pool.memory()
    assert memory["claimed_old_versions"] == 0 and memory["kept_bytes"] == 0
    assert [s["version"] for s in memory["slots"] if s is not None] == [2]


def test_a_request_that_breaks_a_step_fails_alone(setup):
    """A value that slips past validation and breaks the step (top_k past int64, as a client once sent) ends its
    own request with an error; the step runs again without it, and every other request gets exactly the tokens
    it gets without the bad one around."""
    base, saved = setup
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"base": ([1, 2, 3], None), "r4": ([4, 5, 6, 7], "r4"), "r8": ([8, 9], "r8")}

    def run(with_bad: bool):
        engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4,
                        adapters={n: saved[n].path for n in ("r4", "r8")})
        ids = {engine.add_request(p, greedy, a, request_id=k): k for k, (p, a) in prompts.items()}
        if with_bad:
            engine.add_request([3, 1], SamplingParams(max_tokens=6, temperature=1.0, seed=0), "r4", request_id="bad")
            object.__setattr__(engine._requests["bad"].params, "top_k", 2**63)  # past every check
        got, ends = {}, {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.token_ids)
                if out.finished:
                    ends[out.request_id] = out
        return {ids.get(k, k): v for k, v in got.items()}, ends

    alone, _ = run(False)
    together, ends = run(True)
    assert ends["bad"].finish_reason == "error" and "failed inside an engine step" in ends["bad"].error
    assert "Overflow" in ends["bad"].error, ends["bad"].error
    assert {k: together[k] for k in prompts} == alone


def test_an_adapter_that_fails_to_load_ends_only_its_requests(setup, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    base, saved = setup
    bad = tmp_path / "nan"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((Path(saved["r4"].path) / "adapter_config.json").read_text())
    weights = load_file(Path(saved["r4"].path) / "adapter_model.safetensors")
    save_file(weights, bad / "adapter_model.safetensors")
    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4, adapters={"r8": saved["r8"].path},
                    cpu_budget_bytes=40 << 10)
    engine.register_adapter("nan", bad)
    engine.register_adapter("filler", saved["r8"].path)  # the CPU tier drops "nan": it is read again at first use
    weights[next(k for k in weights if "lora_A" in k)][0, 0] = float("nan")
    save_file(weights, bad / "adapter_model.safetensors")  # and its files changed since it was registered
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), "r8")
    broken = engine.add_request([4, 5], SamplingParams(max_tokens=5), "nan")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    finished = {o.request_id: o for o in outs if o.finished}
    assert finished[broken].finish_reason == "error" and "changed on disk since it was registered" in \
        finished[broken].error
    assert [t for o in outs if o.request_id == good for t in o.token_ids] == reference(base, saved, [1, 2, 3], "r8", 5)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_stream_that_falls_behind_catches_up_in_one_output():
    from lorakit.engine.outputs import OutputProcessor, RequestOutput, TokenLogprob
    from lorakit.engine.sampling import SamplingParams as Params
    from lorakit.frontend.streams import RequestStream

    class Letters:  # token t reads "a" or "b"
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab"[t % 2] for t in ids)

    async def consume(items):
        outs = RequestStream(OutputProcessor("r", [], Params(), Letters()), lambda: None)
        for item in items:  # what one step's pass hands it before its reader wakes
            outs.fail(item) if isinstance(item, BaseException) else outs.put(item)
        got = []
        try:
            async for out in outs:
                got.append(out)
        except RuntimeError as e:
            got.append(e)
        return got

    lp = [TokenLogprob(t, -0.5, {}) for t in range(4)]
    outs = [RequestOutput("r", "", [t], t == 3, "stop" if t == 3 else None, [lp[t]], 5, t + 1) for t in range(4)]
    (merged,) = asyncio.run(consume(outs))  # the last token stops it (a stop token: its text is not shown)
    assert merged.token_ids == [0, 1, 2, 3] and merged.text == "aba" and merged.finish_reason == "stop"
    assert merged.logprobs == lp and merged.num_output_tokens == 4 and merged.finished
    # An error behind outputs: they come first, merged, then the error is raised.
    got = asyncio.run(consume([outs[0], outs[1], RuntimeError("gone")]))
    assert got[0].token_ids == [0, 1] and isinstance(got[1], RuntimeError)


def test_the_core_client_merges_the_steps_that_queued_up_into_one_output_per_request():
    import msgspec
    import zmq

    from lorakit.engine.outputs import OutputProcessor, RequestOutput
    from lorakit.engine.sampling import SamplingParams as Params
    from lorakit.frontend.core_client import CoreClient
    from lorakit.frontend.streams import RequestStream
    from lorakit.frontend.wire import Step

    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab"[t % 2] for t in ids)

    encode = msgspec.msgpack.Encoder().encode
    steps = [encode(Step([RequestOutput(r, "", [t], t == 2, "length" if t == 2 else None) for r in ("x", "y")]))
             for t in range(3)]

    class Socket:  # the three steps queued up before the reader ran, then nothing more
        def __init__(self):
            self.queued, self.reads = list(steps), 0

        def recv(self, flags=0):
            future = asyncio.get_running_loop().create_future()
            if self.queued:
                self.reads += 1
                future.set_result(self.queued.pop(0))
            elif flags & zmq.NOBLOCK:
                future.set_exception(zmq.Again())
            return future

    async def main():
        client = CoreClient(None)
        client._from_core = Socket()
        got = {}
        for r in ("x", "y"):
            outs = client._queues[r] = RequestStream(OutputProcessor(r, [], Params(), Letters()), lambda: None)
            outs.listen(lambda out, r=r: got.setdefault(r, []).append(out))
        reader = asyncio.ensure_future(client._read())
        for _ in range(5):
            await asyncio.sleep(0)
        reader.cancel()
        return got, client._from_core.reads, client._queues

    got, reads, left = asyncio.run(main())
    assert reads == 3 and not left
    for r in ("x", "y"):  # one output each, with all three tokens and their text
        (out,) = got[r]
        assert out.token_ids == [0, 1, 2] and out.text == "aba" and out.finish_reason == "length"


def test_the_core_clients_pause_after_a_pass_counts_its_own_work_at_most_pace_max(monkeypatch):
    """A pass over the core's steps is followed by a pause of its CPU time (READ_SHARE 0.5), at most PACE_MAX: a pass
    that waited (on the GIL another thread held, as the push stall's trace showed for a garbage collection) is not
    followed by a pause as long, which doubled a stall."""
    import msgspec
    import zmq

    from lorakit.frontend import core_client
    from lorakit.frontend.core_client import PACE_MAX, CoreClient
    from lorakit.frontend.wire import Step

    step = msgspec.msgpack.Encoder().encode(Step([]))

    class Socket:  # one step a pass, three passes
        def __init__(self):
            self.queued = [step] * 3

        def recv(self, flags=0):
            future = asyncio.get_running_loop().create_future()
            if flags & zmq.NOBLOCK:
                future.set_exception(zmq.Again())
            elif self.queued:
                future.set_result(self.queued.pop(0))
            return future

    def busy(seconds):  # CPU time of this thread
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    passes = iter([lambda: busy(0.1), lambda: time.sleep(0.1), lambda: busy(0.005)])  # long, waiting, short
    pauses = []
    sleep = asyncio.sleep

    async def recorded(seconds):
        pauses.append(seconds)
        await sleep(0)

    monkeypatch.setattr(core_client.asyncio, "sleep", recorded)

    async def main():
        client = CoreClient(None)
        client._from_core = Socket()
        client._deliver = lambda outputs: next(passes, lambda: None)()
        reader = asyncio.ensure_future(client._read())
        for _ in range(20):
            await sleep(0)
        reader.cancel()

    asyncio.run(main())
    assert len(pauses) == 2 and pauses[0] == pytest.approx(PACE_MAX)  # the waiting pass: no pause
    assert 0.004 < pauses[1] < PACE_MAX


def test_a_request_stream_aborts_once_and_only_a_request_the_engine_still_runs():
    """Issue 32: outputs are processed as the client's reader hands them over (one pass per step), so a stop string
    found there aborts the request at once; a reader that leaves early aborts it; a finished one is not aborted."""
    from lorakit.engine.outputs import OutputProcessor, RequestOutput
    from lorakit.engine.sampling import SamplingParams as Params
    from lorakit.frontend.streams import RequestStream

    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab"[t % 2] for t in ids)

    def outputs(n, last_finishes=False):
        return [RequestOutput("r", "", [t], last_finishes and t == n - 1, "length" if last_finishes and t == n - 1
                              else None, None, 1, t + 1) for t in range(n)]

    async def read(params, items, leave_after=None):
        aborts = []
        outs = RequestStream(OutputProcessor("r", [], params, Letters()), lambda: aborts.append(1))
        for item in items:
            outs.put(item)
        got = []
        async for out in outs:
            got.append(out)
            if leave_after is not None and len(got) >= leave_after:
                break
        outs.close()
        return got, aborts

    got, aborts = asyncio.run(read(Params(stop=["ba"]), outputs(6)))  # "ab|a..." stops at the first "ba"
    assert [o.text for o in got] == ["a"] and got[0].finish_reason == "stop" and aborts == [1]
    got, aborts = asyncio.run(read(Params(), outputs(3), leave_after=1))
    assert aborts == [1]
    got, aborts = asyncio.run(read(Params(), outputs(3, last_finishes=True)))
    assert [o.text for o in got] == ["aba"] and got[0].finished and aborts == []
