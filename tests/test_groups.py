"""Sibling projections (q/k/v, gate/up) share one shrink and one expand, and stay exact in any case."""

import copy
import pathlib

import torch
from peft import LoraConfig
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lorakit
from helpers import rel_err
from _peft_models import TARGETS, VOCAB, save_adapter, tiny_model
from lorakit.peft import ModuleLora, PeftAdapter
from lorakit.layers.linear import LoraLinearGroup, LoraLinearMember
from lorakit.layers.slot_table import Loaded


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_llama_siblings_are_grouped_and_launch_once(tmp_path):
    base = tiny_model("llama", seed=0)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS["llama"], init_lora_weights=False)
    adapter = save_adapter(base, "all", cfg, tmp_path, seed=0)
    model = copy.deepcopy(base)
    handle = lorakit.patch(model, max_loras=2)
    handle.load_adapter("all", adapter.path)
    groups = [m for m in model.modules() if isinstance(m, LoraLinearGroup)]
    assert sorted(len(g.members) for g in groups) == [2, 2, 3, 3]  # q/k/v and gate/up of 2 layers
    attn = model.model.layers[0].self_attn
    assert [attn.q_proj.index, attn.k_proj.index, attn.v_proj.index] == [0, 1, 2]
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), CountOps() as ops:
        out = model(input_ids=input_ids, lora_ids=handle.ids(["all", None]), use_cache=False).logits
    # Per layer: q/k/v, o, gate/up, down; then the head. The embedding's shrink is a lookup.
    assert ops.counts["lorakit.shrink"] == 2 * 4 + 1
    assert ops.counts["lorakit.expand"] == 2 * 4 + 1 + 1
    with torch.no_grad():
        ref = adapter.peft_model(input_ids=input_ids[:1], use_cache=False).logits[0]
    assert rel_err(out[0], ref) < 1e-5


class CrossAttention(nn.Module):
    """q reads x; k and v read x in the traced dummy pass, but may read other states later."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 8)
        self.v = nn.Linear(16, 8)

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(1, 3, 16)}

    def forward(self, x, memory=None):
        kv = x if memory is None else memory
        return torch.cat([self.q(x), self.k(kv), self.v(kv)], dim=-1)


def test_groups_stay_exact_when_siblings_read_different_inputs():
    torch.manual_seed(0)
    model = CrossAttention().eval()
    handle = lorakit.patch(model, max_loras=2)
    assert isinstance(model.q, LoraLinearMember) and model.q.group is model.k.group
    gen = torch.Generator().manual_seed(1)
    loras = {}
    for name in ("q", "k", "v"):
        A = torch.randn(4, 16, generator=gen)
        B = torch.randn(getattr(model, name).out_features, 4, generator=gen)
        loras[name] = (A, B)
    adapter = PeftAdapter("manual", pathlib.Path("."), {}, {n: ModuleLora(A, B, 4, 0.5) for n, (A, B) in loras.items()})
    handle.slots.put(1, Loaded("manual"), handle.pack(adapter, pin=False))  # the slot-level path load_adapter takes
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    ids = handle.ids(["manual", None])
    with torch.no_grad():
        out = model(x, memory, lora_ids=ids)
        q = model.q.base_layer(x) + 0.5 * (x @ loras["q"][0].T) @ loras["q"][1].T
        k = model.k.base_layer(memory) + 0.5 * (memory @ loras["k"][0].T) @ loras["k"][1].T
        v = model.v.base_layer(memory) + 0.5 * (memory @ loras["v"][0].T) @ loras["v"][1].T
        ref = torch.cat([q, k, v], dim=-1)
        base = torch.cat([model.q.base_layer(x), model.k.base_layer(memory), model.v.base_layer(memory)], dim=-1)
    assert rel_err(out[0], ref[0]) < 1e-6
    assert torch.equal(out[1], base[1])


def test_model_without_dummy_inputs_is_patched_without_groups():
    class NoDummy(CrossAttention):
        dummy_inputs = None

    model = NoDummy()
    lorakit.patch(model, max_loras=2)
    assert not any(isinstance(m, LoraLinearGroup) for m in model.modules())


def gemms(counts: dict) -> int:
    return sum(counts.get(name, 0) for name in ("aten.mm", "aten.addmm", "aten.bmm"))


def test_fused_siblings_run_one_gemm_and_give_the_same_outputs(tmp_path):
    """fuse_sibling_gemms (the engine's runner calls it): each group's weights move into one buffer, the members'
    parameters views of their rows with unchanged values; a forward then runs one base GEMM per group instead of one
    per sibling, and gives the unfused logits with adapters and without (no lora_ids)."""
    base = tiny_model("llama", seed=0)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS["llama"], init_lora_weights=False)
    adapter = save_adapter(base, "all", cfg, tmp_path, seed=0)
    models, handles = {}, {}
    for fuse in (False, True):
        models[fuse] = copy.deepcopy(base)
        handles[fuse] = lorakit.patch(models[fuse], max_loras=2)
        handles[fuse].load_adapter("all", adapter.path)
    assert handles[True].fuse_sibling_gemms() == 4 and handles[True].fuse_sibling_gemms() == 4  # twice: a no-op
    for group in (m for m in models[True].modules() if isinstance(m, LoraLinearGroup)):
        weight = group._fused[0]
        for member, lo in zip(group.members, group.out_offsets):
            assert member.base_layer.weight.data_ptr() == weight[lo].data_ptr()
    for a, b in zip(base.parameters(), (p for n, p in models[True].named_parameters() if "lora" not in n)):
        assert torch.equal(a, b)
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    outs, counts = {}, {}
    for fuse, model in models.items():
        with torch.no_grad(), CountOps() as ops:
            outs[fuse] = model(input_ids=input_ids, lora_ids=handles[fuse].ids(["all", None]), use_cache=False).logits
        counts[fuse] = gemms(ops.counts)
        with torch.no_grad():
            outs[fuse, "plain"] = model(input_ids=input_ids, use_cache=False).logits
    assert counts[False] - counts[True] == 2 * (2 + 1)  # per layer: q/k/v 3 -> 1, gate/up 2 -> 1
    assert rel_err(outs[True], outs[False]) < 1e-6
    with torch.no_grad():
        assert rel_err(outs[True, "plain"], base(input_ids=input_ids, use_cache=False).logits) < 1e-6


def test_siblings_of_different_bias_are_not_fused_and_fused_ones_stay_exact_on_other_inputs():
    class Mixed(CrossAttention):
        def __init__(self):
            super().__init__()
            self.k = nn.Linear(16, 8, bias=False)

    torch.manual_seed(0)
    mixed = Mixed().eval()
    assert lorakit.patch(mixed, max_loras=2).fuse_sibling_gemms() == 0
    model = CrossAttention().eval()
    reference = copy.deepcopy(model)
    handle = lorakit.patch(model, max_loras=2)
    assert handle.fuse_sibling_gemms() == 1
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.no_grad():
        assert rel_err(model(x, memory), reference(x, memory)) < 1e-6
        assert rel_err(model(x, memory, lora_ids=handle.ids([None, None])), reference(x, memory)) < 1e-6
