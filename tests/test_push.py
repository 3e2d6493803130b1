"""Adapters pushed from memory (issue 49): a PEFT state dict handed to the engine as it is, each push a new version
checked in full, every request on the version it was admitted with, bad pushes refused by name with the previous
version serving; a hypothesis test of pushes, requests and unloads interleaved."""

import copy
import json

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save

from _peft_models import TARGETS, tiny_model
from lorakit import AdapterError
from lorakit.adapters import TooManyVersions
from lorakit.adapters.snapshot import config_json
from lorakit.peft import check_values
from lorakit.engine import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", seed=5)


def plain(config: LoraConfig) -> dict:
    """A LoraConfig as adapter_config.json holds it."""
    return json.loads(config_json(config, "test"))


def trained(base, seed: int, config: LoraConfig = CONFIG):
    """A PEFT model as a training loop holds it after a step: random nonzero A and B."""
    model = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def peft_tokens(model, prompt, n=5) -> list[int]:
    """Greedy tokens by full forwards, past eos (the engine's requests ignore it)."""
    ids, device = list(prompt), next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def run(engine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    got = {rid: [] for rid in requests}
    for rid, (prompt, adapter) in requests.items():
        engine.add_request(prompt, GREEDY, adapter, request_id=rid)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return got


def test_each_push_is_a_version_served_as_peft_computes_it(base):
    """Push, generate, train, push again: each version's greedy tokens equal PEFT's with those weights; the same
    weights pushed again are the same content (sha256), whatever device they were on."""
    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4)
    prompt = [3, 1, 4, 1, 5]
    shas = []
    for version, seed in enumerate((1, 2, 1), start=1):
        model = trained(base, seed)
        assert engine.push_adapter("policy", get_peft_model_state_dict(model), model.peft_config["default"]) == version
        assert engine.pool.residency()["policy"] == "cpu"  # held in memory (there is no file), not in a slot yet
        assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(model, prompt)
        shas.append(engine.pool.versions["policy"][1])
    assert shas[0] == shas[2] != shas[1]
    assert engine.pool.memory()["claimed_old_versions"] == 0  # old versions went with their requests
    # a safetensors file's bytes and a config dict push the same content
    model = trained(base, 1)
    data = save(get_peft_model_state_dict(model))
    assert engine.push_adapter("policy", data, model.peft_config["default"].to_dict()) == 4
    assert engine.pool.versions["policy"][1] == shas[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_is_packed_as_its_folder_is(base, tmp_path, dtype):
    """Plain LoRA pushed as a state dict takes the in-memory reader (no file) and packs byte for byte what reading the
    same weights from a folder packs; an adapter with more than plain LoRA (an embedding, here) takes the folder
    reader, and is served as PEFT computes it too."""
    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4)
    model = trained(base, 7)
    weights = {k: v.to(dtype) for k, v in get_peft_model_state_dict(model).items()}
    assert engine.handle.read_state_dict("x", weights, plain(CONFIG), tmp_path) is not None
    model.save_pretrained(tmp_path / "x")
    save_file = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    save_file(weights, tmp_path / "x" / "adapter_model.safetensors")
    pushed, read = engine.pool.read_pushed("x", weights, CONFIG), engine.pool.read("x", tmp_path / "x")
    assert torch.equal(pushed.image.buffer, read.image.buffer)
    embedding = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    model = trained(base, 8, embedding)
    state = get_peft_model_state_dict(model)
    assert engine.handle.read_state_dict("e", state, plain(embedding), tmp_path) is None
    engine.push_adapter("e", state, embedding)
    assert run(engine, {"a": ([5, 6, 7], "e")})["a"] == peft_tokens(model, [5, 6, 7])


