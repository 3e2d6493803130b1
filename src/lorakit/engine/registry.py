"""The engine's adapters by name: each name's current version in the pool, with the tokenizer its folder carries.

Reading and checking a folder (``read``) changes nothing and may run on any thread; making it the current version
(``install``) is cheap and runs where the engine steps. The scheduler's side of an unload (its waiting requests) is
the engine's: ``Engine.unregister_adapter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lorakit.adapters.pool import AdapterPool, AdapterRef
from lorakit.adapters.snapshot import Snapshot, read_tokenizer

__all__ = ["AdapterRegistry", "CheckedAdapter"]


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter folder read and checked in full by ``AdapterRegistry.read``, ready for ``install``."""

    snapshot: Snapshot
    tokenizer: object  # the folder's tokenizer, False when it has none


class AdapterRegistry:
    """The adapters of one pool, each version with its folder's tokenizer (``tokenizer``: the engine's own, for the
    base model and for adapters that carry none)."""

    def __init__(self, pool: AdapterPool, tokenizer=None):
        self.pool, self.tokenizer = pool, tokenizer
        self._tokenizers: dict[Snapshot, object] = {}  # an adapter version -> its folder's tokenizer, or False

    def read(self, name: str, path: str | Path, roots: Sequence[str | Path] | None = None) -> CheckedAdapter:
        """Read an adapter folder once and check it in full: the pool's snapshot of its config and weights
        (``AdapterPool.read``) and its tokenizer, every file inside ``roots`` when given. Changes nothing, so any
        thread may call it. Raises AdapterError (ValueError for a bad name)."""
        snapshot = self.pool.read(name, path, roots)
        return CheckedAdapter(snapshot, read_tokenizer(name, snapshot.info.path, roots))

    def read_pushed(self, name: str, weights, config) -> CheckedAdapter:
        """An adapter pushed from memory (a PEFT state dict or a safetensors file's bytes, and its LoraConfig or
        config dict), checked in full (``AdapterPool.read_pushed``); it carries no tokenizer. Changes nothing."""
        return CheckedAdapter(self.pool.read_pushed(name, weights, config), False)

    def install(self, checked: CheckedAdapter, version: int | None = None) -> int:
        """Make a checked adapter the current version of its name (reads nothing); its version number (``version``
        when given: ``AdapterPool.install``)."""
        snapshot = checked.snapshot
        self._tokenizers[snapshot] = checked.tokenizer  # first: the new version is never found without it
        try:
            version = self.pool.install(snapshot, version)
        except BaseException:
            self._tokenizers.pop(snapshot, None)
            raise
        self._forget(snapshot.name)
        return version

    def register(self, name: str, path: str | Path) -> int:
        """``install(read(name, path))``: register (or hot-swap) an adapter; its version number."""
        return self.install(self.read(name, path))

    def push(self, name: str, weights, config, version: int | None = None) -> int:
        """``install(read_pushed(name, weights, config), version)``: a new version of ``name`` from memory; its
        number."""
        return self.install(self.read_pushed(name, weights, config), version)

    def unregister(self, name: str) -> None:
        """Forget ``name`` in the pool (running requests keep their version's slot until they end)."""
        self.pool.unregister(name)
        self._forget(name)

    def tokenizer_for(self, adapter: AdapterRef | str | None):
        """The tokenizer of an adapter whose folder carries one (it may add tokens), else the engine's: a lookup,
        safe from any thread."""
        return self.tokenizer_of(None if adapter is None else self.pool.resolve(adapter))

    def tokenizer_of(self, snapshot: Snapshot | None):
        if snapshot is None:
            return self.tokenizer
        tokenizer = self._tokenizers.get(snapshot)
        if tokenizer is None:  # registered on the pool directly: read it now
            tokenizer = self._tokenizers[snapshot] = read_tokenizer(snapshot.name, snapshot.info.path)
        return tokenizer or self.tokenizer

    def _forget(self, name: str) -> None:
        """Drop the tokenizers of ``name``'s versions but the current one (running requests keep theirs: their
        output processor holds it)."""
        current = self.pool.snapshot(name)
        for snapshot in [s for s in list(self._tokenizers) if s.name == name and s is not current]:
            self._tokenizers.pop(snapshot, None)
