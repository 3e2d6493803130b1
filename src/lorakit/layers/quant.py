"""Quantized base layers under LoRA: ``quantize(model, "fp8" | "int4")`` swaps a model's ``nn.Linear`` modules, in
place, for linear modules whose weight is stored quantized; ``patch`` then wraps them as it wraps any linear.

The LoRA delta does not change: it is computed in the model's dtype (bf16 on a GPU) from the same activations,
beside the quantized GEMM, and added to its output. So an adapter trained on the bf16 base (or with QLoRA on an
nf4 base) serves on an fp8 or int4 base with only the base's own quantization error.

Schemes (``SCHEMES``), both weight-only (the activations stay in the model's dtype; ``lorakit.ops.quant``):
- ``fp8``: e4m3 weights with one float32 scale per output channel. Half the bytes of bf16.
- ``int4``: 4-bit weights, asymmetric, a scale and a zero per group of 128 inputs (two codes a byte, one layout
  on every device). A quarter of the bytes of bf16, plus the scales and zeros.

Left in the model's dtype: the output head (the last layer, where quantization error goes straight into the logits,
as vLLM and torchao leave it by default), embeddings, and any layer whose shape a scheme cannot hold (named in the
log). A module that is a linear layer of another kind (a subclass with its own forward, GPT-2's Conv1D) is left
as it is too. Weights already quantized by a checkpoint are read as saved (``from_checkpoint``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lorakit.layers.sharded import ShardedLinear, is_vocab_parallel
from lorakit.ops.quant import (FP8, check_int4_shape, dequantize_fp8, dequantize_int4, fp8_linear, int4_linear,
                               quantize_fp8, quantize_int4)

logger = logging.getLogger("lorakit.quant")

SCHEMES = ("fp8", "int4")
INT4_GROUP_SIZE = 128


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized; ``in_features``, ``out_features`` and ``dtype`` (what it
    takes and returns) are those of the layer it replaces."""

    scheme: str

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.scale_tensor.device

    @property
    def scale_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in]: what a reference (PEFT on the dequantized base) uses."""
        raise NotImplementedError

    @classmethod
    def cat(cls, layers: Sequence[QuantizedLinear]) -> QuantizedLinear | None:
        """One layer over ``layers``' weights stacked along out_features (sibling projections fused into one
        GEMM; each member's tensors then become views of it), or None if they cannot be."""
        return None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, "
                f"dtype={str(self.compute_dtype).removeprefix('torch.')}, bias={self.bias is not None}")


