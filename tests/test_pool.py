"""The adapter pool: tiers, eviction, hot-swap, pins, bad adapters at every tier, threads, and a stateful
model of it all (hypothesis), checked against the slot buffers' contents and against PEFT."""

import concurrent.futures
import copy
import hashlib
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from peft import LoraConfig
from safetensors.torch import load_file, save_file

import lorakit
from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from helpers import rel_err
from lorakit import AdapterPool, PoolFull
from lorakit.adapters import TooManyVersions
from lorakit.peft import AdapterError, load_peft_adapter
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.image import store_of

# name -> (rank, targets, use_rslora); "big" makes the padded rank grow past 16.
SPECS = {
    "q4": (4, ["q_proj", "v_proj"], False),
    "all8": (8, TARGETS["llama"], False),
    "mlp2": (2, ["gate_proj", "down_proj", "lm_head"], True),
    "big": (20, ["q_proj", "k_proj", "o_proj", "embed_tokens"], False),
    "emb6": (6, ["embed_tokens", "up_proj"], True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The base model and good adapter folders (name -> SavedAdapter), plus a NaN one that only its values betray."""
    tmp = tmp_path_factory.mktemp("pool")
    base = tiny_model("llama", seed=0)
    saved = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(SPECS.items()):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank + seed, target_modules=targets, use_rslora=rslora,
                         init_lora_weights=False)
        saved[name] = save_adapter(base, name, cfg, tmp, seed=seed, std=0.1)
    nan = tmp / "nan"
    nan.mkdir()
    (nan / "adapter_config.json").write_text((Path(saved["q4"].path) / "adapter_config.json").read_text())
    weights = load_file(Path(saved["q4"].path) / "adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    return base, saved, nan


def fresh_pool(base, max_loras=2, budget=1 << 20):
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=max_loras, max_rank=32)
    return model, handle, AdapterPool(handle, cpu_budget_bytes=budget)


def check_slot(handle, slot: int, path) -> None:
    """The slot holds exactly the adapter at ``path``: its rows up to each rank, zeros beyond, and rank 0
    (nothing) in every store it does not target."""
    adapter = load_peft_adapter("check", path, handle.base_modules, torch.float32)
    expected = {}
    for module, lora in adapter.modules.items():
        store, index = store_of(handle.layers[module])
        expected[(id(store), index)] = lora
    for layer in handle.layers.values():
        store, index = store_of(layer)
        lora = expected.get((id(store), index))
        rank = 0 if lora is None else lora.rank
        assert int(store.ranks[slot, index]) == rank
        if isinstance(store, LoraEmbedding):
            a = store.lora_A[slot].T  # [R_max, vocab]
        else:
            a = store.lora_A[slot, index]
        lo, hi = store.out_offsets[index], store.out_offsets[index + 1]
        b = store.lora_B[slot, :, lo:hi]
        if lora is not None:
            scale = lora.scale * (store.embed_scale() if isinstance(store, LoraEmbedding) else 1.0)
            assert float(store.scales[slot, index]) == pytest.approx(scale, rel=1e-6)
            assert torch.equal(a[:rank], lora.A.to(a.dtype))
            assert torch.equal(b[:rank], lora.B.T.to(b.dtype))
        assert not a[rank:].any() and not b[rank:].any()


def test_pool_serves_what_peft_computes_through_evictions(folders):
    base, saved, _ = folders
    model, handle, pool = fresh_pool(base, max_loras=2)
    for name, adapter in saved.items():
        pool.register(name, adapter.path)
    gen = torch.Generator().manual_seed(0)
    batches = [["q4", None, "all8"], ["big", "q4"], ["mlp2", "mlp2", None], ["emb6", "big"], ["all8", "q4", "q4"]]
    for names in batches:
        slots = pool.acquire(names)
        input_ids = torch.randint(0, VOCAB, (len(names), 6), generator=gen)
        with torch.no_grad():
            out = model(input_ids=input_ids, lora_ids=torch.tensor(slots), use_cache=False).logits
            for row, name in enumerate(names):
                ref_model = base if name is None else saved[name].peft_model
                ref = ref_model(input_ids=input_ids[row: row + 1], use_cache=False).logits[0]
                assert rel_err(out[row], ref) < 1e-5, (names, row)
        pool.release(slots)
    assert pool.stats.evictions > 0 and pool.stats.loads >= len(batches)
    assert handle.slots.layout_version >= 1  # "big" grew the padded rank


def test_hot_swap_keeps_running_requests_on_their_version(folders):
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2)
    assert pool.register("x", saved["q4"].path) == 1
    (old,) = pool.acquire(["x"])
    assert pool.register("x", saved["all8"].path) == 2
    (new,) = pool.acquire(["x"])
    assert new != old
    check_slot(handle, old, saved["q4"].path)  # still the old version for the request that holds it
    check_slot(handle, new, saved["all8"].path)
    pool.release([old])
    assert pool.memory()["slots"][old] is None  # retired and released: the slot is free
    with pytest.raises(PoolFull):  # one slot held by v2, the other free: two new names cannot both fit
        pool.register("y", saved["mlp2"].path)
        pool.register("z", saved["emb6"].path)
        pool.acquire(["y", "z"])
    pool.unregister("x")
    check_slot(handle, new, saved["all8"].path)  # unregistered, still held
    with pytest.raises(AdapterError, match="unknown adapter"):
        pool.acquire(["x"])
    pool.release([new])
    assert all(s is None for s in pool.memory()["slots"])


def test_a_claimed_version_outlives_its_replacement_until_its_last_claim(folders):
    """A version a request claimed is served after a hot-swap and an unregister (its image kept out of the CPU
    cache's reach, however full the cache gets); the last unclaim frees it, and a reference to it fails then."""
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2, budget=1 << 20)
    pool.register("x", saved["q4"].path)
    old, snapshot = pool.claim("x")
    assert (old.name, old.version, old.sha256) == ("x", 1, snapshot.sha256)
    assert pool.register("x", saved["all8"].path) == 2
    for name in ("mlp2", "emb6"):  # fill the CPU cache: the old version's image is not in it to drop
        pool.register(name, saved[name].path)
    assert pool.memory()["claimed_old_versions"] == 1 and pool.memory()["kept_bytes"] > 0
    (slot,) = pool.acquire([old])
    check_slot(handle, slot, saved["q4"].path)
    pool.unregister("x")
    again, _ = pool.claim(old)  # a reference to a claimed version may claim it again
    assert again == old
    pool.release([slot])
    pool.unclaim(old)
    check_slot(handle, slot, saved["q4"].path)  # one claim left: still in its slot
    pool.unclaim(old)
    assert pool.memory()["claimed_old_versions"] == 0 and pool.memory()["kept_bytes"] == 0
    assert pool.memory()["slots"][slot] is None
    with pytest.raises(AdapterError, match="version 1 was removed after this request was prepared"):
        pool.claim(old)
    assert pool.register("x", saved["q4"].path) == 3  # numbers are never reused: a ref to version 1 stays gone
    with pytest.raises(ValueError, match="not claimed"):
        pool.unclaim(pool.ref("x"))


def test_pins_are_never_evicted(folders):
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2)
    for name in ("q4", "all8", "mlp2"):
        pool.register(name, saved[name].path)
    slot = pool.pin("q4")
    for name in ("all8", "mlp2", "all8"):
        pool.release(pool.acquire([name]))
        assert pool.slot_of("q4") == slot
    check_slot(handle, slot, saved["q4"].path)
    held = pool.acquire(["all8"])
    with pytest.raises(PoolFull, match=r"'q4' v1 \(pinned\).*'all8' v1 \(1 holder"):
        pool.acquire(["mlp2"])
    pool.unpin("q4")
    pool.release(pool.acquire(["mlp2"]))  # q4 was the only one evictable
    assert pool.slot_of("q4") is None
    pool.release(held)


def test_prefetch_loads_without_holding(folders):
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2)
    for name in ("q4", "all8", "mlp2"):
        pool.register(name, saved[name].path)
    assert pool.prefetch(["q4", "all8", "mlp2"]) == ["q4", "all8"]  # two slots
    loads = pool.stats.loads
    slots = pool.acquire(["all8", "q4"])
    assert pool.stats.loads == loads  # already there
    check_slot(handle, slots[0], saved["all8"].path)
    assert pool.prefetch(["mlp2"]) == []  # both slots held
    pool.release(slots)


