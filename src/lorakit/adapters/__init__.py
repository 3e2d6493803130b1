"""Adapters between disk and the GPU slots: ``Snapshot`` (a PEFT folder read once, checked and hashed) and
``AdapterPool`` (versions, the CPU tier, the slot table's one manager; ``AdapterRef``: a version as requests carry
it). Built on lorakit.layers; the engine's scheduler holds slots through it. ``hub``: models and adapters named by
Hugging Face hub id, downloaded once into the hub cache."""

from lorakit.adapters.pool import AdapterGone, AdapterPool, AdapterRef, PoolFull, TooManyVersions, VersionTaken
from lorakit.adapters.snapshot import Snapshot

__all__ = ["AdapterGone", "AdapterPool", "AdapterRef", "PoolFull", "Snapshot", "TooManyVersions", "VersionTaken"]
