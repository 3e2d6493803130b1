"""LoRA on tensor-parallel layers (``lorakit.parallel.shard_model``), the S-LoRA way.

Column-parallel layers (q/k/v, gate/up) need nothing special: their slots hold A whole and this rank's rows of B,
so the ordinary ``LoraLinear`` / ``LoraLinearGroup`` adds the delta of this rank's output slice, no collective.
Row-parallel layers (o, down) get ``LoraRowParallelLinear``: their slots hold this rank's columns of A and all of
B. The vocab-parallel head gets ``LoraVocabParallelHead`` (B split with the vocabulary, the delta added before the
gather); the vocab-parallel embedding's ``LoraEmbedding`` holds A's rows of this rank's vocabulary and all-reduces
the lookup's h (see layers/embedding.py). Token rows (a few per adapter, by global id) are whole on every rank. An
adapter that saves whole matrices of them is refused (``lorakit.layers.sharded.check_vocab_parallel``).

``patch`` finds these wrappers through the sharded base layers themselves (``ShardedLayer.lora_wrapper``, set in
``lorakit.parallel.tensor``), and the cut of each adapter through their ``lora_shard``: ``layers`` imports nothing
from here.

Every rank must load the same adapters into the same slots and run the same batches (same ``lora_ids``): the row
layers' extra all-reduce runs only when a LoRA is active, and the ranks must agree on when that is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lorakit.layers.linear import LoraLinear
from lorakit.ops import lora_expand, lora_shrink


class LoraRowParallelLinear(LoraLinear):
    """LoRA on a ``RowParallelLinear`` (o_proj, down_proj): A_local = A[:, this rank's input columns], B whole.

    y = base(x_local) + scale * all_reduce(x_local @ A_local.T) @ B.T

    The base layer's forward already all-reduces its partial output and adds the bias, so every rank holds the
    full y. The shrink's partial h_k = x_local @ A_local.T (T x R_max, float32) is summed over the ranks, which
    gives h = x @ A.T exactly; every rank then runs the same expand with the full h and adds it to its own copy of
    y. So the delta is added once to each rank's (identical) output, never summed over ranks. Cost: one extra
    all-reduce of n_tokens x R_max floats per row layer, and only in a forward where a LoRA is active.

    (Folding the delta into the partial output before the base all-reduce instead would need a hook inside the
    base layer's forward; adding each rank's expand of its own partial h there would even save the extra
    all-reduce, by linearity, at the same FLOPs. Not done: this wrapper leaves the base layer untouched.)
    """

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        meta = self.ctx.meta_for(x.shape[:-1]) if self.r_max else None
        y = self.base_layer(x, *args, **kwargs)
        if meta is None:
            return y
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        kernels = self.ctx.kernels
        # the split_k partials, summed
        h = lora_shrink(x2, self.lora_A, self.ranks, meta, check=False, options=kernels).sum(0, keepdim=True)
        base = self.base_layer
        if base.world_size > 1:
            dist.all_reduce(h, group=base.group)
        B = self.lora_B.transpose(1, 2)
        (y,) = self.added([y], lambda outs: lora_expand(outs, h, B, self.ranks, self.scales, meta, check=False,
                                                        options=kernels))
        return y


class LoraVocabParallelHead(LoraLinear):
    """LoRA on a ``VocabParallelHead``: B = this rank's vocabulary rows, A whole, like a column layer.

    logits = gather(x @ W_local.T + scale * (x @ A.T) @ B_local.T)

    The delta is added to this rank's local logits before the base layer's all-gather, so it needs no collective of
    its own; the adapters' token rows (trainable and added tokens) then apply to the gathered logits, kept whole on
    every rank (a few rows each, by global id).
    """

    def _local(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.base_layer.local(x, *args, **kwargs)

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        return self.base_layer.gather(y)