def test_a_request_admitted_before_a_push_finishes_on_the_old_weights(base):
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=1, block_size=4)
    old, new = trained(base, 1), trained(base, 2)
    engine.push_adapter("policy", get_peft_model_state_dict(old), CONFIG)
    prompts = {"running": [1, 2, 3], "waiting": [4, 5, 6], "after": [7, 8]}
    got = {rid: [] for rid in prompts}
    engine.add_request(prompts["running"], GREEDY, "policy", request_id="running")
    engine.add_request(prompts["waiting"], GREEDY, "policy", request_id="waiting")
    for out in engine.step():
        got[out.request_id] += out.token_ids
    engine.push_adapter("policy", get_peft_model_state_dict(new), CONFIG)
    engine.add_request(prompts["after"], GREEDY, "policy", request_id="after")
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got["running"] == peft_tokens(old, prompts["running"])
    assert got["waiting"] == peft_tokens(old, prompts["waiting"])
    assert got["after"] == peft_tokens(new, prompts["after"])


def _bad_pushes(base):
    """(what is wrong, weights, config, a phrase the error must hold): each refused, none served."""
    good = get_peft_model_state_dict(trained(base, 3))
    key_a = next(k for k in good if "q_proj.lora_A" in k)
    key_b = key_a.replace("lora_A", "lora_B")

    def changed(**edits):
        weights = dict(good)
        for key, value in edits.items():
            if value is None:
                weights.pop(key)
            else:
                weights[key] = value
        return weights

    nan = good[key_a].clone()
    nan[0, 0] = float("nan")
    wide = CONFIG.to_dict() | {"r": 64, "lora_alpha": 128}
    return [
        ("wrong shape", changed(**{key_a: torch.randn(4, 7)}), CONFIG, "q_proj"),
        ("a missing B", changed(**{key_b: None}), CONFIG, "lora_B"),
        ("NaN", changed(**{key_a: nan}), CONFIG, "NaN"),
        ("a rank over the cap", {k: torch.randn(64, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], 64)
                                 for k, v in good.items()}, wide, "max_rank"),
        ("a config that does not match", good, CONFIG.to_dict() | {"target_modules": ["k_proj"]}, "q_proj"),
        ("a body cut short", save(good)[:-100], CONFIG, "safetensors"),
        ("no tensors", {}, CONFIG, "non-empty dict"),
        ("not a config", good, "r=4", "LoraConfig"),
        ("a state dict without its config", good, None, "no config"),
        ("bytes without a config in their metadata", save(good), None, "no 'adapter_config'"),
    ]


def test_bad_pushes_are_refused_by_name_and_the_previous_version_serves(base):
    engine = Engine(copy.deepcopy(base), max_loras=2, max_rank=16, block_size=4)
    good = trained(base, 4)
    engine.push_adapter("policy", get_peft_model_state_dict(good), CONFIG)
    prompt = [9, 8, 7]
    for what, weights, config, phrase in _bad_pushes(base):
        with pytest.raises(AdapterError, match=phrase) as refused:
            engine.push_adapter("policy", weights, config)
        assert "pushed from memory" in str(refused.value), what
        assert engine.pool.adapters == {"policy": 1}, what
    assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(good, prompt)


def test_a_safetensors_body_carries_its_config_read_with_its_tensors(base):
    """Bytes as the push endpoint takes them (``push_body``: the config in the header's metadata) need no config
    beside them: the header is read once, for both, and the version is the one the state dict and its config give."""
    from lorakit.serve.push import push_body

    engine = Engine(copy.deepcopy(base), max_loras=2, max_rank=16, block_size=4)
    good = trained(base, 5)
    state = get_peft_model_state_dict(good)
    engine.push_adapter("policy", push_body(state, CONFIG), None)
    engine.push_adapter("same", state, CONFIG)
    assert engine.pool.versions["policy"][1] == engine.pool.versions["same"][1]
    prompt = [9, 8, 7]
    assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(good, prompt)