def test_prefetch_in_order_of_need_takes_later_ones_slots_never_earlier_ones(folders):
    """The scheduler prefetches for its queue in order: the head's adapter may take the slot of one a later request
    needs, and a later one never takes the head's (which would upload both again every step)."""
    base, saved, _ = folders
    _, _, pool = fresh_pool(base, max_loras=1)
    for name in ("q4", "all8"):
        pool.register(name, saved[name].path)
    assert pool.prefetch(["all8"]) == ["all8"]
    assert pool.prefetch(["q4", "all8"]) == ["q4"]  # q4 comes first: it takes all8's slot
    loads = pool.stats.loads
    assert pool.prefetch(["q4", "all8"]) == ["q4"] and pool.stats.loads == loads  # and keeps it
    assert pool.prefetch(["all8", "q4"]) == ["all8"]


def test_a_prefetch_reads_what_the_cpu_tier_dropped_off_the_engine_thread(folders, tmp_path, monkeypatch):
    """An adapter the CPU tier dropped is read from disk again (files, hash, checks: seconds for an 8B one). A prefetch
    starts that read on the pool's reader thread and returns at once; the first prefetch after the read loads it;
    files changed meanwhile fail that adapter alone when the read lands."""
    import lorakit.adapters.pool as pool_module

    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2, budget=6 << 10)  # one q4 or mlp2 image at a time
    gate, threads = threading.Event(), []
    reread = pool_module.reread

    def slow(*args, **kw):
        threads.append(threading.current_thread())
        assert gate.wait(30)
        return reread(*args, **kw)

    monkeypatch.setattr(pool_module, "reread", slow)
    changed = _copy(saved["q4"].path, tmp_path / "changed")
    pool.register("q4", saved["q4"].path)
    pool.register("changed", changed)
    pool.register("mlp2", saved["mlp2"].path)  # drops the others from the CPU tier
    assert pool.residency() == {"q4": "disk", "changed": "disk", "mlp2": "cpu"}
    assert pool.prefetch(["q4", "changed"]) == ["q4", "changed"]  # on their way: being read
    assert pool.slot_of("q4") is None and not pool.ready("q4") and threads[0] is not threading.current_thread()
    weights = load_file(changed / "adapter_model.safetensors")
    save_file({k: 2 * v for k, v in weights.items()}, changed / "adapter_model.safetensors", metadata={"format": "pt"})
    gate.set()
    concurrent.futures.wait([pool._reads[pool._current[n]] for n in ("q4", "changed")], timeout=30)  # not taken yet
    assert pool.prefetch(["q4"]) == ["q4"] and pool.ready("q4")
    slots = pool.acquire(["q4"])
    check_slot(handle, slots[0], saved["q4"].path)
    pool.release(slots)
    with pytest.raises(AdapterError, match="'changed'.*changed on disk since it was registered"):
        pool.prefetch(["changed"])
    assert pool.stats.cpu_misses == 2 and len(threads) == 2


