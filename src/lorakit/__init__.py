"""lorakit: serve many LoRA adapters on one base LLM at once.

Layers, from the bottom up: ``lorakit.ops`` (custom ops: shrink and expand), ``lorakit.layers``
(modules that call them, and ``patch``), ``lorakit.engine`` (pool, scheduler, runner: ``Engine``, and ``LLM``
for offline generation) and ``lorakit.serve`` (the OpenAI-compatible HTTP server that ``lorakit serve`` starts).
"""

from lorakit import ops
from lorakit.engine import LLM, AdapterPool, Engine, EngineConfig, PoolFull, SamplingParams
from lorakit.frontend.async_engine import AsyncEngine
from lorakit.layers import LoraHandle, PatchConfig, patch
from lorakit.layers.adapter import AdapterError

__version__ = "0.1.0"
__all__ = ["LLM", "AdapterError", "AdapterPool", "AsyncEngine", "Engine", "EngineConfig", "LoraHandle", "PatchConfig",
           "PoolFull", "SamplingParams", "ops", "patch"]