def test_a_body_s_values_are_checked_in_one_pass_and_a_bad_one_is_still_named(base, monkeypatch):
    """A safetensors body of one dtype is checked in one reduction over its data (no tensor-by-tensor scan when it
    is sound); a NaN, an inf or a float64 past float32 sends it to the scan, which names the module; a bad value in
    a weight strict=False ignores does not refuse the adapter."""
    from lorakit.adapters import snapshot
    from lorakit.serve.push import push_body

    scans = []
    monkeypatch.setattr(snapshot, "check_values", lambda modules, where: scans.append(where) or
                        check_values(modules, where))
    engine = Engine(copy.deepcopy(base), max_loras=2, max_rank=16, block_size=4)
    good = get_peft_model_state_dict(trained(base, 6))
    engine.push_adapter("policy", push_body(good, CONFIG), None)
    assert scans == []
    key = next(k for k in good if "v_proj.lora_B" in k)
    module = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    for value, dtype in ((float("nan"), torch.float32), (float("-inf"), torch.float32), (1e39, torch.float64)):
        bad = {k: v.to(dtype) for k, v in good.items()}
        bad[key] = bad[key].clone()
        bad[key][1, 0] = value
        with pytest.raises(AdapterError, match=f"module {module!r}: B"):
            engine.push_adapter("policy", push_body(bad, CONFIG), None)
    assert len(scans) == 3 and engine.pool.adapters == {"policy": 1}

    loose = Engine(copy.deepcopy(base), max_loras=2, max_rank=16, block_size=4, lora_strict=False)
    ignored, other = dict(good), key.replace("v_proj", "k_proj")  # k_proj is not a target
    ignored[other] = torch.full_like(good[key], float("nan"))
    ignored[other.replace("lora_B", "lora_A")] = good[key.replace("lora_B", "lora_A")].clone()
    assert loose.push_adapter("policy", push_body(ignored, CONFIG), None) == 1
    assert len(scans) == 4


