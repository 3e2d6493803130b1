"""An adapter's image (``pack_adapter``): every part where its layout says, B transposed into its slice's columns, zeros
wherever no weight goes, and the same bytes whether the layout was planned for it or kept from an earlier pack."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lorakit
from _peft_models import tiny_model
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.image import layout_key, pack_adapter, plan_layout
from lorakit.peft import ModuleLora, PeftAdapter

_HANDLE = lorakit.patch(tiny_model("llama", seed=0), max_loras=2, max_rank=16)
_MODULES = list(_HANDLE.layers)  # q/k/v, o, gate/up, down of 2 layers, the embedding and the head


def _adapter(ranks: dict[str, int], seed: int, dtype=torch.float32) -> PeftAdapter:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for module, rank in ranks.items():
        base = _HANDLE.base_modules[module]
        out, inp = base.out_features, base.in_features
        modules[module] = ModuleLora(torch.randn(rank, inp, generator=g).to(dtype),
                                     torch.randn(out, rank, generator=g).to(dtype), rank, 0.5 + seed % 3)
    return PeftAdapter("a", "<test>", {}, modules)


def _expected(image, adapter: PeftAdapter) -> torch.Tensor:
    """The image as its layout's documentation says it must be, built part by part from zeros."""
    want = torch.zeros_like(image.buffer)
    by_store = {}
    for module, lora in adapter.modules.items():
        layer = _HANDLE.layers[module]
        store, index = (layer.group, layer.index) if hasattr(layer, "group") else (layer, 0)
        by_store.setdefault(id(store), {})[index] = lora
    for s in image.stores:
        slices = by_store[id(s.store)]
        b = s.b.view(want)
        for i, part in enumerate(s.a):
            lo, hi = s.store.out_offsets[i], s.store.out_offsets[i + 1]
            if part is None:
                assert i not in slices and s.ranks[i] == 0
                continue
            lora = slices[i]
            part.view(want).copy_(lora.A.T if isinstance(s.store, LoraEmbedding) else lora.A)
            b[: lora.rank, lo:hi].copy_(lora.B.T)
        s.rank_part.view(want).copy_(torch.tensor(s.ranks, dtype=torch.int32))
        scales = [slices[i].scale * (s.store.embed_scale() if isinstance(s.store, LoraEmbedding) else 1.0)
                  if i in slices else 0.0 for i in range(len(s.ranks))]
        s.scale_part.view(want).copy_(torch.tensor(scales, dtype=torch.float32))
    return want


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.sampled_from(_MODULES), st.integers(1, 16), min_size=1), st.integers(0, 5))
def test_an_image_holds_each_part_where_its_layout_says_whether_planned_now_or_kept(ranks, seed):
    """Any subset of modules at any ranks (siblings of one fused group at different ranks, some left out): the image
    equals one built part by part from zeros, and packing the same shape again from the kept layout gives the same
    bytes for the same weights and the right bytes for other weights."""
    ranks = {m: ranks[m] for m in _MODULES if m in ranks}  # the model's order, as adapters are read
    first = _adapter(ranks, seed)
    fresh = pack_adapter(first, _HANDLE.layers, pin=False)
    assert torch.equal(fresh.buffer, _expected(fresh, first))
    kept = _HANDLE.pack(first, pin=False)
    assert torch.equal(kept.buffer, fresh.buffer)
    second = _adapter(ranks, seed + 1)
    second.modules.update({m: ModuleLora(l.A, l.B, l.rank, first.modules[m].scale)
                           for m, l in second.modules.items()})  # the same scales: the same layout
    again = _HANDLE.pack(second, pin=False)
    assert again.stores is kept.stores  # the layout was planned once
    assert torch.equal(again.buffer, _expected(again, second))


def test_a_layout_is_keyed_by_what_it_depends_on():
    adapter = _adapter({_MODULES[0]: 4, _MODULES[3]: 8}, 0)
    key = layout_key(adapter.modules)
    other = _adapter({_MODULES[0]: 4, _MODULES[3]: 6}, 0)
    assert layout_key(other.modules) != key
    scaled = PeftAdapter("a", "<test>", {}, {m: ModuleLora(l.A, l.B, l.rank, 3.0) for m, l in adapter.modules.items()})
    assert layout_key(scaled.modules) != key
    layout = plan_layout(adapter.modules, _HANDLE.layers)
    assert layout.size == pack_adapter(adapter, _HANDLE.layers, pin=False).nbytes
