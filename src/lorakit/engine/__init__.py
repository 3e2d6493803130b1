"""Adapter pool, scheduler, model runner and server (built on lorakit.layers)."""

from lorakit.engine.pool import AdapterPool, PoolFull

__all__ = ["AdapterPool", "PoolFull"]