def test_a_push_past_max_versions_is_refused_until_the_old_requests_end(base):
    """Versions alive at once are bounded (the current one and those requests still run on): a push past the bound is
    refused by name, evicting nothing in use; once the old requests end it goes through."""
    engine = Engine(copy.deepcopy(base), max_loras=2, max_num_seqs=4, block_size=4, max_versions_per_adapter=2)
    models = [trained(base, seed) for seed in (1, 2, 3)]
    engine.push_adapter("policy", get_peft_model_state_dict(models[0]), CONFIG)
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request([1, 2], long, "policy", request_id="on-v1")
    engine.step()
    assert engine.push_adapter("policy", get_peft_model_state_dict(models[1]), CONFIG) == 2
    engine.add_request([3, 4], long, "policy", request_id="on-v2")
    with pytest.raises(TooManyVersions, match=r"2 versions are alive already.*versions 1 \(1 request\(s\)\), 2"):
        engine.push_adapter("policy", get_peft_model_state_dict(models[2]), CONFIG)
    assert engine.pool.adapters == {"policy": 2}
    got = {"on-v1": [], "on-v2": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got["on-v1"] == peft_tokens(models[0], [1, 2], 8) and got["on-v2"] == peft_tokens(models[1], [3, 4], 8)
    assert engine.push_adapter("policy", get_peft_model_state_dict(models[2]), CONFIG) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_push_of_gpu_tensors_serves_as_peft_computes_it(base):
    model = trained(base, 6).cuda()
    engine = Engine(copy.deepcopy(base).cuda(), max_loras=2, block_size=4, device="cuda")
    engine.push_adapter("policy", get_peft_model_state_dict(model), CONFIG)
    prompt = [2, 7, 1, 8]
    assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(model, prompt)


# Pushes, requests and unloads interleaved: nothing lost, nothing served from a wrong version.

_MACHINE_BASE = None


class PushMachine(RuleBasedStateMachine):
    """A model of the engine's adapters: each name's current weights (a seed), and each request's expected weights,
    those current when it was admitted. Requests waiting when their name is unloaded end with an error; every other
    request ends with exactly PEFT's tokens for its weights."""

    NAMES = ("p", "q")

    @initialize()
    def setup(self):
        self.base = _MACHINE_BASE
        self.engine = Engine(copy.deepcopy(self.base), max_loras=1, max_num_seqs=2, block_size=4)
        self.current: dict[str, int] = {}  # name -> seed of its current version
        self.expected: dict[str, tuple[list[int], int | None]] = {}  # request -> (prompt, seed; None: an error)
        self.got: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}
        self.count = 0

    @rule(name=st.sampled_from(NAMES), seed=st.integers(0, 3))
    def push(self, name, seed):
        """A new version, unless two are alive already (the current one running requests, and an older one)."""
        claimed = {r.adapter for r in self.engine._requests.values() if r.adapter is not None and r.adapter_name == name}
        if len(claimed) >= 2:
            with pytest.raises(TooManyVersions):
                self.engine.push_adapter(name, get_peft_model_state_dict(_trained(seed)), CONFIG)
            return
        self.engine.push_adapter(name, get_peft_model_state_dict(_trained(seed)), CONFIG)
        self.current[name] = seed

    @rule(name=st.sampled_from(NAMES + (None,)), length=st.integers(1, 6))
    def add(self, name, length):
        rid, self.count = f"r{self.count}", self.count + 1
        prompt = [(self.count * 7 + i) % 90 for i in range(length)]
        if name is not None and name not in self.current:
            with pytest.raises(AdapterError, match="unknown adapter"):
                self.engine.add_request(prompt, GREEDY, name, request_id=rid)
            return
        self.engine.add_request(prompt, GREEDY, name, request_id=rid)
        self.expected[rid] = (prompt, None if name is None else self.current[name])
        self.got[rid] = []

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name):
        if name not in self.current:
            return
        waiting = {r.request_id for r in self.engine.scheduler.waiting if r.adapter_name == name}
        self.engine.unregister_adapter(name)
        del self.current[name]
        for rid in waiting:
            self.expected[rid] = (self.expected[rid][0], "error")

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self._collect(self.engine.step())

    def _collect(self, outputs):
        for out in outputs:
            self.got[out.request_id] += out.token_ids
            if out.finished:
                self.ended[out.request_id] = out.finish_reason

    @invariant()
    def versions_live_only_while_claimed(self):
        if hasattr(self, "engine"):
            claimed = {r.adapter for r in self.engine._requests.values() if r.adapter is not None}
            current = set(self.engine.pool.versions.items())
            old = {a for a in claimed if (a.name, (a.version, a.sha256)) not in current}
            assert self.engine.pool.memory()["claimed_old_versions"] == len(old)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        while self.engine.has_unfinished():
            self._collect(self.engine.step())
        for rid, (prompt, seed) in self.expected.items():
            if seed == "error":
                assert self.ended[rid] == "error", rid
            else:
                assert self.ended[rid] == "length", rid
                reference = self.base if seed is None else _trained(seed)
                assert self.got[rid] == _reference(reference, seed, tuple(prompt)), rid
        assert self.engine.pool.memory()["claimed_old_versions"] == 0


_TRAINED, _REFERENCES = {}, {}


def _trained(seed):
    if seed not in _TRAINED:
        _TRAINED[seed] = trained(_MACHINE_BASE, seed)
    return _TRAINED[seed]


def _reference(model, seed, prompt):
    if (seed, prompt) not in _REFERENCES:
        _REFERENCES[seed, prompt] = peft_tokens(model, list(prompt))
    return _REFERENCES[seed, prompt]


def test_pushes_requests_and_unloads_interleaved(base):
    global _MACHINE_BASE
    _MACHINE_BASE = base
    try:
        PushMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                                                 suppress_health_check=list(HealthCheck))
        PushMachine.TestCase().runTest()
    finally:
        _MACHINE_BASE = None
        _TRAINED.clear()
        _REFERENCES.clear()


def test_targets_are_those_of_the_tiny_model():
    assert set(CONFIG.target_modules) <= set(TARGETS["llama"])


# Pushes through CUDA IPC (lorakit.adapters.shared): a description checked field by field before any handle is opened.