class Fp8Linear(QuantizedLinear):
    """y = (x @ weight.T) * scale + bias, weight float8_e4m3fn [out, in], scale float32 [out] (per channel)."""

    scheme = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(weight.shape[1], weight.shape[0], dtype, bias)
        if weight.dtype != FP8 or scale.shape != (weight.shape[0],):
            raise ValueError(f"Fp8Linear takes a float8_e4m3fn weight [out, in] and a scale [out], got "
                             f"{weight.dtype} {tuple(weight.shape)} and {tuple(scale.shape)}")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, absmax: torch.Tensor | None = None) -> Fp8Linear:
        """``absmax``: each output channel's largest magnitude, where the layer is a part of a wider one (a
        row-parallel shard: the scales of the unsharded layer)."""
        w8, scale = quantize_fp8(linear.weight, absmax)
        return cls(w8, scale, linear.bias, linear.weight.dtype)

    @property
    def scale_tensor(self) -> torch.Tensor:
        return self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x.to(self.compute_dtype), self.weight, self.weight_scale, self.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    @classmethod
    def cat(cls, layers: Sequence[Fp8Linear]) -> Fp8Linear | None:
        if len({(m.compute_dtype, m.in_features, m.bias is None, m.weight.device) for m in layers}) != 1:
            return None
        with torch.no_grad():
            bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
            fused = cls(torch.cat([m.weight for m in layers]), torch.cat([m.weight_scale for m in layers]), bias,
                        layers[0].compute_dtype)
        lo = 0
        for m in layers:
            hi = lo + m.out_features
            m.weight = nn.Parameter(fused.weight[lo:hi], requires_grad=False)
            m.weight_scale = nn.Parameter(fused.weight_scale[lo:hi], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(fused.bias[lo:hi], requires_grad=False)
            lo = hi
        return fused


class Int4Linear(QuantizedLinear):
    """y = x @ W.T + bias with W[n, k] = code * scale[g, n] + zero[g, n] per group g of ``group_size`` inputs;
    ``weight`` uint8 [out, in / 2], two codes a byte (``lorakit.ops.quant.pack_int4_rows``), ``weight_scale`` and
    ``weight_zero`` [in / group_size, out] in the model's dtype."""

    scheme = "int4"

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(packed.shape[1] * 2, packed.shape[0], dtype, bias)
        if packed.dtype != torch.uint8 or scale.shape != (self.in_features // group_size, self.out_features) or \
                zero.shape != scale.shape:
            raise ValueError(f"Int4Linear takes a uint8 weight [out, in / 2] and a scale and zero [in / {group_size}, "
                             f"out], got {packed.dtype} {tuple(packed.shape)}, {tuple(scale.shape)} and "
                             f"{tuple(zero.shape)}")
        self.group_size = group_size
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.to(dtype), requires_grad=False)
        self.weight_zero = nn.Parameter(zero.to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> Int4Linear:
        packed, scale, zero = quantize_int4(linear.weight.detach(), group_size)
        return cls(packed, scale, zero, group_size, linear.bias, linear.weight.dtype)

    @property
    def scale_tensor(self) -> torch.Tensor:
        return self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a fused group's member holds column views of the group's scale and zero (see cat): the kernel takes strides
        return int4_linear(x.to(self.compute_dtype), self.weight, self.weight_scale, self.weight_zero,
                           self.group_size, self.bias)

    @classmethod
    def cat(cls, layers: Sequence[Int4Linear]) -> Int4Linear | None:
        if len({(m.compute_dtype, m.in_features, m.group_size, m.bias is None, m.weight.device)
                for m in layers}) != 1:
            return None
        with torch.no_grad():
            bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
            fused = cls(torch.cat([m.weight for m in layers]), torch.cat([m.weight_scale for m in layers], dim=1),
                        torch.cat([m.weight_zero for m in layers], dim=1), layers[0].group_size, bias,
                        layers[0].compute_dtype)
        lo = 0
        for m in layers:
            hi = lo + m.out_features
            m.weight = nn.Parameter(fused.weight[lo:hi], requires_grad=False)
            m.weight_scale = nn.Parameter(fused.weight_scale[:, lo:hi], requires_grad=False)
            m.weight_zero = nn.Parameter(fused.weight_zero[:, lo:hi], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(fused.bias[lo:hi], requires_grad=False)
            lo = hi
        return fused

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.weight, self.weight_scale, self.weight_zero, self.group_size, dtype)


FROM_LINEAR: dict[str, Callable[[nn.Linear], QuantizedLinear]] = {"fp8": Fp8Linear.from_linear,
                                                                  "int4": Int4Linear.from_linear}


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not supported; lorakit quantizes base weights as one of "
                         f"{list(SCHEMES)} (docs/patch.md, quantized bases)")
    return scheme


def why_not(module: nn.Module, scheme: str) -> str | None:
    """Why ``module`` keeps its dtype under ``scheme`` (None: it is quantized)."""
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__}, not a plain nn.Linear"
    if module.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"its weight is {module.weight.dtype}"
    if module.weight.device.type == "meta":
        return "its weight is on the meta device"
    return shape_reason(module.in_features, module.out_features, scheme)


def shape_reason(in_features: int, out_features: int, scheme: str) -> str | None:
    """Why a linear layer of this shape cannot be held by ``scheme`` (None: it can)."""
    if scheme == "fp8":
        return f"in_features {in_features} does not divide by 16" if in_features % 16 else None
    return check_int4_shape(in_features, out_features, INT4_GROUP_SIZE)


@torch.no_grad()
def quantize(model: nn.Module, scheme: str, filter_fn: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Swap ``model``'s linear layers for ``scheme``'s quantized ones, in place, on the device each weight is on
    (quantize before ``patch``: the LoRA wrappers then wrap the quantized layers). The output head and the
    layers ``filter_fn(module, name)`` rejects keep their dtype. Returns how many layers were quantized."""
    check_scheme(scheme)
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError("quantize the model before lorakit.patch: the LoRA wrappers must wrap the quantized layers")
    head = _output_head(model)
    kept: dict[str, str] = {}
    names = [(n, m) for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, ShardedLinear)) and m is not head and not is_vocab_parallel(m) and n]
    count = 0
    for name, module in names:
        if filter_fn is not None and not filter_fn(module, name):
            continue
        if isinstance(module, ShardedLinear):  # a tensor-parallel shard quantizes its own weight, in place
            reason = module.quantize(scheme)
            if reason is None:
                count += 1
            else:
                kept[name] = reason
            continue
        reason = why_not(module, scheme)
        if reason is not None:
            kept[name] = reason
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FROM_LINEAR[scheme](module))
        module.weight = None  # the full-precision weight is freed as soon as its quantized one exists
        count += 1
    if kept:
        logger.info("%s: %d linear layers keep their dtype: %s", scheme, len(kept),
                    "; ".join(f"{n} ({why})" for n, why in list(kept.items())[:4]) + (" ..." if len(kept) > 4 else ""))
    if not count:
        raise ValueError(f"quantize {scheme}: no linear layer of {type(model).__name__} can be quantized "
                         f"({next(iter(kept.values()), 'it has none besides the output head')})")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return count


def _output_head(model: nn.Module) -> nn.Module | None:
    try:
        return model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights: {"quantized": of the quantized layers (scales included), "other": the rest}."""
    quantized = {id(p) for m in model.modules() if isinstance(m, QuantizedLinear) for p in m.parameters()}
    out = {"quantized": 0, "other": 0}
    for p in model.parameters():
        out["quantized" if id(p) in quantized else "other"] += p.nbytes
    return out
