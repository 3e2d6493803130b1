"""The KV cache's blocks, and the prefix cache over them.

Each block is held by the requests that use it (a reference count); with the prefix cache on, a full block is also
registered under a hash chain over its tokens and the content hash of the weights that computed it (never a name),
so a hot-swap never reaches an old version's blocks. Keys, aLoRA's shared blocks, eviction: docs/engine.md.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from lorakit.ops import cdiv

BASE = b"base"  # "who" for blocks the base model's weights computed


def block_key(parent: bytes, who: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its predecessor's key (b"" for the first), who computed it, its tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(who).to_bytes(2, "little"))
    h.update(who)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """The KV cache's blocks: reference counts, a free list, and (``prefix_cache``) the registered full blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free = list(range(num_blocks - 1, -1, -1))  # never registered (or evicted); pop() gives low ids first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody: least recently released first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and the cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Registered blocks (held or not)."""
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_grow(self, blocks: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(blocks) <= self.num_free

    def grow(self, blocks: list[int], num_tokens: int) -> None:
        """Extend ``blocks`` in place to hold ``num_tokens`` tokens (call ``can_grow`` first)."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > self.num_free:
            raise RuntimeError(f"KV cache: {need} blocks needed, {self.num_free} free")
        for _ in range(need):
            blocks.append(self._take())

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        self._refs[block] = 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Give back a request's blocks (its hold on each), last first; registered ones stay cached."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)
        blocks.clear()

    # The prefix cache.

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``keys``."""
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` nobody holds (taking them leaves fewer free)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def hold(self, blocks: Sequence[int]) -> None:
        """Take a hold on cached blocks (from ``lookup``)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """Register a full block under ``key``; a no-op when another block already holds that content."""
        if self.prefix_cache and key not in self._block_of and block not in self._key_of:
            self._key_of[block] = key
            self._block_of[key] = block

    def check(self) -> None:
        """Every block is free, idle or held, exactly once (tests)."""
        free, idle = set(self._free), set(self._idle)
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert len(free) == len(self._free) and not (free & idle) and not (free & held) and not (idle & held)
        assert free | idle | held == set(range(self.num_blocks)), "a block is lost"
        assert idle <= set(self._key_of) and not (free & set(self._key_of))
        assert all(self._block_of[k] == b for b, k in self._key_of.items())
