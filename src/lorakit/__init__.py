"""lorakit: serve many LoRA adapters on one base LLM at once.

Layers, from the bottom up: ``lorakit.ops`` (custom ops: shrink and expand), ``lorakit.layers``
(modules that call them, and ``patch``) and ``lorakit.engine`` (pool, scheduler, runner, server).
"""

from lorakit import ops
from lorakit.engine import AdapterPool, PoolFull
from lorakit.layers import LoraHandle, PatchConfig, patch

__version__ = "0.1.0"
__all__ = ["AdapterPool", "LoraHandle", "PatchConfig", "PoolFull", "ops", "patch"]
