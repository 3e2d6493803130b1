"""lorakit: serve many LoRA adapters on one base LLM at once.

Layers, from the bottom up: ``peft`` (reading and checking PEFT adapter folders), ``ops`` (custom ops), ``layers``
(modules that call them, and ``patch``), ``adapters`` (the adapter pool), ``engine`` (scheduler, runner: ``Engine``,
and ``LLM`` offline), ``parallel`` (tensor-parallel ranks), ``frontend`` (the engine's clients: in-process, or a core
process) and ``serve`` (the HTTP server).

The names below are imported when first used (PEP 562), so that ``import lorakit`` (and ``lorakit --version``) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_HOMES = {  # name -> the module that defines it
    "LLM": "lorakit.engine", "AdapterPool": "lorakit.engine", "Engine": "lorakit.engine",
    "EngineConfig": "lorakit.engine", "PoolFull": "lorakit.engine", "SamplingParams": "lorakit.engine",
    "AsyncEngine": "lorakit.frontend.async_engine", "LoraHandle": "lorakit.layers", "PatchConfig": "lorakit.layers",
    "patch": "lorakit.layers", "AdapterError": "lorakit.peft", "quantize": "lorakit.layers",
}
__all__ = ["LLM", "AdapterError", "AdapterPool", "AsyncEngine", "Engine", "EngineConfig", "LoraHandle", "PatchConfig",
           "PoolFull", "SamplingParams", "ops", "patch", "quantize"]

if TYPE_CHECKING:
    from lorakit import ops
    from lorakit.engine import LLM, AdapterPool, Engine, EngineConfig, PoolFull, SamplingParams
    from lorakit.frontend.async_engine import AsyncEngine
    from lorakit.layers import LoraHandle, PatchConfig, patch, quantize
    from lorakit.peft import AdapterError


def __getattr__(name: str):
    if name == "ops":
        value = importlib.import_module("lorakit.ops")
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'lorakit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
