"""``lorakit.patch``: put LoRA slots into any transformers model, in place.

Like torchao's ``quantize_``: a recursive swap by fully-qualified name with an optional filter. Every
linear-like module (nn.Linear, GPT-2's Conv1D) and every nn.Embedding becomes a LoRA wrapper that keeps
the original as ``base_layer`` and calls it unchanged; a wrapper costs nothing until an adapter targets
it. The model's forward then takes ``lora_ids``. The returned ``LoraHandle`` owns the slots: what is
fixed at patch time (the wrapped modules, the slot count) is separate from what changes (which adapter
sits in which slot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lorakit.layers.adapter import AdapterError, BaseModule, PeftAdapter, load_peft_adapter
from lorakit.layers.context import LoraContext
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.image import SlotImage, SlotWriter, grow_for, pack_adapter, store_of
from lorakit.layers.slots import LoraSlots
from lorakit.layers.tokens import TokenRows
from lorakit.layers.linear import LoraLinear, LoraLinearGroup, LoraLinearMember, linear_shape
from lorakit.ops._checks import MAX_SLICES

logger = logging.getLogger("lorakit.patch")


@dataclass(frozen=True)
class PatchConfig:
    """max_loras: adapter slots (adapters served at once). max_rank: the largest rank accepted.
    rank_multiple: padding granularity; a layer's max rank grows in these steps as adapters need.
    filter_fn(module, fqn): which modules get LoRA slots (default: every linear and embedding).
    max_token_rows: the most token rows (trainable or added tokens) one adapter may replace in the input
    embedding or the output head; each row costs hidden_size x dtype bytes in every slot."""

    max_loras: int = 8
    max_rank: int = 256
    rank_multiple: int = 16
    filter_fn: Callable[[nn.Module, str], bool] | None = None
    max_token_rows: int = 1024

    def __post_init__(self):
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive int, got {self.max_loras!r}")
        if not isinstance(self.max_rank, int) or self.max_rank < 1:
            raise ValueError(f"max_rank must be a positive int, got {self.max_rank!r}")
        if self.rank_multiple not in (1, 2, 4, 8, 16, 32, 64):
            raise ValueError(f"rank_multiple must be a power of two up to 64, got {self.rank_multiple!r}")
        if not isinstance(self.max_token_rows, int) or self.max_token_rows < 0:
            raise ValueError(f"max_token_rows must be a non-negative int, got {self.max_token_rows!r}")


def patch(model: nn.Module, max_loras: int = 8, *, max_rank: int = 256, rank_multiple: int = 16,
          filter_fn: Callable[[nn.Module, str], bool] | None = None, max_token_rows: int = 1024) -> "LoraHandle":
    """Give ``model`` LoRA slots in place and return the handle that loads adapters into them.

    After patching, ``model(..., lora_ids=handle.ids(["sql", None]))`` serves each sequence (or token)
    with its adapter; without ``lora_ids`` the model computes exactly what it did before.
    """
    config = PatchConfig(max_loras, max_rank, rank_multiple, filter_fn, max_token_rows)
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError("this model is already patched by lorakit; use the handle patch() returned")
    ctx = LoraContext(config.max_loras)
    token_modules = _token_modules(model)
    linears, embeddings = {}, {}
    for name, module in model.named_modules():
        if not name or (config.filter_fn is not None and not config.filter_fn(module, name)):
            continue
        if linear_shape(module) is not None:
            linears[name] = module
        elif isinstance(module, nn.Embedding):
            embeddings[name] = module
    if not linears and not embeddings:
        raise ValueError("found no nn.Linear, Conv1D or nn.Embedding module to patch (check filter_fn)")

    layers: dict[str, nn.Module] = {}
    grouped = set()
    for k, names in enumerate(_siblings(model, linears)):
        group = LoraLinearGroup([linears[n] for n in names], ctx, config.max_loras, config.rank_multiple)
        model.get_submodule(names[0].rpartition(".")[0]).add_module(f"lorakit_group_{k}", group)
        for index, name in enumerate(names):
            layers[name] = LoraLinearMember(linears[name], group, index)
            grouped.add(name)
    for name, module in linears.items():
        if name not in grouped:
            layers[name] = LoraLinear(module, ctx, config.max_loras, config.rank_multiple)
    for name, module in embeddings.items():
        layers[name] = LoraEmbedding(module, ctx, config.max_loras, config.rank_multiple)
    for name, role in token_modules.items():
        layer = layers.get(name)
        if isinstance(layer, (LoraEmbedding, LoraLinear)):
            vocab, dim = (layer.in_features, layer.out_features) if role == "input" else (layer.out_features,
                                                                                        layer.in_features)
            layer.tokens = TokenRows(config.max_loras, vocab, dim, layer.dtype, layer.lora_B.device,
                                     config.rank_multiple)
    for name, wrapper in layers.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)

    handle = LoraHandle(model, ctx, layers, config)
    model._lorakit_handle = handle
    model.register_forward_pre_hook(_take_lora_ids(ctx), with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: ctx.end())
    return handle


def _token_modules(model: nn.Module) -> dict[str, str]:
    """{name: "input" | "output"} of the model's input embedding and output head, where it has them."""
    found = {}
    for role, getter in (("input", "get_input_embeddings"), ("output", "get_output_embeddings")):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        name = next((n for n, m in model.named_modules() if m is module and n), None)
        if name is not None:
            found[name] = role
    return found