def test_loads_evictions_and_residency_by_adapter(folders):
    """What /metrics reports per adapter: uploads and evictions by name, and the tier each one sits in."""
    base, saved, _ = folders
    _, _, pool = fresh_pool(base, max_loras=2)
    for name in ("q4", "all8", "mlp2", "emb6"):
        pool.register(name, saved[name].path)
    assert pool.residency() == dict.fromkeys(("q4", "all8", "mlp2", "emb6"), "cpu")  # the snapshots read
    for name in ("q4", "all8", "mlp2", "q4"):  # two slots: mlp2 evicts q4 (least recent), q4 then evicts all8
        pool.release(pool.acquire([name]))
    assert pool.stats.loads_by_adapter == {"q4": 2, "all8": 1, "mlp2": 1}
    assert pool.stats.evictions_by_adapter == {"q4": 1, "all8": 1}
    assert pool.stats.loads == 4 and pool.stats.evictions == 2
    assert pool.residency() == {"q4": "gpu", "all8": "cpu", "mlp2": "gpu", "emb6": "cpu"}
    pool.unregister("q4")  # its counts stay; it is no longer resident anywhere
    assert "q4" not in pool.residency() and pool.stats.as_dict()["loads_by_adapter"]["q4"] == 2


def test_bad_adapters_are_refused_at_every_tier_and_change_nothing(folders, tmp_path):
    base, saved, nan = folders
    _, handle, pool = fresh_pool(base, max_loras=2, budget=16 << 10)
    pool.register("ok", saved["q4"].path)
    held = pool.acquire(["ok"])
    before = pool.memory()

    # Disk tier: refused at registration; a bad new version keeps the old.
    with pytest.raises(AdapterError, match="no such folder"):
        pool.register("ok", tmp_path / "missing")
    bad = tmp_path / "pickle"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((Path(saved["q4"].path) / "adapter_config.json").read_text())
    (bad / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(AdapterError, match="pickle"):
        pool.register("ok", bad)
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "adapter_config.json").write_text((Path(saved["q4"].path) / "adapter_config.json").read_text())
    weights = load_file(Path(saved["q4"].path) / "adapter_model.safetensors")
    save_file({k.replace("layers.0.", "layers.7."): v for k, v in weights.items()}, lacking / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="the model has no module 'model.layers.7.self_attn"):
        pool.register("lacking", lacking)
    with pytest.raises(AdapterError, match="more than the whole CPU cache"):
        pool.register("huge", saved["all8"].path)
    with pytest.raises(ValueError, match="1 to 128 characters of letters, digits and"):
        pool.register("", saved["q4"].path)
    # The values are read at registration too: a NaN is refused then, naming the module.
    with pytest.raises(AdapterError, match="'nan'.*module 'model.layers.0.self_attn.[qv]_proj': [AB] holds NaN"):
        pool.register("nan", nan)
    with pytest.raises(AdapterError, match="'ok'.*NaN"):
        pool.register("ok", nan)
    assert pool.adapters == {"ok": 1}
    after = pool.memory()
    assert after["slots"] == before["slots"] and after["cpu_bytes"] == before["cpu_bytes"]

    # CPU tier: read again after an eviction, the files must be the ones registered, or the adapter fails closed.
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (changed / f).write_bytes((Path(saved["q4"].path) / f).read_bytes())
    pool.register("changed", changed)
    pool.register("other", saved["mlp2"].path)
    pool.register("third", saved["emb6"].path)  # the CPU tier (16 KiB) drops "changed"
    assert pool.residency()["changed"] == "disk"
    (changed / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="'changed'.*changed on disk since it was registered.*register it again"):
        pool.acquire(["changed"])
    (changed / "adapter_model.safetensors").write_bytes((Path(saved["q4"].path) / "adapter_model.safetensors")
                                                        .read_bytes())
    with pytest.raises(AdapterError, match="changed on disk"):  # closed until registered again
        pool.acquire(["changed"])
    pool.register("changed", changed)
    pool.release(pool.acquire(["changed"]))

    # GPU tier and bad calls.
    with pytest.raises(PoolFull, match="2 adapter"):
        pool.acquire(["other", "third"])
    with pytest.raises(ValueError, match="slot 1 is not held"):
        pool.release([1])
    with pytest.raises(ValueError, match="not held 2 time"):
        pool.release(held * 2)
    with pytest.raises(TypeError, match="list of adapter names"):
        pool.acquire("ok")
    with pytest.raises(RuntimeError, match="managed by AdapterPool"):
        handle.load_adapter("direct", saved["q4"].path)
    check_slot(handle, held[0], saved["q4"].path)
    pool.release(held)


