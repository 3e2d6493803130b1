"""Bad arguments raise errors that name the argument, its value and what was expected."""

import pytest
import torch

from _lora_cases import make_case
from lorakit.ops import add_lora, build_lora_meta


def good():
    case = make_case(5, 32, [16, 8], 8, 3, "uniform", torch.float32, seed=0)
    return case, build_lora_meta(case.slots, 3)


def call(case, meta, **override):
    args = dict(y=case.y.clone(), x=case.x, A=case.A, B=case.B, ranks=case.ranks, scales=case.scales,
                meta=meta, slice_sizes=case.slice_sizes)
    args.update(override)
    add_lora(**args)


def test_good_arguments_pass():
    call(*good())


@pytest.mark.parametrize(
    "override, message",
    [
        (lambda c: dict(x=c.x[None]), r"x must have 2 dimensions, got shape \(1, 5, 32\)"),
        (lambda c: dict(x=c.x.long()), r"x must have dtype in .*got torch.int64"),
        (lambda c: dict(A=c.A.half()), r"A must have dtype in \['torch.float32'\], got torch.float16"),
        (lambda c: dict(A=c.A[..., :31]), r"A must have shape \[S, n_slices, R_max, in=32\].*\(3, 2, 8, 31\)"),
        (lambda c: dict(A=c.A.transpose(2, 3)), r"A must have 4 dimensions|A must be contiguous in dimension 3"),
        (lambda c: dict(x=c.x.T.contiguous().T), r"x must be contiguous in dimension 1, got strides \(1, 5\)"),
        (lambda c: dict(ranks=c.ranks.long()), r"ranks must have dtype in \['torch.int32'\], got torch.int64"),
        (lambda c: dict(ranks=c.ranks[:2]), r"ranks must have shape \(3, 2\).*got \(2, 2\)"),
        (lambda c: dict(ranks=torch.full((3, 2), 9, dtype=torch.int32)), r"ranks must lie in \[0, R_max=8\].*\[9, 9\]"),
        (lambda c: dict(ranks=torch.full((3, 2), -1, dtype=torch.int32)), r"ranks must lie in \[0, R_max=8\]"),
        (lambda c: dict(scales=c.scales.double()), r"scales must have dtype in \['torch.float32'\]"),
        (lambda c: dict(B=c.B[:, :20]), r"B must have shape \(3, 24, 8\).*got \(3, 20, 8\)"),
        (lambda c: dict(y=c.y[:, :20].clone()), r"slice_sizes \[16, 8\] must add up to y's 20 columns"),
        (lambda c: dict(slice_sizes=[16, 4, 4]), r"ys must hold one output per slice of h \(2\), got 3"),
        (lambda c: dict(y=[c.y[:, :16].clone(), c.y[:3, 16:].clone()], slice_sizes=None),
         r"ys\[1\] must have 5 rows \(T from h\), got shape \(3, 8\)"),
        (lambda c: dict(y=[c.y[:, :16].clone(), c.y[:, 16:].double()], slice_sizes=None),
         r"ys\[1\] must have dtype in \['torch.float32'\], got torch.float64"),
        (lambda c: dict(y=c.y.half()), r"B must have dtype in \['torch.float16'\], got torch.float32"),
    ],
)
def test_bad_arguments_name_the_problem(override, message):
    case, meta = good()
    with pytest.raises((ValueError, TypeError), match=message):
        call(case, meta, **override(case))


def test_mapping_for_other_batch_is_refused():
    case, _ = good()
    other = build_lora_meta(torch.tensor([0, 1, 2]), 3)
    with pytest.raises(ValueError, match=r"token_slot must have shape \(5,\).*got \(3,\)"):
        call(case, other)


def test_failed_call_leaves_y_untouched():
    case, meta = good()
    y = case.y.clone()
    with pytest.raises(ValueError):
        add_lora(y, case.x, case.A, case.B, torch.full((3, 2), 99, dtype=torch.int32), case.scales, meta,
                 case.slice_sizes)
    assert torch.equal(y, case.y)


def test_meta_for_other_slot_count_is_refused():
    case, _ = good()
    with pytest.raises(ValueError, match=r"A holds 3 slots but the LoraMeta was built for num_slots=4"):
        call(case, build_lora_meta(case.slots, 4))
