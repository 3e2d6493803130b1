"""LoRA for token embeddings (``nn.Embedding`` and subclasses such as Gemma's scaled embedding).

The shrink of an embedding is a lookup: h[t] = A[s][:, token t]. A is kept as [S, num_embeddings, R_max]
so that lookup is one gather; the expand goes through ``torch.ops.lorakit.expand``. Like PEFT, the delta
is multiplied by the base layer's ``embed_scale`` where it has one (and a DoRA slot's rescale, per embedding
dimension, multiplies the whole output). On a vocab-parallel embedding (tensor
parallelism) the slots hold A's rows of this rank's vocabulary: the lookup's h is all-reduced (T x R_max), and
every rank adds the same delta to the base layer's whole, all-reduced output. Token rows are kept whole (they
replace a few rows by global id).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.slots import LoraSlots
from lorakit.layers.tokens import TokenRows
from lorakit.ops import lora_expand


def vocab_size(embedding: nn.Module) -> int:
    """Token ids an embedding takes: a vocab-parallel one's (lorakit.parallel) whole vocabulary, not its shard's."""
    return getattr(embedding, "full_num_embeddings", None) or embedding.num_embeddings


class LoraEmbedding(LoraSlots):
    def __init__(self, base_layer: nn.Embedding, ctx: LoraContext, num_slots: int, rank_multiple: int = 16):
        weight = base_layer.weight
        super().__init__(num_slots, base_layer.num_embeddings, [base_layer.embedding_dim], weight.dtype, weight.device,
                         rank_multiple)
        self.vocab = vocab_size(base_layer)  # a vocab-parallel table's whole vocabulary; its slots hold its rows
        self.base_layer = base_layer
        self.ctx = ctx
        self.tokens: TokenRows | None = None  # per-slot token rows, on the model's input embedding (see patch)

    def _empty_a(self, r_max, dtype, device):
        return torch.zeros(self.num_slots, self.in_features, r_max, dtype=dtype, device=device)

    @property
    def out_features(self) -> int:
        return self.out_sizes[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def base_weight(self, index: int) -> torch.Tensor:
        return self.base_layer.weight

    def embed_scale(self) -> float:
        """The factor the base layer applies to its output (1.0 for a plain nn.Embedding)."""
        scale = getattr(self.base_layer, "embed_scale", None)
        if scale is None:
            return 1.0
        return float(scale) if not isinstance(scale, torch.Tensor) or scale.numel() == 1 else 1.0

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = self.tokens if self.tokens is not None and self.tokens.k_max else None
        ids = input_ids
        if rows is not None and rows.added:  # ids past the base vocabulary have no base row: look up a stand-in
            ids = input_ids.clamp(max=self.vocab - 1)
        y = self.base_layer(ids, *args, **kwargs)
        if self.r_max == 0 and rows is None:
            return y
        meta = self.ctx.meta_for(input_ids.shape)
        if meta is None:
            return y
        y2 = y.view(-1, self.out_features)
        if self.r_max:
            slots = meta.token_slot.long().clamp(min=0)  # base tokens gather slot 0's row; expand skips them
            h = self._lookup(slots, ids.reshape(-1))[None, None]  # [1, 1, T, R_max]
            lora_expand(y2, h, self.lora_B.transpose(1, 2), self.ranks, self.scales, meta, options=self.ctx.kernels,
                        dora=self.dora_or_none())
        if rows is not None:
            y2 = rows.embed(y2, input_ids.reshape(-1), meta.token_slot, self.embed_scale())
        return y2.view(y.shape)

    def _lookup(self, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [T, R_max] float32: each token's row of its slot's A. A vocab-parallel table's slots hold A's rows of
        its own vocabulary: the others look up zeros, and the all-reduce fills them in (one rank holds each row, so
        the sum is exact)."""
        base = self.base_layer
        if getattr(base, "world_size", 1) == 1:
            return self.lora_A[slots, ids].float()
        local = ids - base.vocab_start
        outside = (local < 0) | (local >= self.in_features)
        h = self.lora_A[slots, local.clamp(0, self.in_features - 1)].float().masked_fill(outside[:, None], 0.0)
        dist.all_reduce(h, group=base.group)
        return h