def _description(**changes):
    from lorakit.adapters.shared import SharedTensor, SharedWeights

    fields = dict(device=0, handle=b"h" * 64, size=4096, storage_offset=0, ref_counter=b"/torch_12_345_0",
                  ref_counter_offset=3, event=b"", event_sync_required=False,
                  tensors=[SharedTensor("base_model.model.x.lora_A.weight", "bfloat16", [4, 8], 0),
                           SharedTensor("base_model.model.x.lora_B.weight", "float32", [8, 4], 256)])
    return SharedWeights(**{**fields, **changes})


@pytest.mark.parametrize("changes, phrase", [
    (dict(size=1 << 40), "more than"),
    (dict(handle=b""), "handle"),
    (dict(ref_counter=b"/etc/passwd"), "reference counter"),
    (dict(ref_counter_offset=10000), "reference counter"),
    (dict(ref_counter_offset=-1), "reference counter"),
    (dict(tensors=[]), "0 tensors"),
    (dict(size=300), "outside"),
    (dict(tensors=[_description().tensors[0]] * 2), "twice"),
])
def test_a_cuda_ipc_description_out_of_range_is_refused_before_it_is_opened(monkeypatch, changes, phrase):
    from lorakit.adapters import shared

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks run as on a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    shared.check_shared(_description(), 1 << 20, "here")  # the untouched description passes
    with pytest.raises(AdapterError, match=phrase):
        shared.check_shared(_description(**changes), 1 << 20, "here")
    for bad in (dict(dtype="int64"), dict(shape=[-1, 4]), dict(offset=7)):
        tensor = msgspec.structs.replace(_description().tensors[0], **bad)
        with pytest.raises(AdapterError, match="malformed"):
            shared.check_shared(_description(tensors=[tensor]), 1 << 20, "here")
    with pytest.raises(AdapterError, match="device 1"):
        shared.check_shared(_description(device=1), 1 << 20, "here")


def test_a_push_through_cuda_ipc_is_taken_from_this_host_only():
    from lorakit.serve.adapters import _ipc_push
    from lorakit.serve.protocol import ApiError
    from lorakit.serve.push import IpcPush

    body = msgspec.json.encode(IpcPush({"r": 4}, _description()))
    assert _ipc_push(body, "127.0.0.1")[0] == _description()
    for peer in ("10.0.0.7", "192.168.1.2", None):
        with pytest.raises(ApiError, match="only from this host") as e:
            _ipc_push(body, peer)
        assert e.value.status == 403