def _copy(src, dest: Path) -> Path:
    dest.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (dest / f).write_bytes((Path(src) / f).read_bytes())
    return dest


def _sha256(folder: Path) -> str:
    """What `sha256sum adapter_config.json adapter_model.safetensors | sha256sum` prints in the folder."""
    lines = "".join(f"{hashlib.sha256((folder / f).read_bytes()).hexdigest()}  {f}\n"
                    for f in ("adapter_config.json", "adapter_model.safetensors"))
    return hashlib.sha256(lines.encode()).hexdigest()


def test_what_is_served_is_what_was_registered(folders, tmp_path):
    """Registration reads the files once and hashes them; after a CPU-tier eviction the re-read must find the same
    bytes at the same real paths, or that adapter alone fails closed until it is registered again."""
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2, budget=6 << 10)  # one q4 or mlp2 image at a time
    same, edited, swapped, moved = (_copy(saved["q4"].path, tmp_path / n)
                                    for n in ("same", "edited", "swapped", "moved"))
    for name in ("same", "edited", "swapped", "moved"):
        pool.register(name, tmp_path / name)
    pool.register("steady", saved["mlp2"].path)  # each registration dropped the one before from the CPU tier
    assert pool.residency() == {"same": "disk", "edited": "disk", "swapped": "disk", "moved": "disk", "steady": "cpu"}
    assert pool.versions["same"] == (1, _sha256(same)) == (1, pool.snapshot("same").sha256)

    weights = load_file(same / "adapter_model.safetensors")
    save_file({k: 2 * v for k, v in weights.items()}, edited / "adapter_model.safetensors",
              metadata={"format": "pt"})  # valid, the same size, other values
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((same / "adapter_model.safetensors").read_bytes())  # even the same bytes: not followed
    (swapped / "adapter_model.safetensors").unlink()
    (swapped / "adapter_model.safetensors").symlink_to(outside)
    (moved / "new").write_bytes((moved / "adapter_model.safetensors").read_bytes())
    (moved / "new").replace(moved / "adapter_model.safetensors")  # another file, the same bytes: the same version

    misses = pool.stats.cpu_misses
    for name in ("same", "moved"):
        slots = pool.acquire([name, "steady"])
        check_slot(handle, slots[0], same)
        check_slot(handle, slots[1], saved["mlp2"].path)
        pool.release(slots)
    assert pool.stats.cpu_misses == misses + 2
    with pytest.raises(AdapterError, match=r"adapter 'edited' at .*edited: changed on disk since it was registered "
                                           r"\(sha256 [0-9a-f]{64}, registered [0-9a-f]{64}\); register it again"):
        pool.acquire(["edited", "steady"])
    with pytest.raises(AdapterError, match="'swapped'.*changed on disk.*adapter_model.safetensors no longer resolves"):
        pool.acquire(["swapped"])
    slots = pool.acquire(["steady", None])  # everyone else is served
    check_slot(handle, slots[0], saved["mlp2"].path)
    pool.release(slots)
    assert pool.register("edited", edited) == 2  # registered again: the new bytes, a new hash
    assert pool.versions["edited"] == (2, _sha256(edited)) and _sha256(edited) != _sha256(same)
    pool.release(pool.acquire(["edited"]))


