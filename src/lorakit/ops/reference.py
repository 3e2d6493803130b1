"""References for lorakit's ops, in float64: the ground truth for tests and benchmarks.

Slow on purpose and written apart from the ops' CPU paths: the LoRA references take one token and one slice
at a time, exactly as the semantics read (``lora_ref_by_slot``, for large shapes, computes every slot's delta
on every token and keeps it where the token uses that slot); the attention reference gathers each sequence's
keys position by position through its block table and masks by position.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def shrink_ref(x: torch.Tensor, A: torch.Tensor, ranks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h[i, t, :r] = x[t] @ A[s, i, :r].T with s = slots[t], r = ranks[s, i]; zero elsewhere.

    x: [T, in]; A: [S, n_slices, R_max, in]; ranks: [S, n_slices]; slots: [T]. Returns float64
    [n_slices, T, R_max].
    """
    num_tokens = x.shape[0]
    _, n_slices, r_max, _ = A.shape
    h = torch.zeros(n_slices, num_tokens, r_max, dtype=torch.float64)
    for t in range(num_tokens):
        s = int(slots[t])
        if s < 0:
            continue
        for i in range(n_slices):
            r = int(ranks[s, i])
            h[i, t, :r] = x[t].double().cpu() @ A[s, i, :r].double().cpu().T
    return h


def expand_ref(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
    dora: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t, slice i] + scales[s, i] * h[i, t, :r] @ B[s, slice i, :r].T, in float64; y is not modified.
    With ``dora`` ([S, 1 or 2, sum(slice_sizes)]), that sum v becomes v + dora[s, 0] * v (+ dora[s, 1]) where r > 0.

    y: [T, sum(slice_sizes)]; h: [n_slices, T, R_max]; B: [S, sum(slice_sizes), R_max].
    """
    out = y.double().cpu().clone()
    offsets = [0, *itertools.accumulate(slice_sizes)]
    for t in range(y.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        for i in range(len(slice_sizes)):
            r = int(ranks[s, i])
            lo, hi = offsets[i], offsets[i + 1]
            if r == 0:
                continue
            b = B[s, lo:hi, :r].double().cpu()
            out[t, lo:hi] += float(scales[s, i]) * (h[i, t, :r].double().cpu() @ b.T)
            if dora is not None:
                d = dora[s].double().cpu()
                out[t, lo:hi] += d[0, lo:hi] * out[t, lo:hi] + (d[1, lo:hi] if d.shape[0] == 2 else 0.0)
    return out


def lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
    dora: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole delta: y[t] + scale[s] * (x[t] @ A[s].T) @ B[s].T per slice, in float64 (then DoRA's rescale, as
    ``expand_ref``)."""
    return expand_ref(y, shrink_ref(x, A, ranks, slots), B, ranks, scales, slots, slice_sizes, dora)


