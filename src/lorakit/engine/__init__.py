"""Adapter pool, scheduler, model runner and server (built on lorakit.layers)."""
