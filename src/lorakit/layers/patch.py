"""``lorakit.patch``: put LoRA slots into any transformers model, in place.

Like torchao's ``quantize_``: a recursive swap by fully-qualified name with an optional filter. Every
linear-like module (nn.Linear, GPT-2's Conv1D) and every nn.Embedding becomes a LoRA wrapper that keeps
the original as ``base_layer`` and calls it unchanged; a wrapper costs nothing until an adapter targets
it. The model's forward then takes ``lora_ids``. The returned ``LoraHandle`` owns the slots: what is
fixed at patch time (the wrapped modules, the slot count) is separate from what changes (which adapter
sits in which slot).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lorakit.layers.adapter import AdapterError, BaseModule, PeftAdapter, load_peft_adapter
from lorakit.layers.context import LoraContext
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.linear import LoraLinear, linear_shape
from lorakit.layers.slots import LoraSlots


@dataclass(frozen=True)
class PatchConfig:
    """max_loras: adapter slots (adapters served at once). max_rank: the largest rank accepted.
    rank_multiple: padding granularity; a layer's max rank grows in these steps as adapters need.
    filter_fn(module, fqn): which modules get LoRA slots (default: every linear and embedding)."""

    max_loras: int = 8
    max_rank: int = 256
    rank_multiple: int = 16
    filter_fn: Callable[[nn.Module, str], bool] | None = None

    def __post_init__(self):
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive int, got {self.max_loras!r}")
        if not isinstance(self.max_rank, int) or self.max_rank < 1:
            raise ValueError(f"max_rank must be a positive int, got {self.max_rank!r}")
        if self.rank_multiple not in (1, 2, 4, 8, 16, 32, 64):
            raise ValueError(f"rank_multiple must be a power of two up to 64, got {self.rank_multiple!r}")


def patch(model: nn.Module, max_loras: int = 8, *, max_rank: int = 256, rank_multiple: int = 16,
          filter_fn: Callable[[nn.Module, str], bool] | None = None) -> "LoraHandle":
    """Give ``model`` LoRA slots in place and return the handle that loads adapters into them.

    After patching, ``model(..., lora_ids=handle.ids(["sql", None]))`` serves each sequence (or token)
    with its adapter; without ``lora_ids`` the model computes exactly what it did before.
    """
    config = PatchConfig(max_loras, max_rank, rank_multiple, filter_fn)
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError("this model is already patched by lorakit; use the handle patch() returned")
    ctx = LoraContext(config.max_loras)
    layers: dict[str, LoraSlots] = {}
    for name, module in list(model.named_modules()):
        if not name or (config.filter_fn is not None and not config.filter_fn(module, name)):
            continue
        if linear_shape(module) is not None:
            wrapper = LoraLinear(module, ctx, config.max_loras, config.rank_multiple)
        elif isinstance(module, nn.Embedding):
            wrapper = LoraEmbedding(module, ctx, config.max_loras, config.rank_multiple)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
        layers[name] = wrapper
    if not layers:
        raise ValueError("found no nn.Linear, Conv1D or nn.Embedding module to patch (check filter_fn)")
    handle = LoraHandle(model, ctx, layers, config)
    model._lorakit_handle = handle
    model.register_forward_pre_hook(_take_lora_ids(ctx), with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: ctx.end())
    return handle


def _take_lora_ids(ctx: LoraContext):
    def hook(module, args, kwargs):
        ctx.begin(kwargs.pop("lora_ids", None))
        return args, kwargs

    return hook


class LoraHandle:
    """The slots of a patched model: load, unload, and turn adapter names into ``lora_ids``."""

    def __init__(self, model: nn.Module, ctx: LoraContext, layers: dict[str, LoraSlots], config: PatchConfig):
        self.model = model
        self.config = config
        self.layers = layers
        self._ctx = ctx
        self._base_modules = {
            name: BaseModule("embedding" if isinstance(layer, LoraEmbedding) else "linear",
                             layer.in_features, layer.out_features)
            for name, layer in layers.items()
        }
        self._slots: list[str | None] = [None] * config.max_loras
        self._adapters: dict[str, PeftAdapter] = {}

    @property
    def device(self) -> torch.device:
        return next(iter(self.layers.values())).ranks.device

    @property
    def adapters(self) -> dict[str, int]:
        """Loaded adapter names and their slots."""
        return {name: slot for slot, name in enumerate(self._slots) if name is not None}

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT adapter folder into a free slot; returns the slot. On any error nothing changes."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise AdapterError(f"adapter {name!r} is already loaded in slot {self.adapters[name]}; "
                               f"unload it first or load this one under another name")
        if None not in self._slots:
            raise AdapterError(f"cannot load adapter {name!r}: all {len(self._slots)} slots hold adapters "
                               f"({', '.join(self.adapters)}); unload one or patch with a larger max_loras")
        adapter = load_peft_adapter(name, path, self._base_modules, torch.float32)
        if adapter.max_rank > self.config.max_rank:
            raise AdapterError(f"adapter {name!r} at {path}: rank {adapter.max_rank} is above this model's "
                               f"max_rank={self.config.max_rank}; patch with a larger max_rank")
        slot = self._slots.index(None)
        try:
            for module, lora in adapter.modules.items():
                self.layers[module].set_slot(slot, lora.A, lora.B, lora.scale)
        except BaseException:
            for module in adapter.modules:
                self.layers[module].clear_slot(slot)
            raise
        self._slots[slot] = name
        self._adapters[name] = adapter
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free the adapter's slot; other slots are untouched."""
        if name not in self._adapters:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
        slot = self._slots.index(name)
        for module in self._adapters.pop(name).modules:
            self.layers[module].clear_slot(slot)
        self._slots[slot] = None

    def ids(self, names: Sequence[str | None], device: torch.device | str | None = None) -> torch.Tensor:
        """Slot ids for a batch: one adapter name per sequence (None for the base model), as a LongTensor."""
        slot_of = self.adapters
        unknown = sorted({n for n in names if n is not None and n not in slot_of})
        if unknown:
            raise ValueError(f"unknown adapter name(s) {unknown} in ids(); loaded: {sorted(slot_of) or 'none'}")
        return torch.tensor([-1 if n is None else slot_of[n] for n in names], dtype=torch.long,
                            device=self.device if device is None else device)

    def memory(self) -> dict[str, int]:
        """Bytes of slot buffers: in all, and per slot."""
        total = sum(layer.lora_A.nbytes + layer.lora_B.nbytes for layer in self.layers.values())
        return {"slot_buffers": total, "per_slot": total // len(self._slots)}
