"""The adapter pool: many registered adapters, a CPU cache of some, and the model's few GPU slots (S-LoRA's tiers).

disk: ``read`` (any thread) checks a PEFT folder in full into a ``Snapshot``, ``install`` makes it the name's current
version (registering a name again is a hot-swap). A request ``claim``s the version it was resolved to, once, and
runs on it to its end (``unclaim``): a replaced version lives on while claimed. CPU: packed ``SlotImage``s under a byte
budget, LRU. GPU: ``acquire(refs)`` gives a batch its slots, uploading on a side stream that the compute stream waits
on, and evicting what nobody holds or pinned; ``release`` gives them back. The pool is the one writer of the handle's
``SlotTable``; its own state sits behind one lock. How and why: docs/pool.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

import torch

from lorakit.adapters.snapshot import Changed, Snapshot, read_pushed, read_snapshot, reread
from lorakit.layers.handle import LoraHandle
from lorakit.layers.image import SlotImage, needs_growth
from lorakit.peft import AdapterError, AdapterInfo

logger = logging.getLogger("lorakit.pool")

__all__ = ["AdapterPool", "AdapterRef", "PoolFull", "Snapshot", "TooManyVersions", "check_name", "resolve"]

MAX_VERSIONS = 2  # versions of one name alive at once by default: the current one and one that requests still run on

T = TypeVar("T")


def _cpu_budget() -> int:
    """The CPU tier's default size: an eighth of the machine's memory, from 2 to 64 GiB (an 8B model's rank-64
    adapter is 320 MiB: sixteen of them pass 2 GiB, and each miss reads its files again on the engine thread)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2 << 30
    return max(2 << 30, min(ram // 8, 64 << 30))


CPU_BUDGET_BYTES = _cpu_budget()


_NAME = re.compile(r"[A-Za-z0-9_:+-][A-Za-z0-9._:+-]{0,127}")
NAME_RULE = "1 to 128 characters of letters, digits and . _ : + - (not starting with '.')"


def check_name(name) -> str:
    """``name`` if it is a valid adapter name (``NAME_RULE``: no paths, markup or control characters), else
    ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"an adapter name must be {NAME_RULE}, got {_shown(name)}")
    return name


class AdapterRef(msgspec.Struct, frozen=True, array_like=True):
    """A registered adapter's version, as the server resolved a request's ``model`` to it once, at the edge: every
    floor below carries this, not the name (``AdapterPool.claim`` checks once that the version still lives)."""

    name: str
    version: int
    sha256: str  # of its files as read


def resolve(registry: Mapping[str, T], name: str) -> T:
    """``registry[name]``, or the one "unknown adapter" error (AdapterError), naming the registered ones."""
    found = registry.get(name)
    if found is None:
        raise AdapterGone(f"unknown adapter {_shown(name)}; registered: {sorted(registry) or 'none'}")
    return found


def _version(current: Mapping[str, _Version], claimed: Mapping[tuple[str, int], _Version],
             adapter: AdapterRef | str) -> _Version:
    """A name's current version; for an ``AdapterRef``, that version: the current one, or a replaced one that
    requests still claim (AdapterError when it is gone: what a request prepared for it, its tokens, its grammar,
    may not fit the new one)."""
    if isinstance(adapter, str):
        return resolve(current, adapter)
    v = current.get(adapter.name)
    if v is not None and v.number == adapter.version:
        return v
    old = claimed.get((adapter.name, adapter.version))
    if old is None:
        now = "removed" if v is None else f"replaced by version {v.number}"
        raise AdapterGone(f"adapter {adapter.name!r} version {adapter.version} was {now} after this request "
                           f"was prepared for it; send it again")
    return old


def _shown(value) -> str:
    """``value`` for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(value)} characters)"


class VersionTaken(ValueError):
    """A push that names its version number, not above every number its name has had (numbers are never reused)."""


class AdapterGone(AdapterError):
    """The adapter a request names is not registered, or the version it names is gone (a server answers 404)."""


class TooManyVersions(AdapterError):
    """A new version of a name whose ``max_versions`` versions are all alive (the older ones still run requests):
    refused, never evicting a version in use; retry once those requests end."""


