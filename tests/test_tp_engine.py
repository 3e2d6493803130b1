"""The engine at tensor_parallel_size=2 on the CPU (rank 0 here, one gloo worker process): the same greedy tokens as
at tensor_parallel_size=1, token for token, for a mixed batch of the base model and adapters of different ranks and
targets (the vocab-parallel embedding and head included), with adapters swapped through fewer slots than adapters,
requests preempted (a small KV cache) and a prefix-cache hit, one registered while the engine runs (a higher
rank: the slots grow on both ranks) and one unregistered. Float32: the all-reduce sums in another order, far below
the gaps between the tiny model's logits."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import threading

import httpx
import pytest
import torch
import transformers
from _peft_models import VOCAB, _cfg, save_adapter
from _serve_helpers import LiveServer
from peft import LoraConfig

from lorakit.engine import Engine, SamplingParams
from lorakit.engine.errors import FatalEngineError
from lorakit.adapters.snapshot import image_bytes
from lorakit.engine.errors import TensorParallelError
from lorakit.serve import ServeConfig, create_app

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL7),
    "qvdown": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "mlp": dict(r=12, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "vocab": dict(r=8, lora_alpha=8, target_modules=["v_proj", "embed_tokens", "lm_head"]),  # vocab-parallel there
}
LATE = dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj", "down_proj"])  # registered while running
SETTINGS = dict(max_loras=2, max_rank=16, max_num_seqs=4, max_seq_len=48, block_size=4, max_num_batched_tokens=32,
                num_blocks=12, device="cpu")  # 12 blocks of 4 tokens for 4 requests: some are preempted


def load(folder: str) -> torch.nn.Module:
    """The factory each rank calls (module level: pickled by reference into the worker)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def fail_on_worker(folder: str) -> torch.nn.Module:
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("no such checkpoint on this rank")
    return load(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_engine")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_cfg("llama")).float().eval()
    base.save_pretrained(tmp / "base")
    paths = {name: str(save_adapter(base, name, LoraConfig(init_lora_weights=False, **kw), tmp, seed=i,
                                    std=0.2).path) for i, (name, kw) in enumerate(ADAPTERS.items())}
    paths["late"] = str(save_adapter(base, "late", LoraConfig(init_lora_weights=False, **LATE), tmp, seed=9,
                                     std=0.2).path)
    return str(tmp / "base"), paths


def run(engine: Engine, late: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    names = [None, "all7", "qvdown", "mlp", "all7", None, "vocab", "qvdown"]  # 4 adapters through 2 slots
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 20, (len(names) + 2,), generator=gen)]
    out: dict[str, list[int]] = {}

    def drain():
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.token_ids

    for prompt, name in zip(prompts, names):
        out[engine.add_request(prompt, params, name)] = []
    drain()
    engine.register_adapter("late", late)  # rank 16 past the slots' 12: they grow
    engine.unregister_adapter("qvdown")
    for prompt, name in zip(prompts[-2:], ["late", "all7"]):
        out[engine.add_request(prompt, params, name)] = []
    drain()
    repeat = torch.randint(3, VOCAB, (17,), generator=gen).tolist()
    for _ in range(2):  # the second time, its first 4 blocks come from the prefix cache
        out[engine.add_request(repeat, params, "all7")] = []
        drain()
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_stats["all7"][1] >= 16
    return list(out.values())


@pytest.fixture(scope="module")
def want(saved):
    folder, paths = saved
    one = Engine(functools.partial(load, folder), adapters={n: paths[n] for n in ADAPTERS}, **SETTINGS)
    return run(one, paths["late"])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_tp2_engine_matches_tp1_token_for_token(saved, want, async_scheduling):
    """With async scheduling each step's placeholder tokens reach the worker by a broadcast from rank 0."""
    folder, paths = saved
    two = Engine(functools.partial(load, folder), adapters={n: paths[n] for n in ADAPTERS}, tensor_parallel_size=2,
                 async_scheduling=async_scheduling, **SETTINGS)
    sent, filled = two.runner._send_step, []
    two.runner._send_step = lambda packed, keep, shape, fill: (filled.append(fill is not None),
                                                               sent(packed, keep, shape, fill))
    try:
        assert type(two.model.model.layers[0].mlp.down_proj).__name__ == "LoraRowParallelLinear"
        assert two.runner.k_caches[0].shape[2] == 1  # 2 KV heads over 2 ranks
        # The CPU tier counts rank 0's shard: per layer q 32+16, k and v 32+8, o 16+32, gate and up 32+24, down 24+32
        # (in + out of the slots), x 2 layers x rank 8 x 4 bytes; the whole adapter would be 29,696.
        assert image_bytes(two.handle, two.pool.info("all7")) == 344 * 2 * 8 * 4
        got = run(two, paths["late"])
        workers = two._workers._procs
    finally:
        two.close()
    assert got == want
    assert all(len(t) == 6 for t in got)
    assert two.pool.stats.evictions > 0
    assert any(filled) == async_scheduling
    assert not any(p.is_alive() for p in workers)


