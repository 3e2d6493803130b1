"""An adapter laid out as one slot of the slot buffers holds it, and the writes that put it there.

``pack_adapter`` turns a loaded PEFT adapter into a ``SlotImage``: one flat byte buffer (pinned when the
model is on a GPU) holding, for every slot store the adapter touches, each slice's A rows, the B rows
of all its slices, and the per-slice ranks and scales, each part in the layout of one slot of that
store. ``SlotWriter`` puts an image into a slot with a fixed, small number of launches whatever the
number of layers: on a GPU one host-to-device copy of the whole buffer into a staging buffer, then
batched device copies (``torch._foreach_copy_``) to the parts' places and batched zeroing of the rank
padding, all on the current stream. So an upload is one copy at the host link's speed, and the caller
chooses the stream it runs on.

A written slot holds the adapter's rows up to each slice's rank and zeros beyond: the one way slots are
written, for ``LoraHandle.load_adapter`` and the adapter pool alike. A DoRA adapter's image also holds each
slice's magnitudes; once its A and B are in the slot, the writer computes the slot's rescale from them and the
base weight on the device (``lorakit.layers.dora``: a few launches per DoRA slice).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lorakit.layers.dora import write_gain
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.linear import LoraLinear, LoraLinearMember
from lorakit.layers.moe import ExpertSlots
from lorakit.layers.sharded import shard_lora
from lorakit.layers.slots import LoraSlots
from lorakit.layers.tokens import TokenRows
from lorakit.ops import round_up
from lorakit.peft import ModuleLora, PeftAdapter

_ALIGN = 64  # bytes; every part starts at a multiple, so byte views reinterpret cleanly as any dtype


@dataclass(frozen=True)
class Part:
    """A tensor inside an image's byte buffer."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset: self.offset + self.nbytes].view(self.dtype).view(self.shape)

    def shifted(self, by: int) -> Part:
        return Part(self.offset + by, self.shape, self.dtype)


@dataclass(frozen=True, eq=False)
class StoreImage:
    """What an adapter writes into one slot of one store. ranks[i] is 0 for a slice it does not target.
    a[i]: A rows of slice i ([rank, in]; embeddings [num_embeddings, rank]); b: [max(ranks), sum(out)].
    magnitudes[i]: a DoRA slice's magnitudes (float32 [out_i]), None for plain LoRA; norm_scales[i], the scale its
    norm takes B A at (PEFT's, without an embedding's embed_scale)."""

    store: LoraSlots
    ranks: tuple[int, ...]
    a: tuple[Part | None, ...]
    b: Part
    rank_part: Part  # int32 [n]
    scale_part: Part  # float32 [n]
    magnitudes: tuple[Part | None, ...] = ()
    norm_scales: tuple[float, ...] = ()

    @property
    def dora(self) -> bool:
        return any(m is not None for m in self.magnitudes)


@dataclass(frozen=True, eq=False)
class TokenImage:
    """What an adapter writes into one slot of a TokenRows store: ids + 1 (int32 [k]) and rows [k, dim];
    ``added``: how many ids past the store's vocabulary it needs columns for."""

    store: TokenRows
    k: int
    added: int
    ids1: Part
    rows: Part


@dataclass(frozen=True, eq=False)
class SlotImage:
    name: str
    buffer: torch.Tensor  # uint8, on the CPU
    stores: tuple[StoreImage, ...]
    tokens: tuple[TokenImage, ...] = ()

    @property
    def signature(self) -> tuple:
        """Equal for images of equal layout (same stores, ranks and token rows): such images have the same
        parts at the same offsets, so one list of views serves them all."""
        return (tuple((id(s.store), s.ranks, tuple(m is not None for m in s.magnitudes)) for s in self.stores),
                tuple((id(t.store), t.k) for t in self.tokens))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def max_rank(self) -> int:
        return max((max(s.ranks) for s in self.stores), default=0)


def store_of(layer: nn.Module) -> tuple[LoraSlots, int]:
    """The store that holds a patched module's slots, and the module's slice index in it."""
    if isinstance(layer, LoraLinearMember):
        return layer.group, layer.index
    if isinstance(layer, (LoraLinear, LoraEmbedding, ExpertSlots)):
        return layer, 0
    raise TypeError(f"not a lorakit LoRA layer: {type(layer).__name__}")


