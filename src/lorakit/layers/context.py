"""The state one forward pass shares among LoRA layers: which adapter slot each token uses.

The patched model's forward takes ``lora_ids`` ([batch] per sequence or [batch, seq] per token, -1 for
the base model), or a ``StepContext`` as ``lorakit_step``, and hands the ids to a ``LoraContext``; each LoRA
layer asks the context for the batch metadata matching its input's leading shape, which is built once per
shape and forward pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorakit.ops import KernelOptions, LoraMeta, build_lora_meta


@dataclass
class StepContext:
    """What one forward pass's layers read besides their inputs, built once by the caller and passed as the
    model's ``lorakit_step`` keyword: the patched model's pre-hook hands ``lora_ids`` to the LoRA layers, and
    transformers passes the whole object on to the attention function (the engine's subclass adds its KV cache)."""

    lora_ids: torch.Tensor  # [batch] or [batch, seq] adapter slots, -1 for the base model


class LoraContext:
    """Holds the current forward pass's adapter ids and the metadata built from them, and the ``KernelOptions`` every
    LoRA layer of the model launches its kernels with (``PatchConfig.kernels``; they never change the results)."""

    def __init__(self, num_slots: int, kernels: KernelOptions = KernelOptions()):
        self.num_slots = num_slots
        self.kernels = kernels
        self.ids: torch.Tensor | None = None
        self.default_ids: torch.Tensor | None = None  # used by forward passes given no lora_ids (handle.using)
        self.keep: torch.Tensor | None = None
        self._metas: dict[tuple[int, ...], LoraMeta] = {}
        self._on_reset: list[Callable[[], None]] = []

    def on_reset(self, fn: Callable[[], None]) -> None:
        """Call fn at the start and end of every forward pass (layers drop per-pass caches there)."""
        self._on_reset.append(fn)

    def begin(self, ids: torch.Tensor | None, keep: torch.Tensor | None = None) -> None:
        """Start a forward pass with these ids (None: the default ids, else every token uses the base model).
        ``keep``: the positions whose hidden states reach the head, when the model was given them as a tensor
        ``logits_to_keep`` (packed batches keep the last position of each sequence)."""
        ids = self.default_ids if ids is None else ids
        if ids is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            warnings.warn("lorakit's LoRA ops are inference-only: gradients do not flow through adapter deltas; "
                          "run the model under torch.no_grad() or torch.inference_mode()", stacklevel=3)
        if ids is not None:
            if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"lora_ids must be an int tensor from handle.ids(...), got {ids!r:.80}")
            if ids.dim() not in (1, 2):
                raise ValueError(
                    f"lora_ids must be [batch] (one adapter per sequence) or [batch, seq] (per token), "
                    f"got shape {tuple(ids.shape)}"
                )
        self.ids = ids
        self.keep = keep if isinstance(keep, torch.Tensor) and keep.dim() == 1 else None
        self._reset()

    def end(self) -> None:
        self.ids = None
        self._reset()

    def _reset(self) -> None:
        self._metas = {}
        for fn in self._on_reset:
            fn()

    def meta_for(self, leading: torch.Size) -> LoraMeta | None:
        """Metadata for an input of leading shape [batch, seq] (or [batch]); None when no ids were given."""
        if self.ids is None:
            return None
        key = tuple(leading)
        if key not in self._metas:
            self._metas[key] = build_lora_meta(self._token_slots(key), self.num_slots)
        return self._metas[key]

    def _token_slots(self, leading: tuple[int, ...]) -> torch.Tensor:
        ids = self.ids
        batch = ids.shape[0]
        # [batch * seq] tokens flattened (an MoE block's experts and shared experts): with per-token ids only when the
        # count is theirs, so a layer that sees a subset of the tokens (routed to it) is refused, never misread
        flat = len(leading) == 1 and leading[0] != batch and leading[0] % batch == 0
        if flat and (ids.dim() == 1 or leading[0] == ids.numel()):
            leading = (batch, leading[0] // batch)
        if len(leading) == 0 or leading[0] != batch:
            raise ValueError(
                f"lora_ids has {batch} rows but a LoRA layer got an input of leading shape {leading}; "
                f"pass one id per sequence of the batch"
            )
        seq = 1
        for n in leading[1:]:
            seq *= n
        if ids.dim() == 1:
            return ids[:, None].expand(batch, seq).reshape(-1)
        if ids.shape[1] == seq:
            return ids.reshape(-1)
        if ids.shape[1] > seq and self.keep is not None and self.keep.numel() == seq:  # logits_to_keep=index
            return ids[:, self.keep].reshape(-1)
        if ids.shape[1] > seq:  # the head sees only the last positions (logits_to_keep=int)
            return ids[:, ids.shape[1] - seq:].reshape(-1)
        raise ValueError(
            f"lora_ids gives {ids.shape[1]} positions per sequence but a LoRA layer got {seq}; "
            f"pass [batch] ids or [batch, seq] ids matching input_ids"
        )
