"""Scheduler, model runner, sampling and the engine's step (built on lorakit.layers and lorakit.adapters)."""

from lorakit.engine.config import EngineConfig
from lorakit.engine.engine import Engine
from lorakit.engine.llm import LLM
from lorakit.engine.outputs import CompletionOutput, RequestOutput
from lorakit.adapters.pool import AdapterPool, PoolFull
from lorakit.engine.sampling import SamplingParams

__all__ = ["LLM", "AdapterPool", "CompletionOutput", "Engine", "EngineConfig", "PoolFull", "RequestOutput",
           "SamplingParams"]
