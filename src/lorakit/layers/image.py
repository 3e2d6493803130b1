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

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
from lorakit.peft.gil import pause

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


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each part of an adapter goes in its image: the same for every adapter of the same modules, ranks and
    scales (a training loop's pushes), so ``pack_adapter`` plans it once. ``copies``: (module, what, expert,
    destination) per source tensor, what in "A", "B", "magnitude"; each destination (dtype, shape, stride, offset in
    elements) is a strided view of the buffer the source is copied into as it is (B lands transposed). ``meta``: the
    ranks and scales, the image's bytes from ``meta_start`` on."""

    size: int
    stores: tuple[StoreImage, ...]
    copies: tuple[tuple[str, str, int | None, tuple], ...]
    holes: tuple[tuple, ...]  # destinations no copy writes, zeroed
    meta_start: int
    meta: torch.Tensor  # uint8, on the CPU


def plan_layout(modules: Mapping[str, ModuleLora], layers: Mapping[str, nn.Module], offset: int = 0) -> Layout:
    """The layout of an image of these modules' LoRA (each as its layer's shard holds it), from byte ``offset`` on."""
    by_store: dict[LoraSlots, dict[int, tuple]] = {}
    for module, lora in modules.items():  # the model's order, so equal targets and ranks give equal layouts
        store, index = store_of(layers[module])
        scale = lora.scale * store.embed_scale() if isinstance(store, LoraEmbedding) else lora.scale
        if isinstance(store, ExpertSlots):  # one slice per expert: its A [r, in] and B [out, r]
            by_store[store] = {e: (module, e, lora, scale) for e in range(store.num_experts)}
        else:
            by_store.setdefault(store, {})[index] = (module, None, lora, scale)

    holes = []  # what no copy writes: zeroed, so that equal adapters give equal bytes

    def place(shape, dtype, meta: bool = False) -> Part:
        nonlocal offset
        part = Part(offset, tuple(shape), dtype)
        offset += round_up(part.nbytes, _ALIGN)
        if offset > part.offset + part.nbytes and not meta:
            holes.append((torch.uint8, (offset - part.offset - part.nbytes,), (1,), part.offset + part.nbytes))
        return part

    def strided(part: Part, shape, stride, by: int = 0) -> tuple:
        return part.dtype, tuple(shape), tuple(stride), part.offset // part.dtype.itemsize + by

    plans, copies = [], []
    for store, slices in by_store.items():
        n = len(store.out_sizes)
        ranks = tuple(slices[i][2].rank if i in slices else 0 for i in range(n))
        embedding = isinstance(store, LoraEmbedding)
        a = tuple(
            None if i not in slices
            else place((store.in_features, ranks[i]) if embedding else (ranks[i], store.in_features), store.dtype)
            for i in range(n)
        )
        b = place((max(ranks), store.out_offsets[-1]), store.dtype)
        mags = tuple(place((store.out_sizes[i],), torch.float32)
                     if i in slices and slices[i][1] is None and slices[i][2].magnitude is not None else None
                     for i in range(n))
        for i in range(n):  # B's rows past a slice's rank (all of them where the adapter leaves the slice out)
            lo, hi = store.out_offsets[i], store.out_offsets[i + 1]
            if ranks[i] < b.shape[0]:
                holes.append(strided(b, (b.shape[0] - ranks[i], hi - lo), (b.shape[1], 1), ranks[i] * b.shape[1] + lo))
        for i, (module, expert, lora, _) in slices.items():
            rank, lo, hi = ranks[i], store.out_offsets[i], store.out_offsets[i + 1]
            # an embedding's A is held as A.T; every B as B.T, in the columns of its slice
            copies.append((module, "A", expert, strided(a[i], (rank, store.in_features), (1, rank)) if embedding
                           else strided(a[i], (rank, store.in_features), (store.in_features, 1))))
            copies.append((module, "B", expert, strided(b, (hi - lo, rank), (1, store.out_offsets[-1]), lo)))
            if mags[i] is not None:
                copies.append((module, "magnitude", expert, strided(mags[i], mags[i].shape, (1,))))
        plans.append((store, slices, ranks, a, b, mags))
    # The small parts (each store's ranks and scales) last, side by side: written from the host in one copy.
    meta_start = offset
    meta = torch.zeros(sum(round_up(4 * len(p[2]), _ALIGN) * 2 for p in plans), dtype=torch.uint8)
    stores = []
    for store, slices, ranks, a, b, mags in plans:
        rank_part, scale_part = place((len(ranks),), torch.int32, True), place((len(ranks),), torch.float32, True)
        scales = [slices[i][3] if i in slices else 0.0 for i in range(len(ranks))]
        rank_part.shifted(-meta_start).view(meta).copy_(torch.tensor(ranks, dtype=torch.int32))
        scale_part.shifted(-meta_start).view(meta).copy_(torch.tensor(scales, dtype=torch.float32))
        norm_scales = tuple(slices[i][2].scale if i in slices else 0.0 for i in range(len(ranks)))
        stores.append(StoreImage(store, ranks, a, b, rank_part, scale_part, mags, norm_scales))
    return Layout(offset, tuple(stores), tuple(copies), tuple(holes), meta_start, meta)


