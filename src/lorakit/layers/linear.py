"""LoRA for linear layers: ``nn.Linear`` of any architecture (fused qkv / gate_up and the output head
included) and transformers' GPT-2 ``Conv1D``. The base layer is called unchanged; the delta of every
token's adapter is added into its output through ``lorakit.ops.add_lora``."""

from __future__ import annotations

import torch
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.slots import LoraSlots
from lorakit.ops import add_lora


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear-like module, None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return module.weight.shape[0], module.weight.shape[1]
    return None


class LoraLinear(LoraSlots):
    """y = base_layer(x) + scale[s] * (x @ A[s].T) @ B[s].T for each token's slot s."""

    def __init__(self, base_layer: nn.Module, ctx: LoraContext, num_slots: int, rank_multiple: int = 16):
        in_features, out_features = linear_shape(base_layer)
        weight = base_layer.weight
        super().__init__(num_slots, in_features, out_features, weight.dtype, weight.device, rank_multiple)
        self.base_layer = base_layer
        self.ctx = ctx

    def _empty_a(self, r_max, dtype, device):
        return torch.zeros(self.num_slots, 1, r_max, self.in_features, dtype=dtype, device=device)

    def _a_view(self, a, slot, rank):
        return a[slot, 0, :rank]

    # Code that reads the wrapped module's parameters (tied weights, get_output_embeddings) still works.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        if self.r_max == 0:
            return y
        meta = self.ctx.meta_for(x.shape[:-1])
        if meta is None:
            return y
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y2 = y.view(-1, self.out_features)
        if y2.dtype == self.dtype:
            add_lora(y2, x2, self.lora_A, self.lora_B.transpose(1, 2), self.ranks, self.scales, meta)
            return y
        delta = torch.zeros(y2.shape, dtype=self.dtype, device=y2.device)
        add_lora(delta, x2, self.lora_A, self.lora_B.transpose(1, 2), self.ranks, self.scales, meta)
        return y + delta.view(y.shape).to(y.dtype)
