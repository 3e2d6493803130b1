"""The ops under torch.library.opcheck and torch.compile(fullgraph=True): compiled equals eager."""

import pytest
import torch

from _lora_cases import make_case
from lorakit.ops import KernelOptions, add_lora, build_lora_meta, lora_shrink

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
    # with the launch options (programmatic dependent launch: ignored where unsupported, never in the results)
    torch.library.opcheck(torch.ops.lorakit.shrink.default, (*shrink_args, True, True))
    torch.library.opcheck(torch.ops.lorakit.expand.default, (*expand_args, True))
    dora = torch.rand(3, 2, 24, device=device) - 0.5  # a DoRA rescale of every slot (gain - 1, shift)
    torch.library.opcheck(torch.ops.lorakit.expand.default, (*expand_args, False, dora))


def lora_layer(y, x, A, B, ranks, scales, slots, num_slots: int, sizes: list[int],
               options: KernelOptions = KernelOptions()):
    """What a LoRA layer does in a forward pass: base output plus the delta, metadata built in-graph."""
    meta = build_lora_meta(slots, num_slots)
    out = y * 1.0
    add_lora(out, x, A, B, ranks, scales, meta, sizes, options=options)
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


@pytest.mark.parametrize("pdl", [frozenset(), frozenset({"expand"}), frozenset({"shrink", "expand"})])
def test_compiling_goes_through_the_registered_ops_even_on_a_direct_device(pdl):
    """Eager calls on a direct device launch kernels themselves; traced, they must stay torch.ops calls, which
    carry the options' programmatic dependent launch as constants."""
    options = KernelOptions(pdl=pdl, direct_devices={"cuda", "cpu"})
    calls = {}

    def backend(gm, example_inputs):
        calls.update((str(n.target), n.args) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    case = make_case(9, 48, [16, 8, 8], 16, 4, "some-base", torch.float32, seed=0)
    args = (case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, 4, case.slice_sizes, options)
    torch.compile(lora_layer, backend=backend, fullgraph=True)(*args)
    assert calls["lorakit.shrink"][8:] == ("shrink" in pdl, "expand" in pdl)  # pdl, and the trigger for the expand
    assert calls["lorakit.expand"][9:] == ("expand" in pdl, None)  # pdl; no DoRA rescale