def layout_key(modules: Mapping[str, ModuleLora]) -> tuple:
    """What a layout depends on: each module's rank, scale, shapes and whether it has DoRA magnitudes."""
    return tuple((module, lora.rank, lora.scale, lora.A.shape, lora.B.shape, lora.magnitude is not None)
                 for module, lora in modules.items())


def pack_adapter(adapter: PeftAdapter, layers: Mapping[str, nn.Module], pin: bool,
                 layouts: Plans | None = None) -> SlotImage:
    """Lay ``adapter`` out as its slots hold it, cast to each store's dtype, in one (pinned) CPU buffer. ``layouts``:
    a cache of layouts by ``layout_key`` (a handle's), for adapters without token rows."""
    modules = {module: shard_lora(layer, adapter.modules[module])  # a tensor-parallel layer keeps its shard
               for module, layer in layers.items() if module in adapter.modules}
    offset = 0
    token_plans = []
    for module, t in adapter.tokens.items():  # the adapter's rows, ids ascending, first
        store = layers[module].tokens
        k = t.ids.numel()
        added = max(0, int(t.ids.max()) + 1 - store.vocab) if k else 0
        ids1 = Part(offset, (k,), torch.int32)
        offset += round_up(ids1.nbytes, _ALIGN)
        rows = Part(offset, (k, store.dim), store.dtype)
        offset += round_up(rows.nbytes, _ALIGN)
        token_plans.append((store, t, k, added, ids1, rows))
    if layouts is not None and not token_plans:
        layout = layouts.get(layout_key(modules), lambda: plan_layout(modules, layers))
    else:
        layout = plan_layout(modules, layers, offset)

    # Laid out where the adapter's tensors are (a pushed adapter's may be on the GPU): the weights in one batched
    # copy there, the small parts in one copy from the host, then, from a GPU, one copy to the host.
    device = next((lora.A.device for lora in adapter.modules.values()), torch.device("cpu"))
    buffer = torch.empty(max(layout.size, 1), dtype=torch.uint8, pin_memory=pin and device.type == "cpu",
                         device=device)
    typed = {torch.uint8: buffer}

    def view(dtype, shape, stride, at) -> torch.Tensor:
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer[: layout.meta_start - layout.meta_start % dtype.itemsize].view(dtype)
        return whole.as_strided(shape, stride, at)

    dst, src, tokens = [], [], []
    zeros = [view(*hole) for hole in layout.holes]
    for store, t, k, added, ids1, rows in token_plans:
        dst += [ids1.view(buffer), rows.view(buffer)]
        src += [t.ids.to(device) + 1, t.rows]
        tokens.append(TokenImage(store, k, added, ids1, rows))
        zeros += [buffer[end: round_up(end, _ALIGN)] for end in (ids1.offset + ids1.nbytes, rows.offset + rows.nbytes)]
    for module, what, expert, spec in layout.copies:
        pause()
        dst.append(view(*spec))
        tensor = getattr(modules[module], what)
        src.append(tensor if expert is None else tensor[expert])
    zeros = [z for z in zeros if z.numel()]
    if zeros:
        torch._foreach_zero_(zeros)
    if dst:
        torch._foreach_copy_(dst, src)
    buffer[layout.meta_start: layout.size].copy_(layout.meta)
    if device.type != "cpu":
        buffer = torch.empty(buffer.shape, dtype=torch.uint8, pin_memory=pin).copy_(buffer)
    return SlotImage(adapter.name, buffer, layout.stores, tuple(tokens))


class Plans:
    """What was planned for the last few shapes of a thing (a handle's image layouts, its pushed state dicts'
    checked structures), each planned once: any thread."""

    def __init__(self, size: int = 8):
        self._plans: OrderedDict[Hashable, Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Hashable, plan: Callable[[], Any]) -> Any:
        """The plan kept for ``key``, else ``plan()``'s (kept; the oldest dropped past ``size``)."""
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
        made = plan()
        with self._lock:
            self._plans[key] = made
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return made


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
