"""LoRA on the stacked experts of transformers' MoE blocks (``MixtralExperts``, ``Qwen3MoeExperts``, ...: the
``gate_up_proj`` / ``up_proj`` and ``down_proj`` parameters [E, out, in], forward(hidden, top_k_index, top_k_weights)).

The router is untouched: the experts wrapper gets the routing the block computed. Without adapters (no ids, or no
adapter targets its parameters) it calls ``base_layer`` unchanged. With them it computes the experts as
transformers' ``grouped_mm`` implementation does (the (token, expert) pairs sorted by expert, one grouped GEMM per
parameter, the routing-weighted sum), with no data-dependent control flow so it compiles whole and replays in a CUDA
graph, and adds to each pair's projections the LoRA delta of its token's slot and its expert
(``lorakit.ops.add_expert_lora``), as PEFT's ``ParamWrapper`` adds ``scale * B_e @ A_e`` to expert e's weight.
Each targeted parameter's slots are an ``ExpertSlots`` store, padded to a max rank that grows like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.slots import LoraSlots
from lorakit.ops import add_expert_lora, expert_keys
from lorakit.peft import BaseModule

_UP_NAMES = ("gate_up_proj", "up_proj")  # gated experts (act(gate) * up) or plain ones (act(up))


def expert_params(module: nn.Module) -> tuple[str, str] | None:
    """(up parameter, down parameter) names of a stacked-experts module, None for any other module: 3-D
    parameters of one expert count with an ``act_fn`` (or a gate of their own, ``_apply_gate``), as transformers'
    experts classes have them."""
    up = next((n for n in _UP_NAMES if isinstance(getattr(module, n, None), nn.Parameter)), None)
    down = getattr(module, "down_proj", None)
    # a gated module's gate: its act_fn, or a gate of its own (gpt-oss: _apply_gate, no act_fn)
    activation = hasattr(module, "act_fn") or (up == "gate_up_proj" and hasattr(module, "_apply_gate"))
    if up is None or not isinstance(down, nn.Parameter) or not activation:
        return None
    w = getattr(module, up)
    if w.dim() != 3 or down.dim() != 3 or w.shape[0] != down.shape[0]:
        return None
    return up, "down_proj"


def unsupported_experts(module: nn.Module) -> str | None:
    """Why lorakit does not wrap a stacked-experts module, or None."""
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts (the routing holds sentinels for other ranks' experts)"
    return None


class ExpertSlots(LoraSlots):
    """The slots of one stacked parameter of E experts (in -> out each): A [S, E, R_max, in], B stored as
    [S, R_max, E * out] (expert e's columns e * out ..), ranks and scales [S, E]. To the slot writer it is a store of
    E slices, one per expert."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, num_slots: int, rank_multiple: int):
        super().__init__(num_slots, in_features, [out_features] * num_experts, dtype, device, rank_multiple)

    def _empty_a(self, r_max, dtype, device):
        return torch.zeros(self.num_slots, len(self.out_sizes), r_max, self.in_features, dtype=dtype, device=device)

    @property
    def num_experts(self) -> int:
        return len(self.out_sizes)

    @property
    def out_features(self) -> int:
        return self.out_sizes[0]

    def base_module(self) -> BaseModule:
        """How an adapter sees the parameter (checked against PEFT's lora_A [r * E, in] and lora_B [out, r * E])."""
        return BaseModule("experts", self.in_features, self.out_features, None, self.num_experts)

    def add(self, y: torch.Tensor, x: torch.Tensor, meta, options) -> None:
        """y[p] += the delta of pair p's (slot, expert), in place (meta from ``expert_keys``)."""
        S, R, E = self.num_slots, self.r_max, self.num_experts
        B = self.lora_B.view(S, R, E, self.out_features).permute(0, 2, 3, 1)  # [S, E, out, R], no copy
        add_expert_lora(y, x, self.lora_A, B, self.ranks, self.scales, meta, check=False, options=options)


class LoraExperts(nn.Module):
    """A stacked-experts module with per-slot expert LoRA on its up (gate_up) and down parameters."""

    def __init__(self, base_layer: nn.Module, ctx: LoraContext, num_slots: int, rank_multiple: int = 16):
        super().__init__()
        names = expert_params(base_layer)
        if names is None:
            raise TypeError(f"not a stacked-experts module: {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.ctx = ctx
        self.up_name, self.down_name = names
        self.transposed = bool(getattr(base_layer, "is_transposed", False))  # weights [E, in, out]
        self.has_bias = bool(getattr(base_layer, "has_bias", False))
        self.num_experts = getattr(base_layer, self.up_name).shape[0]
        stores = {}
        for name in names:
            w = getattr(base_layer, name)
            in_f, out_f = (w.shape[1], w.shape[2]) if self.transposed else (w.shape[2], w.shape[1])
            stores[name] = ExpertSlots(self.num_experts, in_f, out_f, w.dtype, w.device, num_slots, rank_multiple)
        self.slots = nn.ModuleDict(stores)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ids = self.ctx.ids
        if ids is None or not any(s.r_max for s in self.slots.values()):
            return self.base_layer(hidden_states, top_k_index, top_k_weights)
        num_tokens, hidden = hidden_states.shape
        token_slot = self.ctx.meta_for(hidden_states.shape[:-1]).token_slot  # the block flattened [batch, seq]
        top_k = top_k_index.shape[-1]

        # The pairs sorted by expert, as transformers' grouped_mm experts do; the LoRA rows are grouped by key.
        experts, perm = torch.sort(top_k_index.reshape(-1))
        x = hidden_states[perm // top_k]
        meta = expert_keys(token_slot.repeat_interleave(top_k)[perm], experts, self.slots[self.up_name].num_slots,
                           self.num_experts)
        offsets = self._offsets(experts, x)
        base = self.base_layer
        y = self._project(self.up_name, x, experts, offsets, meta)
        if self.up_name == "gate_up_proj":
            y = base._apply_gate(y) if hasattr(base, "_apply_gate") else _gate(base.act_fn, y)
        else:
            y = base.act_fn(y)
        y = self._project(self.down_name, y, experts, offsets, meta)
        if getattr(base, "has_post_expert_norm", False):
            y = base.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        y = y[torch.argsort(perm)]  # back to (token, k) order
        return y.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

    def _offsets(self, experts: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Cumulative pair counts per expert for a grouped GEMM, None where none is usable (then a masked GEMM per
        expert: E times the FLOPs, for CPU-compiled and non-bf16 CUDA models)."""
        if not _grouped_mm_usable(x):
            return None
        # histc, not bincount: fixed output size, no sync (CUDA graphs); the CPU takes floats, CUDA ints
        counts = torch.histc(experts.float() if x.device.type == "cpu" else experts.int(), bins=self.num_experts,
                             min=0, max=self.num_experts - 1)
        return torch.cumsum(counts, dim=0, dtype=torch.int32)

    def _project(self, name: str, x: torch.Tensor, experts: torch.Tensor, offsets, meta) -> torch.Tensor:
        """Each pair's row through its expert's ``name`` parameter (and bias), plus the LoRA delta."""
        w = getattr(self.base_layer, name)
        w_in_out = w if self.transposed else w.transpose(-2, -1)  # [E, in, out]
        x = x.to(w.dtype)
        if offsets is not None:
            y = F.grouped_mm(x, w_in_out, offs=offsets)
        else:
            y = x.new_zeros(x.shape[0], w_in_out.shape[2])
            for e in range(self.num_experts):  # static: E is fixed
                y = torch.where((experts == e).unsqueeze(-1), x @ w_in_out[e], y)
        if self.has_bias:
            y = y + getattr(self.base_layer, f"{name}_bias")[experts]
        store = self.slots[name]
        if store.r_max:
            y = y.contiguous()
            store.add(y, x.contiguous(), meta, self.ctx.kernels)
        return y

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, params=({self.up_name}, {self.down_name})"


def _gate(act, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs here: bf16 on CUDA (sm80+, compiled too), or eager on the CPU."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and not torch.compiler.is_compiling()