_SENDER = """
import sys, msgspec, torch
from safetensors.torch import load_file
from lorakit.adapters.shared import share
for path in sys.argv[1:]:  # one push each, the next once the receiver is done with it (a training loop's pushes)
    shared, buffer = share({k: v.cuda() for k, v in load_file(path).items()})
    sys.stdout.buffer.write(msgspec.json.encode(shared) + b"\\n"); sys.stdout.flush()
    sys.stdin.readline()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pushes_through_cuda_ipc_from_another_process_serve_as_peft_computes_them(base, tmp_path):
    """Another process's GPU tensors, handed over by handle, twice (the second push through the buffer kept open from
    the first): each the same content (sha256) as the same state dict pushed in-process, served as PEFT computes it;
    a handle that cannot be opened is refused by name and the engine serves on."""
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    from lorakit.adapters import shared as ipc

    models = [trained(base, seed).cuda() for seed in (6, 7)]
    states = [get_peft_model_state_dict(m) for m in models]
    for i, state in enumerate(states):
        save_file({k: v.cpu() for k, v in state.items()}, tmp_path / f"w{i}.safetensors")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, *(str(tmp_path / f"w{i}.safetensors") for i in (0, 1))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    engine = Engine(copy.deepcopy(base).cuda(), max_loras=2, block_size=4, device="cuda")
    prompt, shas, handles = [2, 7, 1, 8], [], []
    try:
        for version, model in enumerate(models, start=1):
            shared = msgspec.json.decode(sender.stdout.readline(), type=ipc.SharedWeights)
            handles.append(shared.handle)
            if version == 1:
                bad = msgspec.structs.replace(shared, handle=bytes(len(shared.handle)))
                with pytest.raises(AdapterError, match="CUDA IPC"):
                    engine.push_adapter("policy", bad, CONFIG)
            assert engine.push_adapter("policy", shared, CONFIG) == version
            shas.append(engine.pool.versions["policy"][1])
            assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(model, prompt)
            sender.stdin.write(b"next\n")
            sender.stdin.flush()
        assert handles[0] == handles[1] and len(ipc._opened) == 1  # the second push opened nothing
    finally:
        ipc.close_shared()
        sender.communicate(timeout=60)
    assert sender.returncode == 0
    for version, state in enumerate(states, start=3):
        assert engine.push_adapter("policy", state, CONFIG) == version
        assert engine.pool.versions["policy"][1] == shas[version - 3]


def test_a_push_may_name_its_version_above_every_number_the_name_has_had(base):
    """A training loop numbers its pushes by step (and the replicas of a fleet number one push alike): a number
    not above the name's last is refused (VersionTaken), the current version serving on; unnumbered pushes go on
    from the last."""
    from lorakit.adapters import VersionTaken

    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4)
    first, second = trained(base, 1), trained(base, 2)
    weights = [get_peft_model_state_dict(m) for m in (first, second)]
    assert engine.push_adapter("policy", weights[0], CONFIG, version=100) == 100
    for taken in (100, 99, 1):
        with pytest.raises(VersionTaken, match=f"version {taken} is not above its last version 100"):
            engine.push_adapter("policy", weights[1], CONFIG, version=taken)
    prompt = [3, 1, 4]
    assert run(engine, {"a": (prompt, "policy")})["a"] == peft_tokens(first, prompt)
    assert engine.push_adapter("policy", weights[1], CONFIG) == 101
    engine.unregister_adapter("policy")
    with pytest.raises(VersionTaken):  # numbers stay used after an unregister
        engine.push_adapter("policy", weights[1], CONFIG, version=101)
    assert engine.push_adapter("policy", weights[1], CONFIG, version=300) == 300


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6),
       st.booleans())
def test_a_safetensors_body_is_read_in_place_as_the_library_reads_it(specs, metadata):
    """Any tensors (dtypes, shapes, empty ones): the views equal safetensors' own load, and share the body's bytes."""
    from safetensors.torch import load

    from lorakit.adapters.snapshot import safetensors_views

    gen = torch.Generator().manual_seed(len(specs))
    tensors = {f"t{i}": (torch.randn(shape, generator=gen) * 100).to(dtype) for i, (dtype, shape) in enumerate(specs)}
    body = save(tensors, metadata={"k": "v"} if metadata else None)
    views = safetensors_views(body, "test")
    want = load(body)
    assert views.keys() == want.keys()
    for key, t in want.items():
        assert views[key].dtype == t.dtype and torch.equal(views[key], t), key


def test_a_malformed_safetensors_body_is_refused_by_what_is_wrong():
    import struct

    from lorakit.adapters.snapshot import safetensors_views

    def body(header: dict, data: bytes) -> bytes:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data

    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    good = body({"a": entry}, bytes(8))
    assert safetensors_views(good, "w")["a"].tolist() == [0.0, 0.0]
    for bad, phrase in ((good[:-1], "data_offsets"), (good[:5], "5 bytes"), (b"\xff" * 8 + good[8:], "header claims"),
                        (body({"a": entry}, bytes(12)), "4 bytes of data no entry names"),
                        (body({"a": {**entry, "dtype": "Q9"}}, bytes(8)), "'a'"),
                        (body({"a": {**entry, "shape": [-2]}}, bytes(8)), "'a'"),
                        (body({"a": entry, "b": entry}, bytes(8)), "'b'"),  # overlapping
                        (body({"a": {**entry, "data_offsets": [4, 12]}}, bytes(12)), "'a'"),  # a gap before
                        (b"\x02" + bytes(7) + b"[]", "not a JSON object")):
        with pytest.raises(AdapterError, match=phrase):
            safetensors_views(bad, "w")


def test_a_request_for_a_version_gone_before_the_engine_took_it_is_told_404(base):
    """A server resolved NAME@N, and the version ended before the engine took the request (a push and the last
    request on the old version in between): the engine's error says the adapter is gone, and the client gets the 404 a
    gone version gets at the edge, not a 400, whether the engine runs in the server's process or in a core process."""
    from lorakit.adapters import AdapterGone
    from lorakit.frontend.core import _Core
    from lorakit.frontend.wire import Add
    from lorakit.serve.protocol import ApiError
    from lorakit.serve.metrics import Metrics
    from lorakit.serve.state import _api_error, _Watched

    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4)
    engine.push_adapter("policy", get_peft_model_state_dict(trained(base, 1)), CONFIG)
    old = engine.pool.ref("policy")
    engine.push_adapter("policy", get_peft_model_state_dict(trained(base, 2)), CONFIG)  # v1 ends: nothing runs on it
    with pytest.raises(AdapterGone, match="version 1") as gone:
        engine.add_request([1, 2, 3], GREEDY, old)
    assert _api_error(gone.value).status == 404
    outputs = []
    core = _Core.__new__(_Core)  # its add alone: what the core answers for such a request
    core.engine, core.loop = engine, type("Loop", (), {"put": staticmethod(outputs.append)})()
    core.add(Add("r1", [1, 2, 3], GREEDY, old))
    (output,) = outputs
    assert output.adapter_gone and "version 1" in output.error
    told = []
    _Watched(0, lambda index, item: told.append(item), Metrics(engine).request("policy"))(output)
    assert isinstance(told[0], ApiError) and told[0].status == 404


