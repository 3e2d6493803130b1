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

__all__ = ["TP_PLAN", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "plan_model", "shard_model"]