def test_read_then_install(folders, tmp_path):
    """``read`` (any thread) checks everything and changes nothing; ``install`` makes it a version, once; ``roots``
    keep every file of the folder inside them."""
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=2)
    snapshot = pool.read("x", saved["q4"].path)
    assert pool.adapters == {} and pool.residency() == {} and pool.memory()["cpu_bytes"] == 0
    assert snapshot.sha256 == _sha256(Path(saved["q4"].path)) and snapshot.info.path == Path(saved["q4"].path)
    assert pool.install(snapshot) == 1 and pool.residency() == {"x": "cpu"}
    with pytest.raises(ValueError, match="installed already"):
        pool.install(snapshot)
    _, _, other = fresh_pool(base, max_loras=2)
    with pytest.raises(ValueError, match="read by another pool"):
        other.install(pool.read("x", saved["all8"].path))
    assert pool.adapters == {"x": 1}

    root = tmp_path / "root"
    root.mkdir()
    inside = _copy(saved["q4"].path, root / "inside")
    assert pool.read("y", inside, roots=[root]).sha256 == _sha256(inside)
    with pytest.raises(AdapterError, match="the folder resolves to .* outside the folders adapters may be loaded"):
        pool.read("y", saved["q4"].path, roots=[root])
    leaky = _copy(saved["q4"].path, root / "leaky")
    outside = tmp_path / "outside.safetensors"
    (leaky / "adapter_model.safetensors").replace(outside)
    (leaky / "adapter_model.safetensors").symlink_to(outside)
    with pytest.raises(AdapterError, match="adapter_model.safetensors resolves to .*outside.safetensors, outside the "):
        pool.read("y", leaky, roots=[root])
    pool.read("y", leaky)  # a library caller's own links are followed (only to the real path, then never again)


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "x\ny", "<b>x</b>", "a b", "", "a" * 129, None, "é"])
def test_adapter_names_are_checked(folders, name):
    base, saved, _ = folders
    _, _, pool = fresh_pool(base, max_loras=1)
    with pytest.raises(ValueError, match=r"an adapter name must be 1 to 128 characters of letters, digits and "
                                         r"\. _ : \+ - \(not starting with '\.'\), got"):
        pool.register(name, saved["q4"].path)
    for good in ("sql", "org.model-v2:latest+1", "a" * 128, "_x"):
        pool.register(good, saved["q4"].path)


