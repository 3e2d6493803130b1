"""Running one model over several processes (one per GPU). ``tensor``: Megatron-style sharding of the base model."""

from lorakit.parallel.tensor import (
    TP_PLAN,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    plan_model,
    shard_model,
)
from lorakit.parallel.load import load_sharded  # noqa: E402 - after tensor, which it builds on

__all__ = ["TP_PLAN", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "load_sharded", "plan_model", "shard_model"]
