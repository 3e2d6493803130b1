"""Custom ops in the ``lorakit`` namespace: Triton kernels on CUDA, plain torch on CPU, fake kernels.

    meta = build_lora_meta(slots, num_slots)            # once per batch, shared by every layer
    add_lora(y, x, A, B, ranks, scales, meta, sizes)    # one layer: y[t] += scale * (x[t] @ A[s].T) @ B[s].T

    with no_adapter_tokens():                           # a batch of base-model tokens only: no LoRA launches
        ...

    write_kv(k_cache, v_cache, key, value, kv_index)    # the engine's paged KV cache (ops/attention.py)
    out = paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale)

``torch.ops.lorakit.shrink`` and ``expand`` are the registered LoRA ops; the functions here only unpack
``LoraMeta``, pick ``split_k`` and pass the ``KernelOptions`` (how the kernels launch) on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorakit.ops import expand as _expand_mod  # noqa: F401  (registers lorakit::expand)
from lorakit.ops import shrink as _shrink_mod  # noqa: F401  (registers lorakit::shrink)
from lorakit.ops._checks import MAX_SLICES, cdiv, no_adapter_tokens, num_sms, round_up, unobserved
from lorakit.ops.attention import paged_attention, write_kv
from lorakit.ops.experts import add_expert_lora, expert_keys  # registers lorakit::expert_lora
from lorakit.ops.fused import launch_fused  # registers lorakit::fused
from lorakit.ops.meta import LoraMeta, block_m_for, build_lora_meta
from lorakit.ops.expand import _check_expand_args, _launch_expand
from lorakit.ops.options import KernelOptions
from lorakit.ops.shrink import _check_shrink_args, _launch_shrink, shrink_split_k

__all__ = [
    "MAX_SLICES", "KernelOptions", "LoraMeta", "add_expert_lora", "add_lora", "block_m_for", "build_lora_meta", "cdiv",
    "expert_keys", "lora_expand",
    "lora_shrink", "no_adapter_tokens", "num_sms", "paged_attention", "round_up", "split_columns", "write_kv",
]

DEFAULT_OPTIONS = KernelOptions()


def _check_slot_count(meta: LoraMeta, weights: torch.Tensor, name: str) -> None:
    if weights.shape[0] != meta.num_slots:
        raise ValueError(
            f"{name} holds {weights.shape[0]} slots but the LoraMeta was built for num_slots={meta.num_slots}; "
            f"build the metadata with the slot count of the weights"
        )


def _direct(options: KernelOptions, *tensors: torch.Tensor) -> bool:
    """Whether an eager call may check its arguments and launch the kernels itself, skipping the dispatcher: on
    ``options.direct_devices``, where nothing needs to see the op (``unobserved``). The kernels and checks are the
    registered op's, so the results are the same."""
    return tensors[0].device.type in options.direct_devices and unobserved(*tensors)


