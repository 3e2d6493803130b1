"""The pool on a GPU: uploads on the side stream that overlap forward passes leave every result bit-exact."""

import copy

import pytest
import torch
import transformers
from peft import LoraConfig

import lorakit
from _peft_models import save_adapter
from lorakit import AdapterPool

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    tmp = tmp_path_factory.mktemp("pool_gpu")
    folders = {}
    for seed, (name, rank) in enumerate((("a", 16), ("b", 16), ("c", 8), ("wide", 48))):
        cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
        folders[name] = save_adapter(base, name, cfg, tmp, seed=seed, std=0.02).path
    return base.to("cuda", torch.bfloat16), folders


def reference(base, folders, names, input_ids, max_loras):
    """Logits with the adapters loaded the plain way (synchronously, no pool), one batch per name, from a model
    with the same slot count and padded rank as the pool's, so the kernels take the same path."""
    out = {}
    for group in [names] if max_loras >= len(names) else [[n] for n in names]:
        model = copy.deepcopy(base)
        handle = lorakit.patch(model, max_loras=max_loras)
        for name in group:
            handle.load_adapter(name, folders[name])
        with torch.no_grad():
            for name in group:
                ids = handle.ids([name] * len(input_ids))
                out[name] = model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits
    return out


def long_batch():
    return torch.randint(0, 32000, (32, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))


def test_upload_overlapping_a_forward_is_bit_exact(setup):
    base, folders = setup
    input_ids = long_batch()
    ref = reference(base, folders, ["a", "b"], input_ids, max_loras=2)
    model = copy.deepcopy(base)
    pool = AdapterPool(lorakit.patch(model, max_loras=2))
    pool.register("a", folders["a"])
    pool.register("b", folders["b"])
    with torch.no_grad():
        slots_a = pool.acquire(["a"] * len(input_ids))
        out_a = model(input_ids=input_ids, lora_ids=torch.tensor(slots_a, device="cuda"), use_cache=False).logits
        assert pool.prefetch(["b"]) == ["b"]  # on the side stream, while the forward above runs
        slots_b = pool.acquire(["b"] * len(input_ids))  # the compute stream waits for the upload
        out_b = model(input_ids=input_ids, lora_ids=torch.tensor(slots_b, device="cuda"), use_cache=False).logits
    assert torch.equal(out_a, ref["a"]) and torch.equal(out_b, ref["b"])


def test_eviction_waits_for_the_last_reader(setup):
    """One slot: a released adapter's slot is overwritten only after the forward that read it has run."""
    base, folders = setup
    input_ids = long_batch()
    ref = reference(base, folders, ["a", "b"], input_ids, max_loras=1)
    model = copy.deepcopy(base)
    pool = AdapterPool(lorakit.patch(model, max_loras=1))
    pool.register("a", folders["a"])
    pool.register("b", folders["b"])
    pool.prefetch(["b"])  # into the CPU cache, then a's turn
    pool.synchronize()
    with torch.no_grad():
        outs = []
        for _ in range(3):
            slots = pool.acquire(["a"] * len(input_ids))
            outs.append(model(input_ids=input_ids, lora_ids=torch.tensor(slots, device="cuda"), use_cache=False).logits)
            pool.release(slots)  # queued forward still reading slot 0
            slots = pool.acquire(["b"] * len(input_ids))  # evicts a: the upload waits for that forward
            outs.append(model(input_ids=input_ids, lora_ids=torch.tensor(slots, device="cuda"), use_cache=False).logits)
            pool.release(slots)
    for i, out in enumerate(outs):
        assert torch.equal(out, ref["a" if i % 2 == 0 else "b"]), i
    assert pool.stats.loads == 7 and pool.stats.evictions == 6


def test_growth_after_pending_uploads_keeps_them(setup):
    base, folders = setup
    input_ids = long_batch()[:8, :64]
    ref = reference(base, folders, ["a", "c", "wide"], input_ids, max_loras=3)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=3)
    pool = AdapterPool(handle)
    for name in ("a", "c", "wide"):
        pool.register(name, folders[name])
    pool.prefetch(["a", "c"])  # uploads queued on the side stream, not waited for
    version = handle.slots.layout_version
    slots = pool.acquire(["wide"] * 8)  # rank 48: the slot buffers grow from 16 to 48
    assert handle.slots.layout_version == version + 1 and all(layer.r_max == 48 for layer in handle.layers.values()
                                              if hasattr(layer, "r_max") and layer.r_max)
    ids = {name: pool.acquire([name] * 8) for name in ("a", "c")}
    with torch.no_grad():
        for name, s in (("wide", slots), *ids.items()):
            out = model(input_ids=input_ids, lora_ids=torch.tensor(s, device="cuda"), use_cache=False).logits
            assert torch.equal(out, ref[name]), name