def _siblings(model: nn.Module, linears: dict[str, nn.Module]) -> list[list[str]]:
    """Linear modules under one parent that read the very same input tensor, seen in one forward pass
    on the model's dummy inputs (at most MAX_SLICES a group). Without a traced pass, no groups: every
    module then takes its own launches, which is slower but exact."""
    seen: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(name, args[0])  # the tensor itself, kept alive: identity is exact
        return hook

    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict) or not inputs:
        logger.info("%s has no dummy_inputs; sibling projections are not grouped", type(model).__name__)
        return []
    device = next(model.parameters()).device
    hooks = [module.register_forward_pre_hook(record(name)) for name, module in linears.items()]
    try:
        with torch.no_grad():
            model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    except Exception as e:  # a model that needs more than dummy inputs: correct without groups
        logger.info("tracing %s on dummy inputs failed (%s); no sibling groups",
                    type(model).__name__, e)
        return []
    finally:
        for hook in hooks:
            hook.remove()
    groups: list[list[str]] = []
    for name in linears:
        if name not in seen:
            continue
        parent = name.rpartition(".")[0]
        for group in groups:
            first = group[0]
            if (first.rpartition(".")[0] == parent and seen[first] is seen[name] and len(group) < MAX_SLICES
                    and linear_shape(linears[first])[0] == linear_shape(linears[name])[0]):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def _take_lora_ids(ctx: LoraContext):
    def hook(module, args, kwargs):
        step = kwargs.get("lorakit_step")  # a StepContext: left in kwargs for transformers to pass to attention
        ids = kwargs.pop("lora_ids", None) if step is None else step.lora_ids
        ctx.begin(ids, kwargs.get("logits_to_keep"))
        return args, kwargs

    return hook