def test_pushed_versions_share_the_cpu_budget_and_a_push_past_it_is_refused_by_name(base, tmp_path):
    """Pushed images live outside the CPU cache (there is no file to read them again from) but within its budget:
    they push cached folder images out, and a push that cannot fit is refused naming the budget, every version
    serving on; once a pushed adapter is unregistered, the push fits."""
    from _peft_models import save_adapter

    probe = Engine(copy.deepcopy(base), max_loras=2, block_size=4)
    probe.push_adapter("probe", get_peft_model_state_dict(trained(base, 1)), CONFIG)
    size = probe.pool.memory()["kept_bytes"]
    folder = save_adapter(base, "folder", CONFIG, tmp_path, seed=3).path
    engine = Engine(copy.deepcopy(base), max_loras=2, block_size=4, cpu_budget_bytes=2 * size + size // 2)
    engine.register_adapter("folder", folder)
    assert engine.pool.memory()["cpu_adapters"] == 1
    engine.push_adapter("a", get_peft_model_state_dict(trained(base, 1)), CONFIG)
    engine.push_adapter("a", get_peft_model_state_dict(trained(base, 2)), CONFIG)  # v1 ends: its memory comes back
    engine.push_adapter("b", get_peft_model_state_dict(trained(base, 3)), CONFIG)
    memory = engine.pool.memory()
    assert memory["kept_bytes"] == 2 * size and memory["cpu_bytes"] == 0  # the folder's image made room
    with pytest.raises(AdapterError, match="do not fit the CPU budget for adapters.*unregister pushed adapters"):
        engine.push_adapter("c", get_peft_model_state_dict(trained(base, 4)), CONFIG)
    assert engine.pool.adapters == {"folder": 1, "a": 2, "b": 1}
    prompt = [3, 1, 4]
    assert run(engine, {"x": (prompt, "folder")})["x"] == peft_tokens(_peft_of(base, folder), prompt)  # read again
    engine.unregister_adapter("b")
    assert engine.push_adapter("c", get_peft_model_state_dict(trained(base, 4)), CONFIG) == 1
    assert run(engine, {"y": (prompt, "c")})["y"] == peft_tokens(trained(base, 4), prompt)


def _peft_of(base, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