class PoolFull(Exception):
    """Every GPU slot the request would need is held by running requests or pinned; retry after a release.
    Not a RuntimeError: a real failure (a CUDA out-of-memory while growing the slots) must not read as this."""


@dataclass(eq=False)
class _Version:
    """One registered version of a named adapter, and where it lives."""

    name: str
    number: int
    snapshot: Snapshot
    nbytes: int  # of its packed image
    slot: int | None = None
    refs: int = 0  # holders of its slot (running requests)
    claims: int = 0  # requests that run on it, waiting or running (``claim``)
    retired: bool = False  # replaced or unregistered: it lives on while claimed
    kept: SlotImage | None = None  # its image held outside the CPU cache (claimed after retiring, or pushed)
    ready: object = None  # the upload's CUDA event until the compute stream has waited for it
    changed: str | None = None  # why its files no longer match the snapshot: it fails closed

    @property
    def info(self) -> AdapterInfo:
        return self.snapshot.info

    def __repr__(self) -> str:
        return f"{self.name!r} v{self.number}"


@dataclass
class PoolStats:
    """Counters since start, for logs and metrics. Only the engine thread writes them; another thread may read
    them without the lock (an int, or a copy of a by-adapter dict: ``dict(d)`` is one step under the GIL)."""

    loads: int = 0  # uploads into a GPU slot
    evictions: int = 0  # GPU slots taken from an unused adapter
    cpu_hits: int = 0
    cpu_misses: int = 0  # reads from disk
    cpu_evictions: int = 0
    swaps: int = 0  # registrations that replaced a version
    loads_by_adapter: dict[str, int] = field(default_factory=dict)  # by name, every version; kept after unregister
    evictions_by_adapter: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int | dict[str, int]]:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}


@dataclass
class ImageCache:
    """Packed adapter images on the CPU within ``budget`` bytes, the least recently used dropped first; ``reserved``
    of the budget is held by images kept outside it (pushed versions, replaced ones requests still run on)."""

    budget: int
    images: OrderedDict = field(default_factory=OrderedDict)  # key -> SlotImage, oldest first
    nbytes: int = 0
    reserved: int = 0

    def reserve(self, nbytes: int) -> list:
        """``nbytes`` more (or fewer) held outside; returns the keys dropped to make room."""
        self.reserved += nbytes
        return self._fit(0)

    def _fit(self, more: int) -> list:
        dropped = []
        while self.images and self.nbytes + self.reserved + more > self.budget:
            old, old_image = self.images.popitem(last=False)
            self.nbytes -= old_image.nbytes
            dropped.append(old)
        return dropped

    def get(self, key) -> SlotImage | None:
        image = self.images.get(key)
        if image is not None:
            self.images.move_to_end(key)
        return image

    def put(self, key, image: SlotImage) -> list:
        """Keep ``image`` (unless it alone is over the budget); returns the keys dropped to make room."""
        if key in self.images or image.nbytes + self.reserved > self.budget:
            return []
        dropped = self._fit(image.nbytes)
        self.images[key] = image
        self.nbytes += image.nbytes
        return dropped

    def pop(self, key) -> None:
        image = self.images.pop(key, None)
        if image is not None:
            self.nbytes -= image.nbytes