def lora_ref_by_slot(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """``lora_ref`` for large shapes, on the inputs' device, in float64: every slot's delta computed for every
    token, kept on the tokens of that slot (y + sum over s of [slots[t] == s] * delta_s[t]; no per-token loop)."""
    out = y.double().clone()
    x = x.double()
    offsets = [0, *itertools.accumulate(slice_sizes)]
    for s in range(A.shape[0]):
        mine = (slots == s)[:, None]
        for i in range(len(slice_sizes)):
            r = int(ranks[s, i])
            lo, hi = offsets[i], offsets[i + 1]
            delta = float(scales[s, i]) * (x @ A[s, i, :r].double().T) @ B[s, lo:hi, :r].double().T
            out[:, lo:hi] += torch.where(mine, delta, 0.0)
    return out


def attention_ref(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap=0.0, window=0,
                  row_chunk: int = 512) -> torch.Tensor:
    """``paged_attention`` in float64: per sequence, K and V gathered position by position through the block
    table, an explicit mask from positions (causal, sliding window), softmax over the visible keys; zero where
    none is. Rows are taken ``row_chunk`` at a time (long prefills)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n = hi - lo
        if n == 0 or L == 0:
            continue
        key_pos = torch.arange(L, device=query.device)
        blocks = block_tables[s, key_pos // block_size].long()
        K = k_cache[blocks, key_pos % block_size].double()  # [L, Hkv, D]
        V = v_cache[blocks, key_pos % block_size].double()
        for r0 in range(0, n, row_chunk):
            r1 = min(n, r0 + row_chunk)
            q_pos = (L - n + torch.arange(r0, r1, device=query.device))[:, None]
            visible = key_pos[None, :] <= q_pos
            if window > 0:
                visible &= key_pos[None, :] > q_pos - window
            q = query[lo + r0:lo + r1].double().view(r1 - r0, num_kv_heads, group, head_dim)
            x = torch.einsum("nkgd,lkd->kgnl", q, K) * scale
            if softcap > 0:
                x = softcap * torch.tanh(x / softcap)
            w = torch.softmax(x.masked_fill(~visible, float("-inf")), dim=-1)
            w = torch.where(visible.any(dim=-1, keepdim=True), w, 0.0)
            out[lo + r0:lo + r1] = torch.einsum("kgnl,lkd->nkgd", w, V).reshape(r1 - r0, num_heads, head_dim)
    return out


def _per_key(A, B, ranks, scales, slots, experts):
    """Expert LoRA's weights as LoRA's of one slot per (slot, expert), keyed s * E + e (-1 where the slot is)."""
    S, E = ranks.shape
    keys = torch.where(slots >= 0, slots.long() * E + experts.long(), -1)
    return (A.reshape(S * E, 1, *A.shape[2:]), B.reshape(S * E, *B.shape[2:]), ranks.reshape(S * E, 1),
            scales.reshape(S * E, 1), keys)


def expert_lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """``expert_lora`` in float64, one (token, expert) row at a time: y[p] + scales[s, e] * (x[p] @ A[s, e, :r].T)
    @ B[s, e, :, :r].T with s = slots[p], e = experts[p], r = ranks[s, e]; rows of slot -1 unchanged (``lora_ref``
    with one slot per (slot, expert)).

    x: [P, in]; y: [P, out]; A: [S, E, R_max, in]; B: [S, E, out, R_max]; ranks, scales: [S, E]; slots, experts: [P].
    y is not modified."""
    return lora_ref(y, x, *_per_key(A, B, ranks, scales, slots, experts), [y.shape[1]])


def moe_experts_ref(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    slots: torch.Tensor,
    weights: dict,
    loras: dict,
    act,
) -> torch.Tensor:
    """A gated MoE experts layer with expert LoRA, in float64, token by token: for each token t and its k-th expert
    e, ``gu = x[t] @ W_gate_up[e].T + delta``, ``a = act(gate) * up`` (the halves of gu), ``d = a @ W_down[e].T +
    delta``, summed with the routing weights. ``weights``: {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]};
    ``loras``: {param: (A [S, E, R, in], B [S, E, out, R], ranks [S, E], scales [S, E])} for the adapted params;
    slots [T] (-1: no delta)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        s = int(slots[t])
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            h = x[t].double().cpu()
            for name in ("gate_up_proj", "down_proj"):
                y = h @ weights[name][e].double().cpu().T
                if s >= 0 and name in loras:
                    A, B, ranks, scales = loras[name]
                    r = int(ranks[s, e])
                    y = y + float(scales[s, e]) * ((h @ A[s, e, :r].double().cpu().T) @ B[s, e, :, :r].double().cpu().T)
                if name == "gate_up_proj":
                    gate, up = y.chunk(2)
                    y = act(gate) * up
                h = y
            out[t] += float(top_k_weights[t, k]) * h
    return out


def expert_lora_ref_by_key(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """``expert_lora_ref`` for large shapes, on the inputs' device, in float64 (``lora_ref_by_slot`` with one slot
    per (slot, expert): no per-row loop)."""
    return lora_ref_by_slot(y, x, *_per_key(A, B, ranks, scales, slots, experts), [y.shape[1]])