def pack_adapter(adapter: PeftAdapter, layers: Mapping[str, nn.Module], pin: bool) -> SlotImage:
    """Lay ``adapter`` out as its slots hold it, cast to each store's dtype, in one (pinned) CPU buffer."""
    by_store: dict[LoraSlots, dict[int, tuple]] = {}
    for module, layer in layers.items():  # the model's order, so equal targets and ranks give equal layouts
        if module in adapter.modules:
            lora = shard_lora(layer, adapter.modules[module])  # a tensor-parallel layer keeps its shard
            store, index = store_of(layer)
            scale = lora.scale * store.embed_scale() if isinstance(store, LoraEmbedding) else lora.scale
            if isinstance(store, ExpertSlots):  # one slice per expert: its A [r, in] and B [out, r] (views)
                by_store[store] = {e: (ModuleLora(lora.A[e], lora.B[e], lora.rank, scale), scale)
                                   for e in range(store.num_experts)}
                continue
            by_store.setdefault(store, {})[index] = (lora, scale)

    offset = 0

    def place(shape, dtype) -> Part:
        nonlocal offset
        part = Part(offset, tuple(shape), dtype)
        offset += round_up(part.nbytes, _ALIGN)
        return part

    plans = []
    for store, slices in by_store.items():
        n = len(store.out_sizes)
        ranks = tuple(slices[i][0].rank if i in slices else 0 for i in range(n))
        embedding = isinstance(store, LoraEmbedding)
        a = tuple(
            None if i not in slices
            else place((store.in_features, ranks[i]) if embedding else (ranks[i], store.in_features), store.dtype)
            for i in range(n)
        )
        b = place((max(ranks), store.out_offsets[-1]), store.dtype)
        mags = tuple(place((store.out_sizes[i],), torch.float32)
                     if i in slices and slices[i][0].magnitude is not None else None for i in range(n))
        plans.append((store, slices, ranks, a, b, mags))
    token_plans = []
    for module, t in adapter.tokens.items():  # the adapter's rows, ids ascending
        store = layers[module].tokens
        k = t.ids.numel()
        added = max(0, int(t.ids.max()) + 1 - store.vocab) if k else 0
        token_plans.append((store, t, k, added, place((k,), torch.int32), place((k, store.dim), store.dtype)))
    # The small parts (each store's ranks and scales) last, side by side: written from the host in one copy.
    meta_start = offset
    meta = [(place((len(ranks),), torch.int32), place((len(ranks),), torch.float32)) for _, _, ranks, *_ in plans]

    # Laid out where the adapter's tensors are (a pushed adapter's may be on the GPU): the weights in one batched
    # copy there, the small parts in one copy from the host, then, from a GPU, one copy to the host.
    device = next((lora.A.device for lora in adapter.modules.values()), torch.device("cpu"))
    buffer = torch.zeros(max(offset, 1), dtype=torch.uint8, pin_memory=pin and device.type == "cpu", device=device)
    host_meta = torch.zeros(offset - meta_start, dtype=torch.uint8)
    dst, src = [], []
    tokens = []
    for store, t, k, added, ids1, rows in token_plans:
        dst += [ids1.view(buffer), rows.view(buffer)]
        src += [t.ids.to(device) + 1, t.rows]
        tokens.append(TokenImage(store, k, added, ids1, rows))
    stores = []
    for (store, slices, ranks, a, b, mags), (rank_part, scale_part) in zip(plans, meta):
        b_view = b.view(buffer)
        scales = [0.0] * len(ranks)
        for i, (lora, scale) in slices.items():
            lo, hi = store.out_offsets[i], store.out_offsets[i + 1]
            dst += [a[i].view(buffer), b_view[: ranks[i], lo:hi]]
            src += [lora.A.T if isinstance(store, LoraEmbedding) else lora.A, lora.B.T]
            if mags[i] is not None:
                dst.append(mags[i].view(buffer))
                src.append(lora.magnitude)
            scales[i] = scale
        rank_part.shifted(-meta_start).view(host_meta).copy_(torch.tensor(ranks, dtype=torch.int32))
        scale_part.shifted(-meta_start).view(host_meta).copy_(torch.tensor(scales, dtype=torch.float32))
        norm_scales = tuple(slices[i][0].scale if i in slices else 0.0 for i in range(len(ranks)))
        stores.append(StoreImage(store, ranks, a, b, rank_part, scale_part, mags, norm_scales))
    if dst:
        torch._foreach_copy_(dst, src)
    buffer[meta_start:offset].copy_(host_meta)
    if device.type != "cpu":
        buffer = torch.empty(buffer.shape, dtype=torch.uint8, pin_memory=pin).copy_(buffer)
    return SlotImage(adapter.name, buffer, tuple(stores), tuple(tokens))


def needs_growth(image: SlotImage) -> bool:
    """Whether a store lacks room for the image's ranks or token rows (or a head for its added tokens), or the
    DoRA buffer its magnitudes need."""
    return (any(max(s.ranks) > s.store.r_max or (s.dora and not s.store.dora_rows) for s in image.stores)
            or any(t.store.needs_growth(t.k, t.added) for t in image.tokens))


def grow_for(image: SlotImage) -> bool:
    """Grow every store the image needs more room in; True if any grew."""
    grew = needs_growth(image)
    for s in image.stores:
        s.store.grow(max(s.ranks))
        if s.dora:
            s.store.enable_dora()
    for t in image.tokens:
        t.store.grow(t.k, t.added)
    return grew