class AdapterPool:
    """Adapters by name over the GPU slots of one patched model (see the module docstring).

    ``cpu_budget_bytes``: the CPU cache's size (default ``CPU_BUDGET_BYTES``, 2 GiB). At start, the slot buffers
    at the model's ``max_rank`` must fit in free device memory, or the pool refuses to start and says what to lower.
    ``strict``: refuse adapters whose weights and config targets disagree (``handle.read_adapter``'s ``strict``).
    ``max_versions``: versions of one name alive at once (the current one, and replaced ones requests still run on);
    a new version past it is refused (``TooManyVersions``) until the oldest one's requests end.
    """

    def __init__(self, handle: LoraHandle, *, cpu_budget_bytes: int = CPU_BUDGET_BYTES, strict: bool = True,
                 max_versions: int = MAX_VERSIONS):
        if not isinstance(handle, LoraHandle):
            raise TypeError(f"AdapterPool needs the LoraHandle lorakit.patch returned, got {type(handle).__name__}")
        if not isinstance(cpu_budget_bytes, int) or cpu_budget_bytes < 0:
            raise ValueError(f"cpu_budget_bytes must be a non-negative int, got {cpu_budget_bytes!r}")
        if not isinstance(max_versions, int) or max_versions < 1:
            raise ValueError(f"max_versions must be an int >= 1, got {max_versions!r}")
        # Fixed at start.
        self.handle = handle
        self.device = handle.device
        self.strict = strict
        self.max_versions = max_versions
        self._check_memory(cpu_budget_bytes)
        self._pin = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Changes.
        self._lock = threading.RLock()
        self._current: dict[str, _Version] = {}
        self._claimed: dict[tuple[str, int], _Version] = {}  # retired versions requests still claim
        self._numbers: dict[str, int] = {}  # each name's last version number
        self.slots = handle.slots  # which version is in which slot: written only by this pool from now on
        self._lru: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recently used first
        self._cpu = ImageCache(cpu_budget_bytes)
        self._pins: set[str] = set()
        self._released: dict[int, object] = {}  # slot -> event recorded when its last holder released it
        self._inflight: list[tuple[object, SlotImage]] = []  # uploads whose source must stay alive
        self._reads: dict[_Version, Future] = {}  # CPU-cache misses a prefetch is reading again off this thread
        self._reader: ThreadPoolExecutor | None = None
        self.stats = PoolStats()
        self.slots.claim(self)
        logger.info("%d slots on %s; slot buffers %.1f MiB now, %.1f MiB at max_rank=%d; CPU cache "
                    "%.1f MiB", self.num_slots, self.device, handle.memory()["slot_buffers"] / 2**20,
                    handle.slot_bytes(handle.config.max_rank) / 2**20, handle.config.max_rank,
                    cpu_budget_bytes / 2**20)

    def __repr__(self) -> str:
        return f"AdapterPool({len(self._current)} adapters, {self.num_slots} slots)"

    @property
    def num_slots(self) -> int:
        return self.handle.num_slots

    # Registry.

    def register(self, name: str, path: str | Path) -> int:
        """Register the PEFT folder at ``path`` as ``name``, or as a new version of it (hot-swap: running
        requests finish on the version they hold): ``install(read(name, path))``. Returns the version number.
        On error nothing changes."""
        return self.install(self.read(name, path))

    def read(self, name: str, path: str | Path, roots: Sequence[str | Path] | None = None) -> Snapshot:
        """Read the PEFT folder at ``path`` for ``name`` once and check it in full, changing nothing (any thread; a
        server reads off its engine thread). The files are resolved (inside ``roots`` when given), copied
        privately while hashed, and everything is checked on that copy: the config, every key, module and shape,
        the rank, the size against the CPU budget, every value (NaN, overflow). Raises AdapterError (ValueError
        for a bad name)."""
        snapshot = read_snapshot(self.handle, check_name(name), path, roots, strict=self.strict, pin=self._pin,
                                 max_bytes=self._cpu.budget)
        snapshot.reader = self
        return snapshot

    def read_pushed(self, name: str, weights, config) -> Snapshot:
        """An adapter pushed from memory (``weights``: a PEFT state dict, tensors on any device, or a safetensors
        file's bytes; ``config``: its LoraConfig or dict), checked in full as ``read`` checks a folder, changing
        nothing (any thread). Its image stays in memory while the version lives: there is no file to read it again
        from. Raises AdapterError (ValueError for a bad name)."""
        snapshot = read_pushed(self.handle, check_name(name), weights, config, strict=self.strict, pin=self._pin,
                               max_bytes=self._cpu.budget)
        snapshot.reader = self
        return snapshot

    def push(self, name: str, weights, config, version: int | None = None) -> int:
        """``install(read_pushed(name, weights, config), version)``: a new version of ``name`` from memory; its
        number."""
        return self.install(self.read_pushed(name, weights, config), version)

    def install(self, snapshot: Snapshot, version: int | None = None) -> int:
        """Make a snapshot from ``read`` the current version of its name (a hot-swap when the name is registered:
        running requests finish on the version they hold; a pinned name's new version is loaded now when a slot is
        free). Cheap: reads nothing. Returns the version number: the name's last one plus one, or ``version`` when
        given (above every number the name has had: VersionTaken otherwise; replicas of a fleet number one push
        alike)."""
        if snapshot.reader is not self:
            raise ValueError(f"the snapshot of {snapshot.name!r} was read by another pool; read it with this one")
        with self._lock:
            image, snapshot.image = snapshot.image, None
            if image is None:
                raise ValueError(f"the snapshot of {snapshot.name!r} is installed already; read the folder again")
            old = self._current.get(snapshot.name)
            alive = [v for (name, _), v in self._claimed.items() if name == snapshot.name]
            if len(alive) + (old is not None and old.claims > 0) + 1 > self.max_versions:
                snapshot.image = image  # still installable once the old versions' requests end
                busy = ", ".join(f"{v.number} ({v.claims} request(s))" for v in [*alive, old])
                raise TooManyVersions(f"adapter {snapshot.name!r}: {self.max_versions} versions are alive already, "
                                      f"each running requests (versions {busy}); a new one would evict a version in "
                                      f"use: retry once they end, or raise max_versions "
                                      f"(lorakit serve: --max-versions-per-adapter)")
            freed = old.kept.nbytes if old is not None and old.claims == 0 and old.kept is not None else 0
            if not snapshot.files and self._cpu.reserved - freed + image.nbytes > self._cpu.budget:
                snapshot.image = image
                raise AdapterError(f"adapter {snapshot.name!r} pushed from memory: its {image.nbytes / 2**20:.1f} MiB "
                                   f"do not fit the CPU budget for adapters ({self._cpu.budget / 2**20:.1f} MiB), "
                                   f"{(self._cpu.reserved - freed) / 2**20:.1f} MiB of which hold pushed versions and "
                                   f"replaced ones requests still run on; unregister pushed adapters no longer "
                                   f"served, or raise cpu_budget_bytes")
            last = self._numbers.get(snapshot.name, 0)
            if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version <= last):
                raise VersionTaken(f"adapter {snapshot.name!r}: version {version!r} is not above its last version "
                                 f"{last}; version numbers are never reused: give one above {last}, or none")
            number = last + 1 if version is None else version  # never reused, even after an unregister
            version = _Version(snapshot.name, number, snapshot, image.nbytes)
            self._numbers[snapshot.name] = number
            self._current[snapshot.name] = version
            if old is not None:
                self.stats.swaps += 1
                self._retire(old)
            if snapshot.files:
                self._cache(version, image)
            else:  # pushed from memory: nothing to read it again from
                self._keep(version, image)
            if snapshot.name in self._pins:  # the new version takes the pin
                self._make_resident([version], evict=True, strict=False)
            logger.info("registered %r from %s (%.1f MiB, rank <= %d, sha256 %s)", version, snapshot.info.path,
                        image.nbytes / 2**20, snapshot.info.max_rank, snapshot.sha256)
            return version.number

    def unregister(self, name: str) -> None:
        """Forget ``name``: new requests cannot use it; running ones finish on the version they hold."""
        with self._lock:
            if name not in self._current:
                raise AdapterError(f"no adapter {_shown(name)} is registered (registered: {self._names()})")
            self._pins.discard(name)
            self._retire(self._current.pop(name))

    # Lookups from any thread without the lock (the engine thread may hold it while it reads an adapter from
    # disk): each reads a copy of the registry, taken in one step under the GIL.

    @property
    def adapters(self) -> dict[str, int]:
        """Registered names and their current version numbers."""
        return {name: v.number for name, v in self._current.copy().items()}

    @property
    def versions(self) -> dict[str, tuple[int, str]]:
        """Registered names and their current versions: (number, sha256 of the files as read)."""
        return {name: (v.number, v.snapshot.sha256) for name, v in self._current.copy().items()}

    def resolve(self, adapter: str | AdapterRef) -> Snapshot:
        """The snapshot of a name's current version (AdapterError for an unknown one); for an ``AdapterRef``, of that
        version while it lives (current, or claimed by requests; AdapterError once it is gone)."""
        return _version(self._current.copy(), self._claimed.copy(), adapter).snapshot

    def ref(self, adapter: str | AdapterRef) -> AdapterRef:
        """The current version of a name as a reference (AdapterError for an unknown one); a reference is checked to
        live still, and returned."""
        v = _version(self._current.copy(), self._claimed.copy(), adapter)
        return _ref(v)

    def live(self, name: str, number: int) -> AdapterRef:
        """Version ``number`` of ``name`` as a reference while it lives (the current one, or a replaced one requests
        still run on); AdapterError once it is gone."""
        current, claimed = self._current.copy(), self._claimed.copy()
        v = current.get(name)
        if v is None or v.number != number:
            v = claimed.get((name, number))
        if v is None:
            now = current.get(name)
            raise AdapterGone(f"adapter {name!r} has no version {number} alive"
                               f"{f'; its current version is {now.number}' if now is not None else ''}")
        return _ref(v)

    def claim(self, adapter: str | AdapterRef) -> tuple[AdapterRef, Snapshot]:
        """A request's hold on the version it runs on, taken once when it is admitted (a name: its current version;
        an ``AdapterRef``: that version while it lives, else AdapterError): the version, with its image, lives until
        every request that claims it has called ``unclaim``, whatever replaces or unregisters it meanwhile. Returns
        the version as a reference and its snapshot."""
        with self._lock:
            v = _version(self._current, self._claimed, adapter)
            v.claims += 1
            return _ref(v), v.snapshot

    def unclaim(self, adapter: AdapterRef) -> None:
        """A request that ``claim``ed ``adapter`` has ended: a retired version goes once its last claim does."""
        with self._lock:
            v = _version(self._current, self._claimed, adapter)
            if v.claims < 1:
                raise ValueError(f"unclaim({adapter}): {v!r} is not claimed; unclaim only what claim returned")
            v.claims -= 1
            if v.retired and v.claims == 0:
                self._drop(v)

    def snapshot(self, name: str) -> Snapshot | None:
        """The snapshot of ``name``'s current version (None when it is not registered): one object per version."""
        v = self._current.get(name)
        return None if v is None else v.snapshot

    def info(self, name: str) -> AdapterInfo:
        """What registration read of the current version of ``name`` (config, modules, added tokens)."""
        return self.resolve(name).info

    # Slots.

    def acquire(self, adapters: Sequence[AdapterRef | str | None]) -> list[int]:
        """Slot ids for a batch (one per adapter, -1 for None: the base model), loading what is missing. Each
        counts as one holder until ``release``. An ``AdapterRef`` means that version (current, or claimed); a name,
        its current version. The compute stream waits for the uploads (no host sync), so a forward queued afterwards
        reads complete slots. Raises ``PoolFull`` if slots are lacking and ``AdapterError`` for unknown, gone or
        unreadable adapters, changing nothing."""
        with self._lock:
            versions = self._lookup(adapters)
            wanted = list(dict.fromkeys(v for v in versions if v is not None))
            self._make_resident(wanted, evict=True, strict=True)
            for v in versions:
                if v is not None:
                    v.refs += 1
            for v in wanted:
                self._lru.move_to_end(v.slot)
                self._wait_ready(v)
            return [-1 if v is None else v.slot for v in versions]

    def release(self, slots: Iterable[int]) -> None:
        """Give back slots that ``acquire`` returned (one holder each; -1 is ignored)."""
        slots = list(slots)
        with self._lock:
            counts = Counter(s for s in slots if s != -1)
            for slot, n in counts.items():
                v = self.slots[slot] if isinstance(slot, int) and 0 <= slot < self.num_slots else None
                if v is None or v.refs < n:
                    raise ValueError(f"release({slots}): slot {slot} is not held {n} time(s) (held: "
                                     f"{0 if v is None else v.refs}); release only what acquire returned")
            for slot, n in counts.items():
                v = self.slots[slot]
                v.refs -= n
                if v.refs == 0:
                    self._released[slot] = self._record()
                    if v.retired and v.claims == 0:
                        self._free(v)

    def prefetch(self, adapters: Iterable[AdapterRef | str]) -> list[AdapterRef | str]:
        """Start loading adapters a scheduler will soon need, into free or evictable slots, without taking
        references or making the compute stream wait. ``adapters`` in order of need: each may take the slot of one
        that comes after it (held by nobody), never of one before it. Returns those of ``adapters`` now resident or
        on their way (an adapter the CPU tier dropped is read from disk again on a thread of its own, and loaded by
        the first prefetch after its read). Skips the rest when slots are lacking. Raises for unknown, gone or
        unreadable adapters."""
        adapters = list(adapters)
        with self._lock:
            found = self._lookup(adapters)
            versions = list(dict.fromkeys(v for v in found if v is not None))
            for i, v in enumerate(versions):
                if v.slot is None:
                    self._make_resident([v], evict=True, strict=False, keep=versions[:i])
            return [a for a, v in zip(adapters, found) if v.slot is not None or v in self._reads]

    def pin(self, name: str) -> int:
        """Keep ``name`` (its current version) in a GPU slot until ``unpin``; loads it now. Returns the slot."""
        with self._lock:
            (v,) = self._lookup([name])
            self._make_resident([v], evict=True, strict=True)
            self._pins.add(name)
            self._wait_ready(v)
            return v.slot

    def pinned(self, name: str) -> bool:
        """Whether ``name`` is pinned (``pin``) in a GPU slot."""
        return name in self._pins

    def unpin(self, name: str) -> None:
        with self._lock:
            if name not in self._pins:
                raise AdapterError(f"adapter {name!r} is not pinned (pinned: {sorted(self._pins) or 'none'})")
            self._pins.discard(name)

    def reserve(self, names: Iterable[str]) -> bool:
        """Grow the slot buffers now to the ranks these adapters need, reading no weights, so that CUDA graphs
        captured afterwards already fit them (growth later means recapturing). True if a buffer grew."""
        with self._lock:
            infos = [v.info for v in self._lookup(list(names)) if v is not None]
            if self._stream is not None:  # growth copies run on the compute stream, after uploads already issued
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            return self.slots.reserve(self.handle.ranks_by_store(infos))

    def ready(self, adapter: AdapterRef | str) -> bool:
        """Whether the adapter (that version, current or claimed; a name: its current version) is in a slot and
        its upload has landed (no waiting, no sync): a scheduler admits a request once its adapter is ready, so loads
        never stall the running batch."""
        with self._lock:
            (v,) = self._lookup([adapter])
            return v.slot is not None and (v.ready is None or v.ready.query())

    def slot_of(self, name: str) -> int | None:
        """The GPU slot of ``name``'s current version, None when it is not resident."""
        with self._lock:
            (v,) = self._lookup([name])
            return v.slot

    def synchronize(self) -> None:
        """Block the host until every upload issued so far has landed (tests, benchmarks)."""
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            self._inflight.clear()

    # Accounting.

    def residency(self) -> dict[str, str]:
        """Where each registered adapter's current version lives: "gpu" (in a slot, or on its way), "cpu" (in the
        CPU cache, or held in memory: a pushed one) or "disk". For metrics from another thread: it takes no lock, so each adapter's tier is as of
        some moment during the call."""
        current, images = self._current.copy(), self._cpu.images
        return {name: "gpu" if v.slot is not None else "cpu" if v in images or v.kept is not None else "disk"
                for name, v in current.items()}

    def memory(self) -> dict:
        """Bytes per tier, and what each slot holds."""
        with self._lock:
            buffers = self.handle.memory()
            slots = [
                None if v is None else {"adapter": v.name, "version": v.number, "bytes": v.nbytes, "holders": v.refs,
                                        "pinned": self._pinned(v)}
                for v in self.slots
            ]
            return {
                "gpu_slot_buffers": buffers["slot_buffers"],
                "gpu_slot_buffers_at_max_rank": self.handle.slot_bytes(self.handle.config.max_rank),
                "gpu_adapter_bytes": sum(v.nbytes for v in self.slots.tenants().values()),
                "gpu_staging_bytes": self.slots.staging_bytes,
                "cpu_bytes": self._cpu.nbytes,
                "cpu_budget": self._cpu.budget,
                "cpu_adapters": len(self._cpu.images),
                "kept_bytes": self._cpu.reserved,
                "registered": len(self._current),
                "claimed_old_versions": len(self._claimed),
                "slots": slots,
            }

    # Internals; every one runs under the lock.

    def _names(self) -> str:
        return ", ".join(sorted(self._current)) or "none"

    def _lookup(self, adapters: Sequence[AdapterRef | str | None]) -> list[_Version | None]:
        if isinstance(adapters, str):
            raise TypeError(f"pass a list of adapter names, got the string {adapters!r}")
        return [None if a is None else _version(self._current, self._claimed, a) for a in adapters]

    def _pinned(self, v: _Version) -> bool:
        return v.name in self._pins and self._current.get(v.name) is v

    def _make_resident(self, versions: list[_Version], evict: bool, strict: bool, keep: Sequence[_Version] = ()
                       ) -> None:
        """Load ``versions`` into slots: free ones first, then (``evict``) those of the least recently used adapters
        nobody holds or pinned, never one of ``versions`` or ``keep``. ``strict``: PoolFull when slots are lacking,
        else load the first that fit."""
        missing = [v for v in versions if v.slot is None]
        if not missing:
            return
        free = self.slots.free()
        keep = set(versions) | set(keep)
        victims = [s for s in self._lru if self.slots[s].refs == 0 and not self._pinned(self.slots[s])
                   and self.slots[s] not in keep] if evict else []
        room = len(free) + len(victims)
        if len(missing) > room:
            if strict:
                busy = ", ".join(f"{v!r} ({'pinned' if self._pinned(v) else f'{v.refs} holder(s)'})"
                                 for v in self.slots.tenants().values() if v not in keep)
                raise PoolFull(f"{len(missing)} adapter(s) ({', '.join(map(repr, missing))}) need a GPU slot but "
                               f"only {room} of {self.num_slots} can take one; the others hold {busy or 'this batch'}"
                               f"; retry after a release, or patch with a larger max_loras")
            missing = missing[:room]
        if not strict:  # a prefetch: what must be read from disk again is read off this thread, loaded once read
            missing = [v for v in missing if self._readable(v)]
        images = [self._image(v) for v in missing]  # may raise: nothing has changed yet
        for v, image in zip(missing, images):
            self._cache(v, image)
        grew = any(needs_growth(image) for image in images)
        if grew:  # before any eviction; the copies run on the compute stream, after uploads already issued
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            for image in images:
                self.slots.grow_for(image)
        for v, image in zip(missing, images):
            slot = free.pop(0) if free else victims.pop(0)
            victim = self.slots[slot]
            if victim is not None:
                logger.info("evicted %r from slot %d", victim, slot)
                self.stats.evictions += 1
                _count(self.stats.evictions_by_adapter, victim.name)
                self._free(victim)
            self._upload(v, slot, image, after_growth=grew)

    def _image(self, v: _Version) -> SlotImage:
        if v.kept is not None:
            return v.kept
        image = self._cpu.get(v)
        if image is not None:
            self.stats.cpu_hits += 1
            return image
        reading = self._reads.pop(v, None)
        if reading is None:
            self.stats.cpu_misses += 1
        if v.changed is None:
            try:  # a read off the thread already started is waited for, not started again
                return reading.result() if reading is not None else reread(self.handle, v.snapshot,
                                                                           strict=self.strict, pin=self._pin)
            except Changed as e:
                self._changed(v, e)
        raise AdapterError(v.changed)

    def _readable(self, v: _Version) -> bool:
        """Whether ``v``'s image is at hand (in the CPU cache, or read again off the engine thread: then cached);
        else its read starts on the reader thread, and a later prefetch finds it (a rank-64 8B adapter takes a
        second or two to read, hash and check: steps go on meanwhile). AdapterError when its files changed."""
        if v.kept is not None or v in self._cpu.images:
            return True
        if v.changed is not None:
            raise AdapterError(v.changed)
        reading = self._reads.get(v)
        if reading is None:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lorakit-adapter-read")
            self.stats.cpu_misses += 1
            self._reads[v] = self._reader.submit(reread, self.handle, v.snapshot, strict=self.strict, pin=self._pin)
            return False
        if not reading.done():
            return False
        del self._reads[v]
        try:
            image = reading.result()
        except Changed as e:
            self._changed(v, e)
            raise AdapterError(v.changed) from None
        self._cache(v, image)
        return v in self._cpu.images or self._keep_read(v, image)

    def _keep_read(self, v: _Version, image: SlotImage) -> bool:
        """An image read off the thread that the CPU cache cannot hold (larger than its budget): kept for the load."""
        self._reads[v] = _Done(image)
        return True

    def _changed(self, v: _Version, error: Changed) -> None:
        v.changed = (f"adapter {v.name!r} at {v.info.path}: changed on disk since it was registered ({error}); "
                     f"register it again")
        logger.warning("%s", v.changed)

    def _keep(self, v: _Version, image: SlotImage) -> None:
        """Hold ``v``'s image outside the CPU cache, within its budget (cached images dropped to make room)."""
        v.kept = image
        for old in self._cpu.reserve(image.nbytes):
            self.stats.cpu_evictions += 1
            logger.debug("dropped %r from the CPU cache", old)

    def _cache(self, v: _Version, image: SlotImage) -> None:
        v.nbytes = image.nbytes
        if v.kept is not None:
            return
        for old in self._cpu.put(v, image):
            self.stats.cpu_evictions += 1
            logger.debug("dropped %r from the CPU cache", old)

    def _upload(self, v: _Version, slot: int, image: SlotImage, after_growth: bool) -> None:
        if self._stream is None:
            self.slots.put(slot, v, image)
        else:
            compute = torch.cuda.current_stream(self.device)
            if after_growth:  # the regrown buffers are filled on the compute stream
                self._stream.wait_stream(compute)
            released = self._released.pop(slot, None)
            if released is not None:  # the slot's last reader has run
                self._stream.wait_event(released)
            with torch.cuda.stream(self._stream):
                self.slots.put(slot, v, image)
            v.ready = self._record(self._stream)
            self._inflight = [(e, i) for e, i in self._inflight if not e.query()] + [(v.ready, image)]
        v.slot = slot
        self._lru[slot] = None
        self.stats.loads += 1
        _count(self.stats.loads_by_adapter, v.name)
        logger.info("loaded %r into slot %d (%.1f MiB)", v, slot, image.nbytes / 2**20)

    def _wait_ready(self, v: _Version) -> None:
        if v.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(v.ready)
            v.ready = None

    def _record(self, stream=None):
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def _free(self, v: _Version) -> None:
        """Take v out of its slot (the slot's contents are overwritten by the next upload)."""
        if v.slot is not None:
            self.slots.vacate(v.slot)
            self._lru.pop(v.slot, None)
            v.slot = None
        v.ready = None

    def _retire(self, v: _Version) -> None:
        """``v`` is replaced or unregistered: gone now if no request claims it, else kept (its image out of the CPU
        cache's reach, read again first if the cache had dropped it) until the last claim ends."""
        v.retired = True
        if v.claims == 0:
            self._drop(v)
            return
        self._claimed[v.name, v.number] = v
        if v.kept is None:
            image = self._cpu.get(v)
            self._cpu.pop(v)
            if image is not None:
                self._keep(v, image)

    def _drop(self, v: _Version) -> None:
        """A retired version no request claims: its images go, and its slot once nobody holds it."""
        self._claimed.pop((v.name, v.number), None)
        self._cpu.pop(v)
        if v.kept is not None:
            self._cpu.reserve(-v.kept.nbytes)
            v.kept = None
        self._reads.pop(v, None)  # a read in flight finishes unseen
        if v.refs == 0:
            self._free(v)

    def _check_memory(self, cpu_budget: int) -> None:
        config = self.handle.config
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            need = self.handle.slot_bytes(config.max_rank) - self.handle.memory()["slot_buffers"]
            if need > free:
                raise MemoryError(
                    f"the LoRA slot buffers would need {need / 2**30:.2f} GiB more at max_rank={config.max_rank} "
                    f"with max_loras={config.max_loras}, but the GPU has {free / 2**30:.2f} GiB free; patch the "
                    f"model with a smaller max_rank or max_loras")
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
        if cpu_budget > ram // 2:
            raise MemoryError(f"cpu_budget_bytes={cpu_budget / 2**30:.1f} GiB is more than half of this machine's "
                              f"{ram / 2**30:.1f} GiB of memory; lower it")


class _Done:
    """A finished read, as a Future gives it."""

    def __init__(self, image: SlotImage):
        self.image = image

    def result(self) -> SlotImage:
        return self.image

    def done(self) -> bool:
        return True


def _ref(v: _Version) -> AdapterRef:
    return AdapterRef(v.name, v.number, v.snapshot.sha256)


def _count(counts: dict[str, int], name: str) -> None:
    counts[name] = counts.get(name, 0) + 1