class LoraHandle:
    """The slots of a patched model: load, unload, and turn adapter names into ``lora_ids``."""

    def __init__(self, model: nn.Module, ctx: LoraContext, layers: dict[str, nn.Module], config: PatchConfig):
        self.model = model
        self.config = config
        self.layers = layers
        self._ctx = ctx
        self._base_modules = {
            name: BaseModule("embedding" if isinstance(layer, LoraEmbedding) else "linear",
                             layer.in_features, layer.out_features,
                             ("input" if isinstance(layer, LoraEmbedding) else "output")
                             if getattr(layer, "tokens", None) is not None else None)
            for name, layer in layers.items()
        }
        self._token_stores = {name: layer.tokens for name, layer in layers.items()
                              if getattr(layer, "tokens", None) is not None}
        roles = {self._base_modules[n].tokens: n for n in self._token_stores}
        self._input_name, self._output_name = roles.get("input"), roles.get("output")
        self.tied = (self._input_name is not None and self._output_name is not None
                     and layers[self._input_name].weight is layers[self._output_name].weight)
        self._slots: list[str | None] = [None] * config.max_loras
        self._adapters: dict[str, PeftAdapter] = {}
        self._stores = {id(store): store for store in (store_of(layer)[0] for layer in layers.values())}
        self._slot_stores: list[set[LoraSlots]] = [set() for _ in range(config.max_loras)]
        self.layout_version = 0  # bumped whenever a slot buffer is reallocated (rank growth)
        self._writer = SlotWriter()
        self.manager = None  # an AdapterPool that owns the slots, if any

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def adapters(self) -> dict[str, int]:
        """Loaded adapter names and their slots."""
        return {name: slot for slot, name in enumerate(self._slots) if name is not None}

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT adapter folder into a free slot; returns the slot. On any error nothing changes."""
        self._check_unmanaged("load_adapter")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise AdapterError(f"adapter {name!r} is already loaded in slot {self.adapters[name]}; "
                               f"unload it first or load this one under another name")
        if None not in self._slots:
            raise AdapterError(f"cannot load adapter {name!r}: all {len(self._slots)} slots hold adapters "
                               f"({', '.join(self.adapters)}); unload one or patch with a larger max_loras")
        adapter = self.read_adapter(name, path)
        slot = self._slots.index(None)
        self.write(slot, self.pack(adapter, pin=False))
        self._writer.drop_staging()  # one-off loads keep no staging memory; the pool keeps its own
        self._slots[slot] = name
        self._adapters[name] = adapter
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free the adapter's slot; other slots are untouched."""
        self._check_unmanaged("unload_adapter")
        if name not in self._adapters:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
        slot = self._slots.index(name)
        del self._adapters[name]
        self.write(slot, None)
        self._slots[slot] = None

    # The slot-level interface the adapter pool (lorakit.engine) builds on.

    @property
    def base_modules(self) -> dict[str, BaseModule]:
        """The modules an adapter may target, by fully-qualified name."""
        return self._base_modules

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._stores.values())).dtype if self._stores else torch.float32

    def read_adapter(self, name: str, path: str | Path) -> PeftAdapter:
        """Read and validate a PEFT adapter folder for this model (on the CPU); raises AdapterError."""
        base_weights = {n: self.layers[n].weight for n in self._token_stores}
        adapter = load_peft_adapter(name, path, self._base_modules, torch.float32, base_weights)
        if adapter.max_rank > self.config.max_rank:
            raise AdapterError(f"adapter {name!r} at {path}: rank {adapter.max_rank} is above this model's "
                               f"max_rank={self.config.max_rank}; patch with a larger max_rank")
        return self._tie_tokens(adapter)

    def _tie_tokens(self, adapter: PeftAdapter) -> PeftAdapter:
        """Apply PEFT's rules for the head's token rows: a head tied to the input embedding shares its rows;
        an untied head needs rows of its own for every token the adapter adds (its logits are the adapter's)."""
        if not adapter.tokens:
            return adapter
        where = f"adapter {adapter.name!r} at {adapter.path}"
        tokens = dict(adapter.tokens)
        inp, out = tokens.get(self._input_name), tokens.get(self._output_name)
        if self.tied and inp is not None:
            if out is not None and not torch.equal(out.ids, inp.ids):
                raise AdapterError(f"{where}: the model's head is tied to its input embedding, but the adapter "
                                   f"gives them different token ids; tied layers must share their token ids")
            if out is None and adapter.config.get("trainable_token_indices") is not None:
                tokens[self._output_name] = inp  # PEFT ties the head's token adapter to the embedding's
        vocab = self._base_modules[self._input_name].vocab if self._input_name else 0
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

    def pack(self, adapter: PeftAdapter, pin: bool) -> SlotImage:
        """The adapter laid out as a slot holds it, in the model's dtypes (in pinned memory if ``pin``)."""
        return pack_adapter(adapter, self.layers, pin)

    def grow_for(self, image: SlotImage) -> bool:
        """Make room in the padded ranks for ``image`` (on the current stream); True if a buffer grew, which
        a compiled model sees as a new shape (one recompile) and a captured CUDA graph must be recaptured for."""
        grew = grow_for(image)
        self.layout_version += grew
        return grew

    def write(self, slot: int, image: SlotImage | None) -> None:
        """Put ``image`` (None: nothing) into ``slot`` on the current stream, clearing what the slot's previous
        adapter left in stores the new one does not touch. Nothing may be reading the slot meanwhile."""
        if image is not None:
            self.grow_for(image)
        new = ({s.store for s in image.stores} | {t.store for t in image.tokens}) if image is not None else set()
        self._writer.write(slot, image, [s for s in self._slot_stores[slot] if s not in new], self.layout_version)
        self._slot_stores[slot] = new

    @property
    def staging_bytes(self) -> int:
        """Device memory kept for staging uploads (about the largest adapter uploaded)."""
        return self._writer.staging_bytes

    def slot_bytes(self, rank: int) -> int:
        """Bytes of the slot buffers of every store (all slots) if every store were padded to ``rank``."""
        total = 0
        for store in self._stores.values():
            n = len(store.out_sizes)
            r = -(-rank // store.rank_multiple) * store.rank_multiple
            total += store.num_slots * (r * (n * store.in_features + store.out_offsets[-1]) * store.dtype.itemsize
                                        + n * 8)
        return total

    def _check_unmanaged(self, what: str) -> None:
        if self.manager is not None:
            raise RuntimeError(f"this model's slots are managed by {self.manager!r}; use its register/acquire "
                               f"instead of handle.{what}")

    def ids(self, names: Sequence[str | None], device: torch.device | str | None = None) -> torch.Tensor:
        """Slot ids for a batch: one adapter name per sequence (None for the base model), as a LongTensor."""
        self._check_unmanaged("ids")
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

    @property
    def vocab_size(self) -> int:
        """Logit columns the head gives when lora_ids are passed: the base vocabulary plus the tokens adapters
        loaded so far have added (grows; a request's own adapter's added tokens are the only ones it can get)."""
        head = self._token_stores.get(self._output_name)
        base = self._base_modules[self._output_name].vocab if self._output_name else 0
        return base + (head.added if head is not None else 0)

    def memory(self) -> dict[str, int]:
        """Bytes of slot buffers: in all, and per slot."""
        total = sum(store.lora_A.nbytes + store.lora_B.nbytes for store in self._stores.values())
        total += sum(t.rows.nbytes + t.ids1.nbytes for t in self._token_stores.values())
        return {"slot_buffers": total, "per_slot": total // len(self._slots)}
