"""Random LoRA problems for the op tests: shapes, ranks, slices and slot mappings that break kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

# Relative error ||out - ref|| / ||ref|| allowed on y, by dtype (the output is rounded to the dtype once,
# and expand rounds h to the weights' dtype for the tensor-core dot, as PEFT does).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# h is accumulated in float32 from exact products, whatever the input dtype.
H_TOLERANCE = 2e-5

MAPPINGS = ("distinct", "uniform", "zipf", "identical", "all-base", "some-base")


def make_slots(kind: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        slots = torch.arange(num_tokens) % num_slots
        return slots[torch.randperm(num_tokens, generator=gen)]
    if kind == "uniform":
        return torch.randint(0, num_slots, (num_tokens,), generator=gen)
    if kind == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.2
        return torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    if kind == "identical":
        return torch.full((num_tokens,), int(torch.randint(0, num_slots, (1,), generator=gen)))
    if kind == "all-base":
        return torch.full((num_tokens,), -1)
    if kind == "some-base":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
        return torch.where(torch.rand(num_tokens, generator=gen) < 0.4, -1, slots)
    raise ValueError(kind)


@dataclass
class Case:
    x: torch.Tensor
    y: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    slots: torch.Tensor
    slice_sizes: list[int]

    def to(self, device) -> "Case":
        return Case(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in vars(self).values()))


def make_case(
    num_tokens: int, in_features: int, slice_sizes: list[int], r_max: int, num_slots: int, mapping: str,
    dtype: torch.dtype, seed: int, b_transposed: bool = True, min_rank: int = 0,
) -> Case:
    """Random inputs (never zeros) scaled so that y and the LoRA delta are both of order one."""
    gen = torch.Generator().manual_seed(seed)
    n_slices, out = len(slice_sizes), sum(slice_sizes)
    ranks = torch.randint(min_rank, r_max + 1, (num_slots, n_slices), generator=gen, dtype=torch.int32)
    x = torch.randn(num_tokens, in_features, generator=gen)
    A = torch.randn(num_slots, n_slices, r_max, in_features, generator=gen) / in_features**0.5
    B = torch.randn(num_slots, r_max, out, generator=gen) / r_max**0.5
    B = B.transpose(1, 2) if b_transposed else B.transpose(1, 2).contiguous()
    return Case(
        x=x.to(dtype),
        y=torch.randn(num_tokens, out, generator=gen).to(dtype),
        A=A.to(dtype),
        B=B.to(dtype),
        ranks=ranks,
        scales=torch.rand(num_slots, n_slices, generator=gen) * 2 + 0.1,
        slots=make_slots(mapping, num_tokens, num_slots, gen),
        slice_sizes=list(slice_sizes),
    )


@st.composite
def cases(draw, dtypes, tokens=(1, 2, 3, 7, 16, 33, 133), in_sizes=(1, 3, 17, 64, 130),
          out_sizes=(1, 3, 8, 24, 67), r_maxes=(1, 4, 16, 33, 64, 128), max_slots=8) -> Case:
    n_slices = draw(st.integers(1, 3))
    return make_case(
        num_tokens=draw(st.sampled_from(tokens)),
        in_features=draw(st.sampled_from(in_sizes)),
        slice_sizes=[draw(st.sampled_from(out_sizes)) for _ in range(n_slices)],
        r_max=draw(st.sampled_from(r_maxes)),
        num_slots=draw(st.integers(1, max_slots)),
        mapping=draw(st.sampled_from(MAPPINGS)),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
        b_transposed=draw(st.booleans()),
    )