def test_pool_refuses_to_start_on_what_would_not_fit(folders):
    base, saved, _ = folders
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    with pytest.raises(MemoryError, match="cpu_budget_bytes"):
        AdapterPool(handle, cpu_budget_bytes=1 << 60)
    handle.load_adapter("a", saved["q4"].path)
    with pytest.raises(ValueError, match="already holds adapters"):
        AdapterPool(handle)
    handle.unload_adapter("a")
    pool = AdapterPool(handle)
    with pytest.raises(ValueError, match="already managed"):
        AdapterPool(handle)
    assert pool.memory()["gpu_slot_buffers_at_max_rank"] == handle.slot_bytes(handle.config.max_rank)


def test_register_while_acquiring_from_threads(folders):
    base, saved, _ = folders
    _, handle, pool = fresh_pool(base, max_loras=3)
    versions = [saved["q4"].path, saved["all8"].path, saved["mlp2"].path]
    pool.register("x", versions[0])
    pool.register("steady", saved["emb6"].path)
    errors, stop = [], threading.Event()

    def swapper():
        try:
            for i in range(40):
                pool.register("x", versions[i % 3])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    def user():
        try:
            while not stop.is_set():
                try:
                    slots = pool.acquire(["x", "steady", None])
                except PoolFull:
                    continue
                slot = slots[0]
                ranks = int(handle.layers["model.layers.0.self_attn.v_proj"].group.ranks[slot, 2])
                path = {4: versions[0], 8: versions[1], 0: versions[2]}[ranks]
                check_slot(handle, slot, path)  # whole and of one version while held
                check_slot(handle, slots[1], saved["emb6"].path)
                pool.release(slots)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=swapper)] + [threading.Thread(target=user) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert pool.adapters["x"] == 41 and all(s is None or s["holders"] == 0 for s in pool.memory()["slots"])


NAMES = ("a", "b", "c", "d")
FOLDERS = tuple(SPECS) + ("nan",)


class PoolMachine(RuleBasedStateMachine):
    """Drives the pool against a model: the registry (name -> version), who holds what, and the pins. After
    every step: each held slot holds exactly the version that was current when it was acquired (or the claimed
    version it was acquired for), no slot holds two versions, reference counts match, budgets hold, pinned adapters
    are resident, and a replaced version lives exactly while it is claimed."""

    SLOTS = 2

    @initialize()
    def setup(self):
        base, self.saved, self.nan = _MACHINE_FOLDERS
        self.model, self.handle, self.pool = fresh_pool(base, max_loras=self.SLOTS, budget=45 << 10)
        self.current: dict[str, tuple[int, str]] = {}  # name -> (version id, folder)
        self.next_id = 0
        self.leases: list[tuple[list[int], list]] = []  # (slots, [(version id, folder) or None])
        self.pins: set[str] = set()
        self.kept: set[int] = set()  # pinned versions seen resident: they must stay
        self.claims: list[tuple] = []  # (AdapterRef, (version id, folder)) of each claim held
        for name, folder in zip(NAMES, ("all8", "q4", "big")):  # start with work to do
            self.register(name, folder)

    def path(self, folder):
        return self.nan if folder == "nan" else self.saved[folder].path

    def busy(self) -> set[int]:
        """Versions that take a slot no other adapter can have: held ones, and resident pinned ones (a pinned
        name's new version is resident only once a slot was free for it)."""
        held = {v[0] for _, versions in self.leases for v in versions if v is not None}
        return held | {self.current[n][0] for n in self.pins if self.pool.slot_of(n) is not None}

    @rule(name=st.sampled_from(NAMES), folder=st.sampled_from(FOLDERS))
    def register(self, name, folder):
        claimed = {v[0] for ref, v in self.claims if ref.name == name}  # versions of the name requests run on
        try:
            self.pool.register(name, self.path(folder))
        except TooManyVersions:
            assert len(claimed) >= self.pool.max_versions and folder != "nan"
            return
        except AdapterError as e:
            assert folder == "nan" and "NaN" in str(e)  # the values are read at registration
            return
        assert len(claimed) < self.pool.max_versions
        assert folder != "nan"
        self.current[name] = (self.next_id, folder)
        self.next_id += 1

    @rule(name=st.sampled_from(NAMES))
    def unregister(self, name):
        if name not in self.current:
            with pytest.raises(AdapterError, match="no adapter"):
                self.pool.unregister(name)
            return
        self.pool.unregister(name)
        del self.current[name]
        self.pins.discard(name)

    @rule(names=st.lists(st.sampled_from(NAMES + (None,)), min_size=1, max_size=4))
    def acquire(self, names):
        if any(n is not None and n not in self.current for n in names):
            with pytest.raises(AdapterError, match="unknown adapter"):
                self.pool.acquire(names)
            return
        versions = [None if n is None else self.current[n] for n in names]
        wanted = {v[0] for v in versions if v is not None}
        full = len(wanted | self.busy()) > self.SLOTS
        resident = {self.current[n][0] for n in self.current if self.pool.slot_of(n) is not None}
        try:
            slots = self.pool.acquire(names)
        except PoolFull:
            assert full
            return
        assert not full, (names, resident)
        self.leases.append((slots, versions))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        slots, _ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.pool.release(slots)

    @rule(name=st.sampled_from(NAMES))
    def pin(self, name):
        if name not in self.current:
            with pytest.raises(AdapterError):
                self.pool.pin(name)
            return
        full = len({self.current[name][0]} | self.busy()) > self.SLOTS
        try:
            self.pool.pin(name)
        except PoolFull:
            assert full
            return
        assert not full
        self.pins.add(name)

    @rule(name=st.sampled_from(NAMES))
    def unpin(self, name):
        if name in self.pins:
            self.pool.unpin(name)
            self.pins.discard(name)
        else:
            with pytest.raises(AdapterError, match="not pinned"):
                self.pool.unpin(name)

    @rule(name=st.sampled_from(NAMES))
    def claim(self, name):
        if name not in self.current:
            with pytest.raises(AdapterError, match="unknown adapter"):
                self.pool.claim(name)
            return
        ref, _ = self.pool.claim(name)
        self.claims.append((ref, self.current[name]))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def acquire_claimed(self, data):
        """A request's acquire: the version it claimed, whatever replaced it since."""
        ref, version = self.claims[data.draw(st.integers(0, len(self.claims) - 1))]
        full = len({version[0]} | self.busy()) > self.SLOTS
        try:
            slots = self.pool.acquire([ref])
        except PoolFull:
            assert full
            return
        assert not full
        self.leases.append((slots, [version]))

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def unclaim(self, data):
        ref, _ = self.claims.pop(data.draw(st.integers(0, len(self.claims) - 1)))
        self.pool.unclaim(ref)

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))
    def prefetch(self, names):
        try:
            self.pool.prefetch(names)
        except AdapterError as e:
            assert "unknown adapter" in str(e)

    @invariant()
    def held_slots_hold_their_version(self):
        if not hasattr(self, "pool"):
            return
        holders: dict[int, int] = {}
        for slots, versions in self.leases:
            for slot, v in zip(slots, versions):
                if v is None:
                    assert slot == -1
                    continue
                check_slot(self.handle, slot, self.path(v[1]))
                holders[slot] = holders.get(slot, 0) + 1
        mem = self.pool.memory()
        for slot, info in enumerate(mem["slots"]):
            assert (info["holders"] if info else 0) == holders.get(slot, 0)
        occupants = [v for v in self.pool.slots if v is not None]
        assert len(set(map(id, occupants))) == len(occupants)
        current = {v[0] for v in self.current.values()}
        assert mem["claimed_old_versions"] == len({v[0] for _, v in self.claims} - current)
        assert all(self.pool.slots[v.slot] is v for v in occupants)
        assert all(v.refs > 0 or v.claims > 0 or self.pool._current.get(v.name) is v for v in occupants)  # retired: freed
        assert mem["cpu_bytes"] <= mem["cpu_budget"]
        for name in self.pins:
            version = self.current[name][0]
            if version in self.kept:
                assert self.pool.slot_of(name) is not None
            elif self.pool.slot_of(name) is not None:
                self.kept.add(version)
        assert self.pool.adapters == {n: self.pool.adapters[n] for n in self.current}

    def teardown(self):
        if hasattr(self, "pool"):
            for slots, _ in self.leases:
                self.pool.release(slots)
            assert all(s is None or s["holders"] == 0 for s in self.pool.memory()["slots"])


_MACHINE_FOLDERS = None


@pytest.fixture(scope="module")
def machine_folders(folders):
    global _MACHINE_FOLDERS
    base, saved, nan = folders
    _MACHINE_FOLDERS = (base, saved, nan)
    yield
    _MACHINE_FOLDERS = None


def test_pool_state_machine(machine_folders):
    PoolMachine.TestCase.settings = settings(settings.default, max_examples=60, stateful_step_count=40,
                                             suppress_health_check=list(HealthCheck))
    PoolMachine.TestCase().runTest()
