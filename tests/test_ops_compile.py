"""The ops under torch.library.opcheck and torch.compile(fullgraph=True): compiled equals eager."""

import pytest
import torch

from _lora_cases import make_case
from lorakit.ops import add_lora, build_lora_meta, lora_delta, lora_shrink, wait_lora_delta

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def op_args(case, meta, split_k):
    h = lora_shrink(case.x, case.A, case.ranks, meta, split_k=split_k)
    shrink = (case.x, case.A, case.ranks, meta.token_slot, meta.token_order, meta.tiles, meta.block_m, split_k)
    ys = list(torch.split(case.y.clone(), case.slice_sizes, dim=1))
    expand = (ys, h, case.B, case.ranks, case.scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m)
    return shrink, expand


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mapping", ["uniform", "some-base"])
def test_opcheck(device, mapping):
    case = make_case(7, 40, [16, 8], 16, 3, mapping, torch.float32, seed=1).to(device)
    meta = build_lora_meta(case.slots, 3)
    shrink_args, expand_args = op_args(case, meta, split_k=2)
    torch.library.opcheck(torch.ops.lorakit.shrink.default, shrink_args)
    torch.library.opcheck(torch.ops.lorakit.expand.default, expand_args)
    delta_args = (case.x, case.A, case.B, case.ranks, case.scales, meta.token_slot, meta.token_order, meta.tiles,
                  meta.block_m, case.slice_sizes)
    torch.library.opcheck(torch.ops.lorakit.delta.default, delta_args)
    delta = torch.ops.lorakit.delta(*delta_args)
    torch.library.opcheck(torch.ops.lorakit.wait_delta.default, (delta, case.x, [case.y]))
    ys = list(torch.split(case.y.clone(), case.slice_sizes, dim=1))
    torch.library.opcheck(torch.ops.lorakit.add_delta.default, (ys, delta, case.x))


def lora_layer(y, x, A, B, ranks, scales, slots, num_slots: int, sizes: list[int]):
    """What a LoRA layer does in a forward pass: base output plus the delta, metadata built in-graph."""
    meta = build_lora_meta(slots, num_slots)
    out = y * 1.0
    add_lora(out, x, A, B, ranks, scales, meta, sizes)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager_without_graph_breaks(device):
    torch._dynamo.reset()
    compiled = torch.compile(lora_layer, fullgraph=True)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for seed, mapping in enumerate(["uniform", "some-base", "zipf", "all-base"]):
        case = make_case(9, 48, [16, 8, 8], 16, 4, mapping, dtype, seed=seed).to(device)
        args = (case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, 4, case.slice_sizes)
        eager, comp = lora_layer(*args), compiled(*args)
        assert torch.equal(eager, comp), f"compiled differs from eager on mapping {mapping}"


def lora_layer_beside(y, x, A, B, ranks, scales, slots, num_slots: int, sizes: list[int]):
    """The layer with the delta launched before the base layer and joined after (compiled LoraLinear at small T)."""
    meta = build_lora_meta(slots, num_slots)
    delta = lora_delta(x, A, B, ranks, scales, meta, sizes)
    base = y * 1.0  # the base layer
    wait_lora_delta(delta, x, [base])
    return (base.float() + delta).to(base.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_delta_beside_compiled_equals_eager_and_add_lora(device):
    torch._dynamo.reset()
    compiled = torch.compile(lora_layer_beside, fullgraph=True)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for seed, mapping in enumerate(["uniform", "some-base", "zipf", "all-base"]):
        case = make_case(9, 48, [16, 8, 8], 16, 4, mapping, dtype, seed=seed).to(device)
        args = (case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, 4, case.slice_sizes)
        eager, comp = lora_layer_beside(*args), compiled(*args)
        assert torch.equal(eager, comp), f"compiled differs from eager on mapping {mapping}"
        in_place = lora_layer(*args)
        if device == "cpu":
            assert torch.equal(eager, in_place)
        else:  # the in-place kernel may fuse the multiply-add: at most one rounding step apart
            assert torch.allclose(eager.float(), in_place.float(), rtol=2 ** -7, atol=0), mapping


def test_compiling_goes_through_the_registered_ops_even_on_a_direct_device(monkeypatch):
    """Eager calls on a direct device launch kernels themselves; traced, they must stay torch.ops calls."""
    import lorakit.ops as ops

    monkeypatch.setattr(ops, "DIRECT_DEVICES", {"cuda", "cpu"})
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    case = make_case(9, 48, [16, 8, 8], 16, 4, "some-base", torch.float32, seed=0)
    args = (case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, 4, case.slice_sizes)
    torch.compile(lora_layer, backend=backend, fullgraph=True)(*args)
    assert {"lorakit.shrink", "lorakit.expand"} <= seen
