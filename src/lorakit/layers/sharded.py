"""What a base layer split over tensor-parallel ranks tells lorakit's LoRA layers: the contract, not the sharding.

``layers`` knows nothing of how a model is split or of the process group: a sharded base layer (``lorakit.parallel``
implements them, and imports this module, never the other way) subclasses ``ShardedLayer`` and says the unsharded
shape an adapter's A and B are read for (``full_features``), how to cut them to the part this rank's slots hold
(``lora_shard``), whether it is split by vocabulary (``vocab_parallel``), and which LoRA wrapper it needs when the
ordinary one does not do (``lora_wrapper``: a row-parallel layer's LoRA has a collective of its own, so it is never
grouped with its siblings). ``patch``, the handle and the slot images read these through the functions below.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch
from torch import nn

from lorakit.peft import AdapterError, ModuleLora, read_adapter_config
from lorakit.peft.targets import token_targets


class ShardedLayer(nn.Module, abc.ABC):
    """A base layer that holds one rank's shard of a tensor-parallel model's layer (see the module docstring)."""

    vocab_parallel: bool = False  # split by vocabulary rows (an embedding or the head): no rank holds the whole table
    lora_wrapper: type[nn.Module] | None = None  # the LoRA wrapper patch gives it; None: the usual one

    @property
    @abc.abstractmethod
    def full_features(self) -> tuple[int, int]:
        """(in_features, out_features) of the unsharded layer ((num_embeddings, embedding_dim) for an embedding)."""

    @abc.abstractmethod
    def lora_shard(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA shaped for the unsharded layer (A [r, in], B [out, r])."""


class ShardedLinear(ShardedLayer):
    """A sharded linear layer: ``in_features`` and ``out_features`` are this rank's shard's (what its slots hold)."""

    in_features: int
    out_features: int

    def quantize(self, scheme: str) -> str | None:
        """Store this rank's shard of the weight quantized as ``scheme`` (``lorakit.layers.quant``), in place; returns
        why it cannot (None: done). Once quantized, ``compute_dtype`` is what it takes and returns."""
        return f"a {type(self).__name__} does not quantize"


def is_vocab_parallel(module: nn.Module) -> bool:
    return isinstance(module, ShardedLayer) and module.vocab_parallel


def full_features(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) a LoRA layer's adapters' A and B are shaped for: the unsharded layer's for a
    sharded base layer."""
    base = getattr(layer, "base_layer", None)
    return base.full_features if isinstance(base, ShardedLayer) else (layer.in_features, layer.out_features)


def shard_lora(layer: nn.Module, lora: ModuleLora) -> ModuleLora:
    """The part of a module's LoRA that this rank's slots hold (``lora`` itself for an unsharded layer)."""
    base = getattr(layer, "base_layer", None)
    if not isinstance(base, ShardedLayer):
        return lora
    A, B = base.lora_shard(lora.A, lora.B)
    return ModuleLora(A.contiguous(), B.contiguous(), lora.rank, lora.scale)


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
