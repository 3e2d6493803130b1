"""LoRA on tensor-parallel layers (``lorakit.parallel.shard_model``), the S-LoRA way.

Column-parallel layers (q/k/v, gate/up) need nothing special: their slots hold A whole and this rank's rows of B,
so the ordinary ``LoraLinear`` / ``LoraLinearGroup`` adds the delta of this rank's output slice, no collective.
Row-parallel layers (o, down) get ``LoraRowParallelLinear``: their slots hold this rank's columns of A and all of
B. The vocab-parallel head gets ``LoraVocabParallelHead`` (B split with the vocabulary, the delta added before the
gather); the vocab-parallel embedding's ``LoraEmbedding`` holds A's rows of this rank's vocabulary and all-reduces
the lookup's h (see layers/embedding.py). Token rows (a few per adapter, by global id) are whole on every rank. An
adapter that saves whole matrices of them is refused (``check_vocab_parallel``).

Every rank must load the same adapters into the same slots and run the same batches (same ``lora_ids``): the row
layers' extra all-reduce runs only when a LoRA is active, and the ranks must agree on when that is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from lorakit.layers.adapter import AdapterError, ModuleLora
from lorakit.layers.adapter_config import read_adapter_config
from lorakit.layers.adapter_targets import token_targets
from lorakit.layers.linear import LoraLinear
from lorakit.ops import lora_expand, lora_shrink
from lorakit.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead


def is_vocab_parallel(module: nn.Module) -> bool:
    return isinstance(module, (VocabParallelEmbedding, VocabParallelHead))


def _sharded(module: nn.Module | None) -> bool:
    """A tensor-parallel layer, whose slots hold this rank's shard of each adapter."""
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))


def full_features(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) an adapter's A and B are shaped for: the unsharded layer's for a parallel one."""
    base = getattr(layer, "base_layer", None)
    return base.full_features if _sharded(base) else (layer.in_features, layer.out_features)


def shard_lora(layer: nn.Module, lora: ModuleLora) -> ModuleLora:
    """The part of a module's LoRA that this rank's slots hold (``lora`` itself for an unsharded layer)."""
    base = getattr(layer, "base_layer", None)
    if not _sharded(base):
        return lora
    A, B = base.lora_shard(lora.A, lora.B)
    return ModuleLora(A.contiguous(), B.contiguous(), lora.rank, lora.scale)


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


def check_vocab_parallel(name: str, path, base_modules: Mapping, vocab_parallel: Mapping, tied: bool) -> None:
    """Refuse an adapter that saves a whole matrix (modules_to_save, or the resized embedding / head of a grown
    vocabulary) of a vocab-parallel embedding or head, from its config alone: its rows are kept only where they
    differ from the model's weight, which no rank holds whole. LoRA and trainable tokens there are served.
    ``vocab_parallel``: {module name: BaseModule of the unsharded layer}."""
    if not vocab_parallel:
        return
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    hit = sorted(token_targets(config, base_modules, tied, where).full & vocab_parallel.keys())
    if hit:
        raise AdapterError(f"{where}: it saves whole matrices of {hit} (modules_to_save or a resized vocabulary), "
                           f"which tensor parallelism splits by vocabulary; lorakit serves LoRA and "
                           f"trainable_token_indices there, not whole matrices: serve this adapter on an unsharded "
                           f"model, or retrain it with trainable_token_indices instead")
