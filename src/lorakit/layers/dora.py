"""DoRA's rescale, computed once per adapter and slot: ``gain = m / ||W + scale B A||`` per output column.

At inference a DoRA layer is ``y = b + gain * (W x + scale B A x)`` (PEFT's ``DoraLinearLayer``: the norm
detached, so a constant of the adapter), with ``m`` the adapter's learned magnitudes and the norm taken over each
output's row of the adapted weight. The kernels add the LoRA delta and then apply ``v + (gain - 1) * v - (gain - 1)
* b`` in the same pass (``torch.ops.lorakit.expand``'s ``dora``), so a slot stores ``gain - 1`` and, for a layer
with a bias, ``-(gain - 1) * b``: zeros are plain LoRA. Embeddings as PEFT's ``DoraEmbeddingLayer``: the norm of
each embedding dimension over the vocabulary, no bias.

The norms are computed on the base weight's device, in float32, from the slot's A and B as the kernels read them,
a block of rows at a time (a bf16 weight of 14336 x 4096 is never widened whole): per block, W widened, one
``addmm`` adds ``scale B A``, one reduction takes the norms.
"""

from __future__ import annotations

import torch

from lorakit.layers.slots import LoraSlots

BLOCK_ELEMENTS = 1 << 24  # elements of W widened to float32 at a time (64 MB)


@torch.no_grad()
def write_gain(store: LoraSlots, slot: int, index: int, rank: int, scale: float, magnitude: torch.Tensor,
               embedding: bool) -> None:
    """Fill ``store.dora[slot]`` for slice ``index`` from the slot's A and B (already written) and the adapter's
    magnitudes (float32, [out_i]; an embedding's [dim]), on the store's device and current stream."""
    lo, hi = store.out_offsets[index], store.out_offsets[index + 1]
    weight = store.base_weight(index)
    B = store.lora_B[slot, :rank, lo:hi].float()  # [rank, out_i]
    rows = max(1, BLOCK_ELEMENTS // weight.shape[1])
    if embedding:  # W [vocab, dim]; A [vocab, rank]: the norm of each dimension over the vocabulary
        A = store.lora_A[slot, :, :rank].float()
        squares = torch.zeros(hi - lo, dtype=torch.float32, device=B.device)
        for r0 in range(0, weight.shape[0], rows):
            block = torch.addmm(weight[r0: r0 + rows].float(), A[r0: r0 + rows], B, alpha=scale)
            squares += block.square().sum(0)
        norm = squares.sqrt()
    else:  # W [out, in]; A [rank, in]: the norm of each output's row
        A, Bt = store.lora_A[slot, index, :rank].float(), B.T
        norm = torch.cat([torch.linalg.vector_norm(torch.addmm(weight[r0: r0 + rows].float(), Bt[r0: r0 + rows], A,
                                                               alpha=scale), dim=1)
                          for r0 in range(0, hi - lo, rows)])
    gain = magnitude.to(norm.device) / norm - 1.0
    store.dora[slot, 0, lo:hi] = gain
    if store.dora_rows == 2:
        bias = store.base_bias(index)
        store.dora[slot, 1, lo:hi] = 0.0 if bias is None else -gain * bias.float()
