"""LoRA for linear layers: ``nn.Linear`` of any architecture (fused qkv / gate_up and the output head
included) and transformers' GPT-2 ``Conv1D``.

A module alone is a ``LoraLinear``. Sibling modules that read the same input (q/k/v, gate/up: found by
``patch`` from one traced forward) become ``LoraLinearMember``s of one ``LoraLinearGroup``: the first
member called runs every sibling's base layer on the input, then one shrink and one expand add all the
deltas; the others return their output from that. Base layers are called unchanged, unless the group's siblings
were fused (``LoraLinearGroup.fuse_base``, which the engine's runner does): then one GEMM over their weights, kept
in one buffer, gives every sibling's output as a column view of one result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.quant import QuantizedLinear
from lorakit.layers.sharded import ShardedLinear
from lorakit.layers.slots import LoraSlots
from lorakit.layers.tokens import TokenRows
from lorakit.ops import add_lora


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear-like module, None for anything else. For a tensor-parallel
    column or row layer (a ``ShardedLinear``, the vocab-parallel head included), the shape of this rank's shard: what
    its slots hold."""
    if isinstance(module, (ShardedLinear, QuantizedLinear, nn.Linear)):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return module.weight.shape[0], module.weight.shape[1]
    return None


def weight_rows(module: nn.Module) -> torch.Tensor:
    """A linear-like module's weight as [out, in] (GPT-2's Conv1D stores [in, out]; a quantized layer's, dequantized
    to float32): what DoRA's column norms are taken over."""
    if isinstance(module, QuantizedLinear):
        return module.dequantized_weight(torch.float32)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.T
    return module.weight


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a linear-like module takes and returns (a quantized layer's or shard's, not its weight's): its
    slots'."""
    return getattr(module, "compute_dtype", None) or module.weight.dtype


class _LinearSlots(LoraSlots):
    """Slots of n linear slices reading one input: A [S, n, R_max, in]."""

    def __init__(self, base_layers: Sequence[nn.Module], ctx: LoraContext, num_slots: int, rank_multiple: int):
        shapes = [linear_shape(m) for m in base_layers]
        weight = base_layers[0].weight
        super().__init__(num_slots, shapes[0][0], [out for _, out in shapes], compute_dtype(base_layers[0]),
                         weight.device, rank_multiple)
        self.ctx = ctx

    def _base(self, index: int) -> nn.Module:
        raise NotImplementedError

    def base_weight(self, index: int) -> torch.Tensor:
        return weight_rows(self._base(index))

    def base_bias(self, index: int) -> torch.Tensor | None:
        return getattr(self._base(index), "bias", None)

    def _empty_a(self, r_max, dtype, device):
        return torch.zeros(self.num_slots, len(self.out_sizes), r_max, self.in_features, dtype=dtype, device=device)

    def _weights(self, index: int | None):
        """A, B as [S, out, R_max], ranks and scales of every slice, or of slice ``index`` alone."""
        A, B, ranks, scales = self.lora_A, self.lora_B.transpose(1, 2), self.ranks, self.scales
        if index is None:
            return A, B, ranks, scales
        lo, hi = self.out_offsets[index], self.out_offsets[index + 1]
        return A[:, index: index + 1], B[:, lo:hi], ranks[:, index: index + 1], scales[:, index: index + 1]

    def with_delta(self, base: Callable[[], list[torch.Tensor]], x: torch.Tensor, meta,
                   index: int | None = None) -> list[torch.Tensor]:
        """The base layers' outputs ``base()`` plus the LoRA delta of each slice (all slices, or only ``index``),
        in place where dtypes allow."""
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        A, B, ranks, scales = self._weights(index)
        dora = self.dora_or_none(index)
        # check=False: the slots' buffers, the batch's meta, x2 made above
        return self.added(base(), lambda outs: add_lora(outs, x2, A, B, ranks, scales, meta, check=False,
                                                        options=self.ctx.kernels, dora=dora), dora is not None)

    def added(self, ys: list[torch.Tensor], add: Callable[[list[torch.Tensor]], None],
              whole: bool = False) -> list[torch.Tensor]:
        """``ys`` with ``add(outs)`` (an in-place LoRA add into 2-D outputs) applied: into ys themselves when they
        are in the slots' dtype, else into zeros of that dtype added to them; or, if ``add`` needs the ``whole``
        output (DoRA rescales it), into ys cast to the slots' dtype and back."""
        flat = [y.view(-1, y.shape[-1]) for y in ys]
        if all(y.dtype == self.dtype for y in ys):
            add(flat)
            return ys
        if whole:
            cast = [y.to(self.dtype) for y in flat]
            add(cast)
            return [c.view(y.shape).to(y.dtype) for y, c in zip(ys, cast)]
        deltas = [torch.zeros(y.shape, dtype=self.dtype, device=y.device) for y in flat]
        add(deltas)
        return [y + d.view(y.shape).to(y.dtype) for y, d in zip(ys, deltas)]


class LoraLinear(_LinearSlots):
    """y = base_layer(x) + scale[s] * (x @ A[s].T) @ B[s].T for each token's slot s."""

    def __init__(self, base_layer: nn.Module, ctx: LoraContext, num_slots: int, rank_multiple: int = 16):
        super().__init__([base_layer], ctx, num_slots, rank_multiple)
        self.base_layer = base_layer
        self.tokens: TokenRows | None = None  # per-slot token rows, on the model's output head (see patch)
        self.softcap: float | None = None  # the head of a soft-capped model: the cap, applied here (see patch)

    def _base(self, index: int) -> nn.Module:
        return self.base_layer

    # Code that reads the wrapped module's parameters (tied weights, get_output_embeddings) still works.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def out_features(self) -> int:
        return self.out_sizes[0]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self._forward(x, *args, **kwargs)
        if self.softcap is None:
            return y
        # as the model's own soft cap computes it, and after it the ids a row may not take stay -inf (a cap of
        # -inf is -cap: a small probability for another adapter's added tokens)
        return torch.where(torch.isneginf(y), y, torch.tanh(y / self.softcap) * self.softcap)

    def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = self.tokens if self.tokens is not None and self.tokens.k_max else None
        meta = self.ctx.meta_for(x.shape[:-1]) if self.r_max or rows is not None else None
        if meta is None:
            return self.base_layer(x, *args, **kwargs)
        if self.r_max:
            y = self.with_delta(lambda: [self._local(x, *args, **kwargs)], x, meta)[0]
        else:
            y = self._local(x, *args, **kwargs)
        y = self._gather(y)
        if rows is not None:  # the head: each row's adapter's token logits (and its added tokens' columns)
            out = rows.logits(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), meta.token_slot)
            y = out.view(*y.shape[:-1], out.shape[-1])
        return y


    # The base layer's output the slots add to, and how it becomes the module's output: the same here; the
    # vocab-parallel head's local logits, then gathered (lorakit.parallel.lora).
    def _local(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.base_layer(x, *args, **kwargs)

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        return y


class LoraLinearGroup(_LinearSlots):
    """The shared slots of sibling linear modules; slice i belongs to member i."""

    def __init__(self, base_layers: Sequence[nn.Module], ctx: LoraContext, num_slots: int, rank_multiple: int = 16):
        super().__init__(base_layers, ctx, num_slots, rank_multiple)
        self.members: list[LoraLinearMember] = []  # a plain list: the members live in the model tree
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] | None = None
        # every sibling's weight and bias, or one quantized layer over them all (fuse_base)
        self._fused: tuple[torch.Tensor, torch.Tensor | None] | QuantizedLinear | None = None
        ctx.on_reset(self.reset)

    def _base(self, index: int) -> nn.Module:
        return self.members[index].base_layer

    def reset(self) -> None:
        self._input, self._outputs = None, None

    def fuse_base(self) -> bool:
        """Put the siblings' weights (and biases) into one buffer, each member's parameter a view of its rows, so that
        ``outputs`` runs one GEMM for all of them instead of one each: at decode, the small k and v GEMMs of GQA cost
        a launch and a split-K reduction each. The values do not change, and a member called alone still runs its own
        base layer. Only plain ``nn.Linear`` siblings of one dtype and device, all with or all without a bias, or
        quantized siblings of one scheme (``QuantizedLinear.cat``); for a model that stays where it is
        (``Module.to`` would copy the views apart and leave the buffer behind: the engine's runner, which owns its
        model, fuses). Returns whether the group is fused."""
        if self._fused is not None:
            return True
        layers = [member.base_layer for member in self.members]
        first = layers[0].weight
        if isinstance(layers[0], QuantizedLinear) and all(type(m) is type(layers[0]) for m in layers):
            fused = type(layers[0]).cat(layers)
            if fused is not None:  # not a submodule: its tensors are the members' (views), counted there
                object.__setattr__(self, "_fused", fused)
            return fused is not None
        if (any(type(m) is not nn.Linear for m in layers) or first.device.type == "meta"
                or any(m.weight.dtype != first.dtype or m.weight.device != first.device for m in layers)
                or len({m.bias is None for m in layers}) != 1):
            return False
        with torch.no_grad():
            weight = torch.cat([m.weight for m in layers])
            bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
        for m, lo, hi in zip(layers, self.out_offsets, self.out_offsets[1:]):
            m.weight = nn.Parameter(weight[lo:hi], requires_grad=m.weight.requires_grad)
            if bias is not None:
                m.bias = nn.Parameter(bias[lo:hi], requires_grad=m.bias.requires_grad)
        self._fused = weight, bias
        return True

    def outputs(self, x: torch.Tensor, meta) -> list[torch.Tensor]:
        """Every member's output for input x: base layers (or the fused GEMM), then (given a meta) one shrink and one
        expand for all."""
        if self._input is not x:
            if self._fused is None:
                base = lambda: [member.base_layer(x) for member in self.members]  # noqa: E731
            elif isinstance(self._fused, QuantizedLinear):
                base = lambda: list(self._fused(x).split(self.out_sizes, dim=-1))  # noqa: E731
            else:
                base = lambda: list(F.linear(x, *self._fused).split(self.out_sizes, dim=-1))  # noqa: E731
            outputs = base() if meta is None else self.with_delta(base, x, meta)
            self._input, self._outputs = x, outputs
        return self._outputs


class LoraLinearMember(nn.Module):
    """One sibling of a LoraLinearGroup: the original module stays as ``base_layer``."""

    def __init__(self, base_layer: nn.Module, group: LoraLinearGroup, index: int):
        super().__init__()
        self.base_layer = base_layer
        self.index = index
        object.__setattr__(self, "group", group)  # not a submodule: the group is registered once, on the parent
        group.members.append(self)

    weight = LoraLinear.weight
    bias = LoraLinear.bias

    @property
    def r_max(self) -> int:
        return self.group.r_max

    @property
    def in_features(self) -> int:
        return self.group.in_features

    @property
    def out_features(self) -> int:
        return self.group.out_sizes[self.index]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        group = self.group
        meta = group.ctx.meta_for(x.shape[:-1]) if group.r_max else None
        if args or kwargs:  # called differently from its siblings: on its own
            if meta is None:
                return self.base_layer(x, *args, **kwargs)
            return group.with_delta(lambda: [self.base_layer(x, *args, **kwargs)], x, meta, self.index)[0]
        if meta is None and group._fused is None:
            return self.base_layer(x)
        return group.outputs(x, meta)[self.index]