class SlotWriter:
    """Writes images into slots on the current stream: zero the slot in the stores a previous adapter used
    and this one does not, then the image. On a GPU, one host-to-device copy of the image into a staging
    buffer (one per stream, kept), then batched device copies and zeroing. The lists of views that
    scatter a layout into a slot are kept per (slot, signature, buffers), so rewriting a slot with an
    adapter of a known layout costs little host time, whatever the number of layers."""

    def __init__(self, max_plans: int = 64):
        self._staging: dict[int, torch.Tensor] = {}
        self._plans: OrderedDict[tuple, tuple] = OrderedDict()
        self._max_plans = max_plans
        self._layout_version = 0

    def write(self, slot: int, image: SlotImage | None, clear: Iterable[LoraSlots] = (), layout_version: int = 0):
        zeros = [t for store in clear for t in store.slot_tensors(slot) if t.numel()]
        if zeros:
            torch._foreach_zero_(zeros)
        if image is None:
            return
        device = image.stores[0].store.lora_B.device if image.stores else image.tokens[0].store.rows.device
        if layout_version != self._layout_version:  # views of reallocated buffers: drop them (and their memory)
            self._plans.clear()
            self._layout_version = layout_version
        # The CPU takes the same path (with a plain copy), so the tests on the CPU cover it.
        stream_id = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        staging = self._staging.get(stream_id)
        if staging is None or staging.numel() < image.nbytes:
            staging = torch.empty(max(image.nbytes, 2 * (0 if staging is None else staging.numel())),
                                  dtype=torch.uint8, device=device)
            self._staging[stream_id] = staging
            self._plans = OrderedDict((k, v) for k, v in self._plans.items() if k[2] != stream_id)
        staging[: image.nbytes].copy_(image.buffer, non_blocking=True)
        key = (slot, image.signature, stream_id)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(slot, image, staging)
            if len(self._plans) > self._max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        self._run(plan)
        for s in image.stores:  # DoRA: the rescale, from the slot's A and B now written
            for i, part in enumerate(s.magnitudes):
                if part is not None:
                    write_gain(s.store, slot, i, s.ranks[i], s.norm_scales[i], part.view(staging),
                               isinstance(s.store, LoraEmbedding))

    @property
    def staging_bytes(self) -> int:
        return sum(t.nbytes for t in self._staging.values())

    def drop_staging(self) -> None:
        """Free the staging buffers (and the views into them), e.g. after a one-off load."""
        self._staging.clear()
        self._plans.clear()

    @staticmethod
    def _run(plan) -> None:
        zeros, copies, strided = plan
        if zeros:
            torch._foreach_zero_(zeros)
        for dsts, srcs in copies:
            torch._foreach_copy_(dsts, srcs)
        for dst, src in strided:
            dst.copy_(src)


def _plan(slot: int, image: SlotImage, src: torch.Tensor) -> tuple:
    """(tensors to zero, [(destinations, sources)] per dtype, [(destination, source)] strided) that write
    ``image``, whose bytes are at the start of ``src``, into ``slot``: rows up to each rank, zeros beyond."""
    zeros: list[torch.Tensor] = []
    copies: dict[torch.dtype, tuple[list, list]] = defaultdict(lambda: ([], []))
    strided: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(dst: torch.Tensor, part: Part) -> None:
        dsts, srcs = copies[part.dtype]
        dsts.append(dst)
        srcs.append(part.view(src))

    for s in image.stores:
        store = s.store
        copy(store.ranks[slot], s.rank_part)
        copy(store.scales[slot], s.scale_part)
        if isinstance(store, LoraEmbedding):  # A is [S, vocab, R_max]: the rank columns are strided
            zeros.append(store.lora_A[slot])
            strided.append((store.lora_A[slot, :, : s.ranks[0]], s.a[0].view(src)))
        else:
            for i, (rank, part) in enumerate(zip(s.ranks, s.a)):
                rows = store.lora_A[slot, i]
                if part is not None:
                    copy(rows[:rank], part)
                zeros.append(rows[rank:])
        copy(store.lora_B[slot, : s.b.shape[0]], s.b)
        zeros.append(store.lora_B[slot, s.b.shape[0]:])
        if store.dora_rows:  # plain LoRA here; a DoRA slice's rescale is written after the copies
            zeros.append(store.dora[slot])
    for t in image.tokens:
        if t.k:
            copy(t.store.ids1[slot, : t.k], t.ids1)
            copy(t.store.rows[slot, : t.k], t.rows)
        zeros += [t.store.ids1[slot, t.k:], t.store.rows[slot, t.k:]]
    return [t for t in zeros if t.numel()], list(copies.values()), strided