def test_tp2_needs_a_model_factory(saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="picklable function that builds the model"):
        Engine(load(folder), tensor_parallel_size=2, **SETTINGS)
    with pytest.raises(ValueError, match="picklable model factory"):
        Engine(lambda: load(folder), tensor_parallel_size=2, **SETTINGS)


def test_tp2_worker_failure_is_reported(saved):
    folder, paths = saved
    with pytest.raises(TensorParallelError, match="(?s)rank 1 .*no such checkpoint on this rank"):
        Engine(functools.partial(fail_on_worker, folder), adapters={"all7": paths["all7"]}, tensor_parallel_size=2,
               **SETTINGS)


def test_a_worker_checks_the_adapter_files_against_rank_0s_sha256(saved, tmp_path):
    """Each rank reads the adapter's files itself when it is put into a slot: changed since rank 0 read them (one
    byte of the weights), the worker refuses them (``Changed``), and the engine fails, since its ranks no longer
    hold the same adapter."""
    folder, paths = saved
    copied = tmp_path / "all7"
    shutil.copytree(paths["all7"], copied)
    engine = Engine(functools.partial(load, folder), adapters={"all7": str(copied)}, tensor_parallel_size=2,
                    **SETTINGS)
    try:
        weights = copied / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), "all7")  # rank 0 serves its CPU tier's image
        with pytest.raises(TensorParallelError, match="(?s)rank 1 failed while running slots.put.*Changed: sha256"):
            engine.step()
    finally:
        engine.close()


def _kill_worker(engine: Engine) -> None:
    """SIGKILL rank 1 and wait until it is gone."""
    [worker] = engine._workers._procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(30)


def test_a_dead_worker_is_the_engines_failure_not_a_requests(saved):
    """Rank 1 killed between steps: the next step raises TensorParallelError (a FatalEngineError), instead of
    ending every request as if each had caused it (finish_reason "error") and stepping on."""
    folder, _ = saved
    engine = Engine(functools.partial(load, folder), tensor_parallel_size=2, **SETTINGS)
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        for prompt in ([5, 6, 7], [8, 9]):
            engine.add_request(prompt, params)
        engine.step()
        _kill_worker(engine)
        with pytest.raises(TensorParallelError, match="rank 1") as e:
            engine.step()
        assert isinstance(e.value, FatalEngineError)
    finally:
        engine.close()


def test_in_process_a_dead_worker_fails_the_streams_with_503_and_health(saved):
    """The server over the engine on a thread (``--engine-in-process``): the stream in flight ends with a 503 error
    event, /health answers 503, new requests get 503, and the server is told to exit (``on_death``; it then exits 1)."""
    folder, _ = saved
    engine = Engine(functools.partial(load, folder), tensor_parallel_size=2, **SETTINGS)
    app = create_app(engine, ServeConfig(model_name="base"))
    died = threading.Event()
    app.state.server.engine.on_death = died.set
    live = LiveServer(app)
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200
        body = {"model": "base", "prompt": [5, 6, 7], "max_tokens": 40, "stream": True, "ignore_eos": True,
                "temperature": 0}
        lines = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line and not lines:
                    os.kill(engine._workers._procs[0].pid, signal.SIGSTOP)  # the stream cannot finish first
                    _kill_worker(engine)
                lines += [line] if line else []
        assert lines[-1] == "data: [DONE]" and '"code":"service_unavailable"' in lines[-2], lines[-2:]
        assert "TensorParallelError" in lines[-2], lines[-2:]
        assert died.wait(10) and app.state.server.engine.crashed
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and "TensorParallelError" in health.text
        again = httpx.post(f"{live.url}/v1/completions", json={"model": "base", "prompt": [5, 6], "max_tokens": 2})
        assert again.status_code == 503, again.text
    finally:
        live.close()
        engine.close()