def lora_shrink(x: torch.Tensor, A: torch.Tensor, ranks: torch.Tensor, meta: LoraMeta,
                split_k: int | None = None, check: bool = True,
                options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``torch.ops.lorakit.shrink`` over a LoraMeta: float32 partials [split_k, n_slices, T, R_max].

    check=False skips the argument checks of an eager call on CUDA (about 10 us of host time): for callers whose
    tensors lorakit itself built and checked (the LoRA layers' buffers, a LoraMeta, x in A's dtype, contiguous).
    options: how the kernel launches (the shrink lets a PDL expand launch early)."""
    if check:
        _check_slot_count(meta, A, "A")
    if split_k is None:
        split_k = shrink_split_k(x.shape[1], A.shape[1], A.shape[2], meta.tiles.shape[1], meta.block_m,
                                 num_sms(x.device))
    pdl, trigger = "shrink" in options.pdl, "expand" in options.pdl
    if _direct(options, x, A):
        if check:
            _check_shrink_args(x, A, ranks, meta.token_slot, meta.token_order, meta.tiles, meta.block_m, split_k)
        return _launch_shrink(x, A, ranks, meta.token_order, meta.tiles, meta.block_m, split_k, pdl, trigger)
    return torch.ops.lorakit.shrink(x, A, ranks, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                                    split_k, pdl, trigger)


def split_columns(y: torch.Tensor, slice_sizes: Sequence[int] | None) -> list[torch.Tensor]:
    """Column views of y, one per slice (the whole of y when slice_sizes is None)."""
    if slice_sizes is None:
        return [y]
    if sum(slice_sizes) != y.shape[-1]:
        raise ValueError(f"slice_sizes {list(slice_sizes)} must add up to y's {y.shape[-1]} columns")
    return list(torch.split(y, list(slice_sizes), dim=-1))


def lora_expand(ys: torch.Tensor | Sequence[torch.Tensor], h: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor,
                scales: torch.Tensor, meta: LoraMeta, slice_sizes: Sequence[int] | None = None,
                check: bool = True, options: KernelOptions = DEFAULT_OPTIONS,
                dora: torch.Tensor | None = None) -> None:
    """``torch.ops.lorakit.expand`` over a LoraMeta: ys[i] += scale * h[i] @ B[slice i].T, in place, then DoRA's
    per-column rescale where ``dora`` (float32 [S, 1 or 2, out]: see the op) is given.

    ys: one output per slice, or one tensor y split into slices of widths slice_sizes; check, options: as for
    lora_shrink."""
    if check:
        _check_slot_count(meta, B, "B")
    outs = split_columns(ys, slice_sizes) if isinstance(ys, torch.Tensor) else list(ys)
    pdl = "expand" in options.pdl
    if _direct(options, h, B, *outs):
        if check:
            _check_expand_args(outs, h, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                               dora)
        _launch_expand(outs, h, B, ranks, scales, meta.token_order, meta.tiles, meta.block_m, pdl, dora=dora)
        return
    torch.ops.lorakit.expand(outs, h, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                             pdl, dora)


def add_lora(y: torch.Tensor | Sequence[torch.Tensor], x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             ranks: torch.Tensor, scales: torch.Tensor, meta: LoraMeta,
             slice_sizes: Sequence[int] | None = None, check: bool = True,
             options: KernelOptions = DEFAULT_OPTIONS, dora: torch.Tensor | None = None) -> None:
    """The whole LoRA delta of one (possibly fused) layer, added in place.

    Semantics:
        for t, i: s = meta.token_slot[t]; r = ranks[s, i]
            y_i[t] += scales[s, i] * (x[t] @ A[s, i, :r].T) @ B[s, slice i, :r].T   (skipped where s == -1)
            with dora, then: y_i[t] += dora[s, 0, slice i] * y_i[t] (+ dora[s, 1, slice i])   (DoRA's rescale)

    x: [T, in]; y: [T, out] split into slices of widths slice_sizes (default: one slice), or a list of
    outputs y_i [T, out_i] (q, k and v of one input); A: [S, n_slices, R_max, in]; B: [S, out, R_max]
    (store it as [S, R_max, out] and pass ``.transpose(1, 2)``: the expand then reads only the first r
    rows, fully coalesced); ranks int32 and scales float32 [S, n_slices]. The meta must be built for S slots.
    check=False: see lora_shrink (the layers' eager calls); options: how the kernels launch (``KernelOptions``).
    dora: float32 [S, 1 or 2, out] or None (``torch.ops.lorakit.expand``).
    """
    if 0 < x.shape[0] <= options.fused_max_tokens:
        _add_lora_fused(y, x, A, B, ranks, scales, meta, slice_sizes, check, options, dora)
        return
    lora_expand(y, lora_shrink(x, A, ranks, meta, check=check, options=options), B, ranks, scales, meta, slice_sizes,
                check=check, options=options, dora=dora)


def _add_lora_fused(y, x, A, B, ranks, scales, meta: LoraMeta, slice_sizes, check: bool, options: KernelOptions,
                    dora) -> None:
    """add_lora as ``torch.ops.lorakit.fused``: shrink and expand in one launch."""
    if check:
        _check_slot_count(meta, A, "A")
        _check_slot_count(meta, B, "B")
    outs = split_columns(y, slice_sizes) if isinstance(y, torch.Tensor) else list(y)
    pdl = "expand" in options.pdl
    if _direct(options, x, A, B, *outs):
        if check:
            _check_shrink_args(x, A, ranks, meta.token_slot, meta.token_order, meta.tiles, meta.block_m, 1)
        launch_fused(outs, x, A, B, ranks, scales, meta.token_order, meta.tiles, meta.block_m, pdl, dora=dora)
        return
    torch.ops.lorakit.fused(outs, x, A, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                            pdl, dora)
