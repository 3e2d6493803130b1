"""Running one model over several processes (one per GPU).

``tensor``: Megatron-style sharding of the base model (``load``: reading only this rank's slices); ``lora``: LoRA on
the sharded layers; ``executor`` and ``worker``: the engine's ranks, rank 0 and the processes it starts, driven by
one call protocol. ``parallel`` sits above ``layers`` and ``engine`` and imports them; neither imports it (the engine
imports ``executor`` only when it starts workers).
"""

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
