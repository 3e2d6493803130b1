"""``LoraHandle``: what ``patch`` fixed about a model's LoRA slots, and how adapters are read into them.

The handle holds only what never changes after patching: the wrapped modules and their slot stores, the base
modules an adapter may target, the tied head, the slot count and max rank (``config``), and how an adapter is
read, checked and packed for this model. What changes (which adapter is in which slot) has one owner, the
``SlotTable`` at ``handle.slots``: the adapter pool manages it, and ``load_adapter`` / ``ids`` / ``using``
here are a thin manager of it without a CPU tier, for using a patched model directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.image import Plans, SlotImage, pack_adapter, store_of
from lorakit.layers.linear import LoraLinearGroup
from lorakit.layers.moe import ExpertSlots
from lorakit.layers.sharded import ShardedLayer, check_vocab_parallel, full_features
from lorakit.layers.slot_table import Loaded, SlotTable
from lorakit.layers.slots import LoraSlots
from lorakit.ops import round_up
from lorakit.peft import (
    AdapterError,
    AdapterInfo,
    BaseModule,
    PeftAdapter,
    inspect_peft_adapter,
    load_peft_adapter,
    plan_state_dict,
    take_state_dict,
)


class LoraHandle:
    """A patched model's LoRA slots: read adapters for them; load, unload, and turn names into ``lora_ids``."""

    def __init__(self, model: nn.Module, ctx: LoraContext, layers: dict[str, nn.Module], config,
                 vocab_parallel: set[str] | None = None):
        self.model = model
        self.config = config  # the PatchConfig: max_loras (the slot count), max_rank, ...
        self.layers = layers
        self._ctx = ctx
        self.base_modules: dict[str, BaseModule] = {
            name: layer.base_module() if isinstance(layer, ExpertSlots)  # a stacked MoE parameter
            else BaseModule("embedding" if isinstance(layer, LoraEmbedding) else "linear",
                            *full_features(layer),  # a tensor-parallel shard: the unsharded layer's shape
                            ("input" if isinstance(layer, LoraEmbedding) else "output")
                            if getattr(layer, "tokens", None) is not None else None)
            for name, layer in layers.items()
        }
        self._token_stores = {name: layer.tokens for name, layer in layers.items()
                              if getattr(layer, "tokens", None) is not None}
        roles = {self.base_modules[n].tokens: n for n in self._token_stores}
        self._input_name, self._output_name = roles.get("input"), roles.get("output")
        self.tied = (self._input_name is not None and self._output_name is not None
                     and layers[self._input_name].weight is layers[self._output_name].weight)
        self._stores = {id(store): store for store in (store_of(layer)[0] for layer in layers.values())}
        self.slots = SlotTable(config.max_loras)
        self._layouts = Plans()  # images of the last few adapter shapes packed, planned once each
        self._structures = Plans()  # the structures of the last few state dicts pushed, checked once each
        # A tensor-parallel model's vocab-parallel embedding / head: no rank holds its whole weight, which a saved whole
        # matrix of it (modules_to_save, a resized vocabulary) is compared against, so such adapters are refused.
        self.vocab_parallel = {name: self.base_modules[name] for name in vocab_parallel or () if name in layers}

    @property
    def num_slots(self) -> int:
        return self.config.max_loras

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._stores.values())).dtype if self._stores else torch.float32

    # Reading adapters for this model (every check in one place).

    def inspect_adapter(self, name: str, path: str | Path, strict: bool = True) -> AdapterInfo:
        """What the config and the weights' header say, checked against this model; reads no weights.
        ``strict=False``: accept a file that disagrees with its config as PEFT loads it (see load_peft_adapter)."""
        check_vocab_parallel(name, path, self.base_modules, self.vocab_parallel, self.tied)
        info = inspect_peft_adapter(name, path, self.base_modules, strict=strict, tied=self.tied)
        self._check_rank(info.max_rank, f"adapter {name!r} at {path}")
        self._check_dora(info.dora, info.config, f"adapter {name!r} at {path}")
        return info

    def read_adapter(self, name: str, path: str | Path, strict: bool = True) -> PeftAdapter:
        """Read and validate a PEFT adapter folder for this model (on the CPU); raises AdapterError.
        ``strict=False``: load a file that disagrees with its config as PEFT does (see load_peft_adapter)."""
        check_vocab_parallel(name, path, self.base_modules, self.vocab_parallel, self.tied)
        base_weights = {n: self.layers[n].weight for n in self._token_stores}
        adapter = load_peft_adapter(name, path, self.base_modules, torch.float32, base_weights, strict=strict,
                                    tied=self.tied)
        self._check_rank(adapter.max_rank, f"adapter {name!r} at {path}")
        self._check_dora({m for m, lora in adapter.modules.items() if lora.magnitude is not None}, adapter.config,
                         f"adapter {name!r} at {path}")
        return self._tie_tokens(adapter)

    def read_state_dict(self, name: str, tensors, config: dict, path: Path, strict: bool = True,
                        values: bool = True) -> tuple[AdapterInfo, PeftAdapter] | None:
        """A plain-LoRA PEFT state dict in memory, checked for this model with its tensors left where they are
        (``read_state_dict``; ``values=False``: all but its values, which the caller checks with ``check_values``);
        None when it needs the folder reader (more than plain LoRA, or a tensor-parallel vocabulary)."""
        if self.vocab_parallel:
            return None
        where = f"adapter {name!r} at {path}"
        try:  # a training loop pushes the same structure each time: it is checked once
            key = (json.dumps(config, sort_keys=True), strict, tuple((k, t.shape, t.dtype) for k, t in tensors.items()))
        except (TypeError, ValueError, AttributeError):  # not JSON, not tensors: the checks say what is wrong
            key = None

        def check():
            return plan_state_dict(tensors, config, self.base_modules, where, strict=strict, tied=self.tied)
        plan = check() if key is None else self._structures.get(key, check)
        if plan is None:
            return None
        self._check_rank(max((rank for _, _, rank, _ in plan.values()), default=0), where)
        return take_state_dict(name, tensors, config, path, plan, values)

    def _check_rank(self, rank: int, where: str) -> None:
        if rank > self.config.max_rank:
            raise AdapterError(f"{where}: rank {rank} is above this model's max_rank={self.config.max_rank}; "
                               f"patch with a larger max_rank (lorakit serve: --max-rank)")

    def _check_dora(self, modules, config: dict, where: str) -> None:
        """DoRA where lorakit serves it: not on a tensor-parallel shard (its column norms span every rank's
        shard), not on a head tied to the input embedding through ensure_weight_tying."""
        sharded = sorted(m for m in modules if isinstance(getattr(self.layers[m], "base_layer", None), ShardedLayer))
        if sharded:
            raise AdapterError(f"{where}: it is a DoRA adapter (use_dora) and this model is split by tensor "
                               f"parallelism, which lorakit does not serve DoRA on yet ({sharded[:3]}); serve it "
                               f"with --tensor-parallel-size 1, or merge it into the base with PEFT's "
                               f"merge_and_unload()")
        if self.tied and config.get("ensure_weight_tying") and modules & {self._input_name, self._output_name}:
            raise AdapterError(f"{where}: DoRA on an input embedding whose head is tied to it (ensure_weight_tying) "
                               f"is not served: PEFT's tied DoRA head has no magnitudes of its own in the file; "
                               f"retrain without ensure_weight_tying or without DoRA on the embedding")

    def _tie_tokens(self, adapter: PeftAdapter) -> PeftAdapter:
        """Apply PEFT's rules for the head's token rows: a head tied to the input embedding shares its rows;
        an untied head needs rows of its own for every token the adapter adds (its logits are the adapter's)."""
        if not adapter.tokens:
            return adapter
        where = f"adapter {adapter.name!r} at {adapter.path}"
        tokens = dict(adapter.tokens)
        inp, out = tokens.get(self._input_name), tokens.get(self._output_name)
        if self.tied and inp is not None:
            if out is not None and not (torch.equal(out.ids, inp.ids) and torch.equal(out.rows, inp.rows)):
                raise AdapterError(f"{where}: the model's head is tied to its input embedding, but the adapter "
                                   f"gives them different token rows; tied layers must share their token rows")
            if out is None and adapter.config.get("trainable_token_indices") is not None:
                tokens[self._output_name] = inp  # PEFT ties the head's token adapter to the embedding's
        vocab = self.base_modules[self._input_name].vocab if self._input_name else 0
        added_in = {int(i) for i in inp.ids if i >= vocab} if inp is not None else set()
        out = tokens.get(self._output_name)
        added_out = {int(i) for i in out.ids if i >= vocab} if out is not None else set()
        if added_in != added_out:
            raise AdapterError(f"{where}: the adapter adds token ids {sorted(added_in ^ added_out)[:8]} to only one of "
                               f"the input embedding and the output head; an added token needs both rows (add the "
                               f"head, e.g. 'lm_head', to trainable_token_indices or modules_to_save)")
        for module, t in tokens.items():
            if t.ids.numel() > self.config.max_token_rows:
                raise AdapterError(f"{where}: module {module!r}: the adapter replaces {t.ids.numel()} token rows, "
                                   f"above max_token_rows={self.config.max_token_rows} (each row costs "
                                   f"{t.rows.shape[1] * self.dtype.itemsize} bytes in every slot); patch with "
                                   f"max_token_rows>={t.ids.numel()} to serve it")
        return dataclasses.replace(adapter, tokens=tokens)

    def ranks_by_store(self, infos: Sequence[AdapterInfo]) -> dict[LoraSlots, int]:
        """The rank each slot store needs to hold every one of these adapters (from their headers)."""
        need: dict[LoraSlots, int] = {}
        for info in infos:
            for module, (rank, _) in info.modules.items():
                store = store_of(self.layers[module])[0]
                need[store] = max(need.get(store, 0), rank)
        return need

    def pack(self, adapter: PeftAdapter, pin: bool) -> SlotImage:
        """The adapter laid out as a slot holds it, in the model's dtypes (in pinned memory if ``pin``)."""
        return pack_adapter(adapter, self.layers, pin, self._layouts)

    # Using the model directly: a thin manager of the slot table, without a CPU tier.

    @property
    def adapters(self) -> dict[str, int]:
        """Adapter names in the slots and their slots."""
        return {t.name: slot for slot, t in self.slots.tenants().items()}

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT adapter folder into a free slot; returns the slot. On any error nothing changes."""
        self.slots.check_unmanaged("load_adapter")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        loaded = self.adapters
        if name in loaded:
            raise AdapterError(f"adapter {name!r} is already loaded in slot {loaded[name]}; "
                               f"unload it first or load this one under another name")
        free = self.slots.free()
        if not free:
            raise AdapterError(f"cannot load adapter {name!r}: all {self.num_slots} slots hold adapters "
                               f"({', '.join(loaded)}); unload one or patch with a larger max_loras")
        image = self.pack(self.read_adapter(name, path), pin=False)
        self.slots.put(free[0], Loaded(name), image)
        self.slots.drop_staging()  # one-off loads keep no staging memory; the pool keeps its own
        return free[0]

    def unload_adapter(self, name: str) -> None:
        """Free the adapter's slot (zeroed); other slots are untouched."""
        self.slots.check_unmanaged("unload_adapter")
        loaded = self.adapters
        if name not in loaded:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {', '.join(loaded) or 'none'})")
        self.slots.vacate(loaded[name], zero=True)

    def ids(self, names: Sequence[str | None], device: torch.device | str | None = None) -> torch.Tensor:
        """Slot ids for a batch: one adapter name per sequence (None for the base model), as a LongTensor."""
        self.slots.check_unmanaged("ids")
        slot_of = self.adapters
        unknown = sorted({n for n in names if n is not None and n not in slot_of})
        if unknown:
            raise ValueError(f"unknown adapter name(s) {unknown} in ids(); loaded: {sorted(slot_of) or 'none'}")
        return torch.tensor([-1 if n is None else slot_of[n] for n in names], dtype=torch.long,
                            device=self.device if device is None else device)

    @contextlib.contextmanager
    def using(self, ids: torch.Tensor | Sequence[str | None]):
        """Within the block, forward passes given no ``lora_ids`` use these (names or ids, one per
        sequence): for callers that cannot pass extra arguments, such as transformers' ``generate``::

            with handle.using(["sql", None]):
                model.generate(input_ids, max_new_tokens=32)
        """
        ids = ids if isinstance(ids, torch.Tensor) else self.ids(ids)
        previous, self._ctx.default_ids = self._ctx.default_ids, ids
        try:
            yield ids
        finally:
            self._ctx.default_ids = previous

    def fuse_sibling_gemms(self) -> int:
        """Fuse the base GEMMs of every group of sibling projections that allows it (``LoraLinearGroup.fuse_base``:
        the weights move into one buffer per group; call it on a model that stays on its device). Returns how many
        groups are fused."""
        return sum(store.fuse_base() for store in self._stores.values() if isinstance(store, LoraLinearGroup))

    # Sizes.

    @property
    def vocab_size(self) -> int:
        """Logit columns the head gives when lora_ids are passed: the base vocabulary plus the tokens adapters
        loaded so far have added (grows; a request's own adapter's added tokens are the only ones it can get)."""
        head = self._token_stores.get(self._output_name)
        base = self.base_modules[self._output_name].vocab if self._output_name else 0
        return base + (head.added if head is not None else 0)

    def slot_bytes(self, rank: int) -> int:
        """Bytes of the slot buffers of every store (all slots) if every store were padded to ``rank``."""
        total = 0
        for store in self._stores.values():
            n = len(store.out_sizes)
            r = round_up(rank, store.rank_multiple)
            total += store.num_slots * (r * (n * store.in_features + store.out_offsets[-1]) * store.dtype.itemsize
                                        + n * 8)
        return total

    def memory(self) -> dict[str, int]:
        """Bytes of slot buffers: in all, and per slot."""
        total = sum(store.lora_A.nbytes + store.lora_B.nbytes + store.dora.nbytes for store in self._stores.values())
        total += sum(t.rows.nbytes + t.ids1.nbytes for t in self._token_stores.values())
        return {"slot_buffers": total, "per_slot": total // self.num_slots}
