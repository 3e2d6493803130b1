"""``EngineStats``: the engine's gauges and counters as plain numbers, what metrics read (``Engine.stats()``; the
engine loop adds its step counters). Read without a lock from any thread: plain ints and copies of dicts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["EngineStats", "collect"]


@dataclass
class EngineStats:
    """The engine's gauges and counters, as of its last step (``gpu_seconds``: device time of the steps' forwards,
    0 where it is not measured; ``steps`` and ``step_seconds``: the engine loop's)."""

    pid: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    gpu_seconds: float = 0.0
    loads_by_adapter: dict[str, int] = field(default_factory=dict)
    evictions_by_adapter: dict[str, int] = field(default_factory=dict)
    residency: dict[str, str] = field(default_factory=dict)  # adapter -> "gpu", "cpu" or "disk"
    # the prefix cache, by adapter ("" for the base model): prompt tokens admitted, of them served from the cache
    prefix_prompt_tokens: dict[str, int] = field(default_factory=dict)
    prefix_cached_tokens: dict[str, int] = field(default_factory=dict)
    prefix_cached_blocks: int = 0  # KV blocks registered in the prefix cache (held or not)
    prefix_evictions: int = 0  # cached blocks evicted to make room
    # the requests running and waiting, by adapter ("" for the base model); the share of KV blocks requests hold; the
    # GPU adapter slots (max_loras): what routers that read vLLM's metrics ask of a server
    running_by_adapter: dict[str, int] = field(default_factory=dict)
    waiting_by_adapter: dict[str, int] = field(default_factory=dict)
    kv_usage: float = 0.0
    max_loras: int = 0


def collect(pool, scheduler, blocks, runner, max_loras: int) -> EngineStats:
    """The stats of an engine's parts (its step counters left 0). Per-adapter figures only for the adapters
    registered now (and the base model): their number is bounded by those, however many came and went."""
    residency = pool.residency()
    prefix = {name or "": list(counts) for name, counts in scheduler.prefix_stats.copy().items()
              if name is None or name in residency}
    loads, evictions = ({k: v for k, v in counts.copy().items() if k in residency}
                        for counts in (pool.stats.loads_by_adapter, pool.stats.evictions_by_adapter))
    running, waiting = list(scheduler.running), list(scheduler.waiting)  # copies: the engine's thread changes them
    return EngineStats(os.getpid(), len(running), len(waiting), 0, 0.0, float(getattr(runner, "gpu_seconds", 0.0)),
                       loads, evictions, residency, {k: v[0] for k, v in prefix.items()},
                       {k: v[1] for k, v in prefix.items()}, blocks.num_cached, blocks.evictions,
                       _by_adapter(running, residency), _by_adapter(waiting, residency),
                       1.0 - blocks.num_free / blocks.num_blocks, max_loras or 0)


def _by_adapter(requests, registered) -> dict[str, int]:
    """How many of ``requests`` use each adapter registered now ("": the base model)."""
    counts: dict[str, int] = {}
    for request in requests:
        name = request.adapter_name or ""
        if not name or name in registered:
            counts[name] = counts.get(name, 0) + 1
    return counts
