"""Batch metadata: every token lands in exactly one tile of its own slot, on any mapping."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _lora_cases import MAPPINGS, make_slots
from lorakit.ops import build_lora_meta
from lorakit.ops.meta import EMPTY_SLOT, max_tiles


def check_meta(meta, slots):
    num_tokens = slots.shape[0]
    order = meta.token_order.long()
    assert sorted(order.tolist()) == list(range(num_tokens))
    assert torch.equal(meta.token_slot.long(), slots.long())
    seen = torch.zeros(num_tokens, dtype=torch.long)
    for slot, start, end in meta.tiles.T.tolist():
        assert 0 <= end - start <= meta.block_m
        if slot == EMPTY_SLOT:
            assert start == end == 0
            continue
        toks = order[start:end]
        assert start < end, "a used tile holds at least one token"
        assert (slots[toks] == slot).all(), "a tile holds tokens of one slot"
        seen[toks] += 1
    assert (seen == 1).all(), "every token is in exactly one tile"


@given(
    num_tokens=st.sampled_from([1, 2, 3, 7, 16, 17, 133, 600]),
    num_slots=st.integers(1, 40),
    mapping=st.sampled_from(MAPPINGS),
    seed=st.integers(0, 2**31 - 1),
)
def test_build_lora_meta_covers_every_token_once(num_tokens, num_slots, mapping, seed):
    slots = make_slots(mapping, num_tokens, num_slots, torch.Generator().manual_seed(seed))
    meta = build_lora_meta(slots, num_slots)
    assert meta.tiles.shape[1] == max_tiles(num_tokens, num_slots, meta.block_m)
    check_meta(meta, slots)


@pytest.mark.parametrize(
    "slots, num_slots, message",
    [
        (torch.tensor([0, 5]), 4, r"slots must lie in \[-1, 3\].*\[0, 5\]"),
        (torch.tensor([-2, 0]), 4, r"slots must lie in \[-1, 3\]"),
        (torch.tensor([[0]]), 4, "1-D tensor"),
        (torch.tensor([0.0]), 4, "int32 or int64"),
        (torch.tensor([0]), 0, "num_slots must be >= 1"),
    ],
)
def test_bad_slots_are_refused(slots, num_slots, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_lora_meta(slots, num_slots)
