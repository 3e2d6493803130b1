"""Which adapter each adapter slot holds: the one owner of the slot state that changes.

``patch`` fixes the slot buffers' layout (the stores, their shapes, the slot count); everything that changes
as adapters come and go lives here and changes only through ``put`` and ``vacate``: the tenant (adapter and
version) in each slot, what its write left in the stores (ranks, scales, A and B rows, token rows), the
padded rank the stores have grown to (``layout_version`` counts reallocations). The adapter pool
(``lorakit.adapters.pool``) is the usual manager of a table; ``LoraHandle.load_adapter`` is a thin one without a
CPU tier. A table has at most one manager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from lorakit.layers.image import SlotImage, SlotWriter, grow_for
from lorakit.layers.slots import LoraSlots


class Tenant(Protocol):
    """What a slot holds: an adapter's name and version number."""

    name: str
    number: int


@dataclass(frozen=True)
class Loaded:
    """A tenant loaded directly through ``LoraHandle.load_adapter`` (no versions: always 1)."""

    name: str
    number: int = 1


class SlotTable:
    """The tenants of ``num_slots`` adapter slots over a patched model's stores (see the module docstring)."""

    def __init__(self, num_slots: int):
        self._tenants: list[Tenant | None] = [None] * num_slots
        self._written: list[set[LoraSlots]] = [set() for _ in range(num_slots)]  # stores a slot's write touched
        self._writer = SlotWriter()
        self.layout_version = 0  # bumped whenever a slot buffer is reallocated (rank growth)
        self.manager: object | None = None
        # Told of every write before it is made, as the call that makes it: mirror(method name, *args, **kwargs). A
        # tensor-parallel executor sets it on rank 0 to make the same call on every other rank's table
        # (lorakit.parallel.executor).
        self.mirror: Callable[..., None] | None = None

    def __len__(self) -> int:
        return len(self._tenants)

    def __getitem__(self, slot: int) -> Tenant | None:
        return self._tenants[slot]

    def __iter__(self) -> Iterator[Tenant | None]:
        return iter(self._tenants)

    def tenants(self) -> dict[int, Tenant]:
        """The occupied slots and their tenants."""
        return {slot: t for slot, t in enumerate(self._tenants) if t is not None}

    def free(self) -> list[int]:
        """The empty slots, in order."""
        return [slot for slot, t in enumerate(self._tenants) if t is None]

    def claim(self, manager: object) -> None:
        """Make ``manager`` the table's one manager; the table must be empty and unmanaged."""
        if self.manager is not None:
            raise ValueError(f"this model's adapter slots are already managed by {self.manager!r}")
        if self.tenants():
            names = sorted(t.name for t in self.tenants().values())
            raise ValueError(f"the handle already holds adapters {names}; create the pool on a freshly patched "
                             f"model (or unload them first) so it owns every slot")
        self.manager = manager

    def check_unmanaged(self, what: str) -> None:
        if self.manager is not None:
            raise RuntimeError(f"this model's adapter slots are managed by {self.manager!r}; use its register/acquire "
                               f"instead of handle.{what}")

    def grow_for(self, image: SlotImage) -> bool:
        """Make room in the padded ranks for ``image`` (on the current stream); True if a buffer grew, which a
        compiled model sees as a new shape (one recompile) and a captured CUDA graph must be recaptured for."""
        grew = grow_for(image)
        self.layout_version += grew
        return grew

    def reserve(self, ranks: Mapping[LoraSlots, int]) -> bool:
        """Grow stores to the given ranks ahead of any upload (loaded slots keep their values); True if any grew."""
        if self.mirror is not None:
            self.mirror("reserve", ranks)
        grew = any(rank > store.r_max for store, rank in ranks.items())
        for store, rank in ranks.items():
            store.grow(rank)
        self.layout_version += grew
        return grew

    def put(self, slot: int, tenant: Tenant, image: SlotImage) -> None:
        """Write ``image`` into ``slot`` on the current stream (growing the stores first if it needs room) and
        record ``tenant`` there, clearing what the slot's previous write left in stores this one does not touch.
        Nothing may be reading the slot meanwhile."""
        if self.mirror is not None:
            self.mirror("put", slot, tenant, image)
        self.grow_for(image)
        new = {s.store for s in image.stores} | {t.store for t in image.tokens}
        self._write(slot, image, new)
        self._tenants[slot] = tenant

    def vacate(self, slot: int, *, zero: bool = False) -> None:
        """Record ``slot`` as empty. Its contents stay until the next ``put`` (no request may read it then),
        unless ``zero``: then every store it wrote is cleared now, on the current stream."""
        if self.mirror is not None:
            self.mirror("vacate", slot, zero=zero)
        if zero:
            self._write(slot, None, set())
        self._tenants[slot] = None

    def _write(self, slot: int, image: SlotImage | None, new: set) -> None:
        self._writer.write(slot, image, [s for s in self._written[slot] if s not in new], self.layout_version)
        self._written[slot] = new

    @property
    def staging_bytes(self) -> int:
        """Device memory kept for staging uploads (about the largest adapter uploaded)."""
        return self._writer.staging_bytes

    def drop_staging(self) -> None:
        self._writer.drop_staging()
