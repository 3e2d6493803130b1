"""Adapter pool, scheduler, model runner, engine and sampling (built on lorakit.layers)."""

from lorakit.engine.config import EngineConfig
from lorakit.engine.engine import LLM, AsyncEngine, CompletionOutput, Engine, RequestOutput
from lorakit.engine.pool import AdapterPool, PoolFull
from lorakit.engine.sampling import SamplingParams

__all__ = ["LLM", "AdapterPool", "AsyncEngine", "CompletionOutput", "Engine", "EngineConfig", "PoolFull", "RequestOutput",
           "SamplingParams"]
