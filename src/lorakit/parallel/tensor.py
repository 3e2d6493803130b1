"""Megatron-style tensor parallelism for the base model: each rank keeps a slice of every projection.

``shard_model`` swaps, in place, each ``nn.Linear`` / ``nn.Embedding`` whose name ends in a ``TP_PLAN``
entry for a module holding only this rank's slice of the full weight. Per decoder layer that costs one
all-reduce after the attention output projection and one after the MLP down projection; the embedding
costs one all-reduce and the head one all-gather of the logits. Inference only: the collectives are not
autograd-aware.

The sharded modules implement ``lorakit.layers.sharded.ShardedLayer``, the contract ``lorakit.patch`` reads: their
unsharded shape, how an adapter's matrices are cut to this rank's shard, and the LoRA wrapper each needs
(``lorakit.parallel.lora``). ``layers`` imports nothing from ``parallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lorakit.layers.quant import FROM_LINEAR, Fp8Linear, QuantizedLinear, check_scheme, shape_reason
from lorakit.layers.sharded import ShardedLayer, ShardedLinear
from lorakit.parallel.lora import LoraRowParallelLinear, LoraVocabParallelHead

# Module name (last component) -> how it is split. One table for every architecture: matched by name and
# module type, never by model class.
#   column: split out_features; the output stays local (this rank's heads / intermediate), no collective.
#   row:    split in_features; each rank's partial output is all-reduced, then the bias is added once.
#   vocab:  split the vocabulary rows (embedding: all-reduce; head: all-gather of the logits).
TP_PLAN: dict[str, str] = {
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row",
    "w1": "column", "w3": "column", "w2": "row",  # the same MLP under Mixtral/InternLM2 names (untested)
    "embed_tokens": "vocab", "lm_head": "vocab",
}

# Fused projections pack several outputs (q|k|v, gate|up) along out_features; a plain column split would
# hand a rank all of q and none of v. They need a per-part split, not done yet.
FUSED = ("qkv_proj", "gate_up_proj", "c_attn", "W_pack", "query_key_value", "wqkv")


def _group_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


class ColumnParallelLinear(ShardedLinear):
    """Rows [rank * n, (rank + 1) * n) of the weight (and bias): y_local = x @ W_local.T + b_local. No collective."""

    def __init__(self, base: nn.Linear, rank: int, world_size: int, weight: nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features // world_size
        self.rank, self.world_size = rank, world_size
        start = rank * self.out_features
        self.weight = weight if weight is not None else _shard(base.weight, 0, start, self.out_features)
        self.bias = None if base.bias is None else _shard(base.bias, 0, start, self.out_features)
        self.quantized: QuantizedLinear | None = None  # the shard's weight (and bias) once quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.quantized is None else self.quantized(x)

    def quantize(self, scheme: str) -> str | None:
        """This rank's rows quantized: per output channel (fp8) and per group of inputs (int4), the result is the
        unsharded layer's quantization, cut."""
        if self.vocab_parallel:
            return "the vocabulary-parallel head keeps its dtype"
        self.quantized = _quantized(self, scheme, with_bias=True)
        return None if self.quantized is not None else shape_reason(self.in_features, self.out_features, scheme)

    @property
    def full_features(self) -> tuple[int, int]:
        """(in_features, out_features) of the unsharded layer: what an adapter's A and B are shaped for."""
        return self.in_features, self.out_features * self.world_size

    def lora_shard(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA (A [r, in], B [out, r]): A whole (the shrink reads the full input), the
        rows of B that give this rank's output slice. No collective: the delta lands on the local output."""
        return A, B.narrow(0, self.rank * self.out_features, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local), bias={self.bias is not None}"


class RowParallelLinear(ShardedLinear):
    """Columns [rank * n, (rank + 1) * n) of the weight; the input is this rank's slice (a column layer's output).

    y = all_reduce(x_local @ W_local.T) + b: the bias is added once, after the sum, not once per rank.
    """

    lora_wrapper = LoraRowParallelLinear  # its LoRA all-reduces the shrink: never grouped with siblings

    def __init__(self, base: nn.Linear, rank: int, world_size: int, group=None):
        super().__init__()
        self.in_features, self.out_features = base.in_features // world_size, base.out_features
        self.rank, self.world_size, self.group = rank, world_size, group
        self.weight = _shard(base.weight, 1, rank * self.in_features, self.in_features)
        self.bias = None if base.bias is None else _shard(base.bias, 0, 0, self.out_features)
        self.quantized: QuantizedLinear | None = None  # the shard's weight once quantized (the bias stays here)

    def quantize(self, scheme: str) -> str | None:
        """This rank's input columns quantized as the unsharded layer would be: for fp8 with the whole row's scale
        (each channel's largest magnitude, all-reduced over the ranks), for int4 in groups of 128 inputs (the
        shard's in_features must hold whole groups)."""
        absmax = None
        if scheme == "fp8" and shape_reason(self.in_features, self.out_features, scheme) is None:
            absmax = self.weight.detach().float().abs().amax(dim=1)
            if self.world_size > 1:
                dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=self.group)
        self.quantized = _quantized(self, scheme, with_bias=False, absmax=absmax)
        return None if self.quantized is not None else shape_reason(self.in_features, self.out_features, scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.quantized is None else self.quantized(x)
        if self.world_size > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    @property
    def full_features(self) -> tuple[int, int]:
        """(in_features, out_features) of the unsharded layer: what an adapter's A and B are shaped for."""
        return self.in_features * self.world_size, self.out_features

    def lora_shard(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA (A [r, in], B [out, r]): the columns of A matching this rank's input slice,
        B whole. The shrink's T x r partials are then summed over the ranks (see lorakit.parallel.lora)."""
        return A.narrow(1, self.rank * self.in_features, self.in_features), B

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, bias={self.bias is not None}"


class VocabParallelEmbedding(ShardedLayer):
    """Rows [start, start + n) of the embedding table; other ids look up zeros here, and the all-reduce fills them."""

    vocab_parallel = True  # its LoRA is the ordinary LoraEmbedding, holding A's rows of this rank's vocabulary

    def __init__(self, base: nn.Embedding, rank: int, world_size: int, group=None, weight: nn.Parameter | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = base.num_embeddings // world_size, base.embedding_dim
        self.vocab_start = rank * self.num_embeddings
        self.rank, self.world_size, self.group = rank, world_size, group
        self.weight = weight if weight is not None else _shard(base.weight, 0, self.vocab_start, self.num_embeddings)

    @property
    def full_num_embeddings(self) -> int:
        """The unsharded vocabulary (ids are global: each rank looks up the ones in its range)."""
        return self.num_embeddings * self.world_size

    @property
    def full_features(self) -> tuple[int, int]:
        """(num_embeddings, embedding_dim) of the unsharded table: what an adapter's A and B are shaped for."""
        return self.full_num_embeddings, self.embedding_dim

    def lora_shard(self, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an embedding LoRA (A [r, vocab], B [dim, r]): A's columns of its vocabulary rows."""
        return A.narrow(1, self.vocab_start, self.num_embeddings), B

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(y, group=self.group)
        return y

    def extra_repr(self) -> str:
        end = self.vocab_start + self.num_embeddings
        return f"vocab=[{self.vocab_start}, {end}), embedding_dim={self.embedding_dim}"


class VocabParallelHead(ColumnParallelLinear):
    """The output head split by vocabulary rows; the local logits are all-gathered to the full vocabulary."""

    vocab_parallel = True
    lora_wrapper = LoraVocabParallelHead  # the delta goes on the local logits, before the gather

    def __init__(self, base: nn.Linear, rank: int, world_size: int, group=None, weight: nn.Parameter | None = None):
        super().__init__(base, rank, world_size, weight)
        self.world_size, self.group = world_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(self.local(x))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's logits: [..., vocab / world_size]."""
        return super().forward(x)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's local logits, in vocabulary order: [..., vocab]."""
        if self.world_size == 1:
            return y
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


def _quantized(layer: ShardedLinear, scheme: str, with_bias: bool,
               absmax: torch.Tensor | None = None) -> QuantizedLinear | None:
    """``layer``'s weight (and, ``with_bias``, its bias) as a quantized linear layer, its own weight then that
    layer's (so code that reads ``layer.weight`` finds the stored tensor); None where the shape does not allow it."""
    check_scheme(scheme)
    if layer.quantized is not None or shape_reason(layer.in_features, layer.out_features, scheme) is not None:
        return layer.quantized
    linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    linear.weight = layer.weight
    linear.bias = layer.bias if with_bias else None
    quantized = FROM_LINEAR[scheme](linear) if absmax is None else Fp8Linear.from_linear(linear, absmax)
    layer.compute_dtype = layer.weight.dtype
    layer.weight = quantized.weight
    if with_bias:
        layer.bias = quantized.bias
    return quantized


def _shard(full: torch.Tensor, dim: int, start: int, length: int) -> nn.Parameter:
    """A copy of ``full[start:start + length]`` along ``dim`` (a copy, so the full tensor can be freed)."""
    part = full.detach().narrow(dim, start, length)
    return nn.Parameter(part.clone(memory_format=torch.contiguous_format), requires_grad=False)


def plan_model(model: nn.Module, world_size: int) -> dict[str, str]:
    """The modules ``shard_model`` would swap, by fully-qualified name -> style; raises ValueError if unsafe.

    Refuses: a fused projection, a subclass whose forward a swap would drop, a row layer whose input would
    not be split, a dimension or a head count that does not divide by ``world_size``, and a model in which
    no attention or MLP projection matched (it would run unsharded on every rank).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in FUSED and isinstance(module, nn.Linear):
            raise ValueError(f"{name} is a fused projection, which tensor parallelism does not split yet; "
                             "load the model with separate projections (q_proj, k_proj, v_proj, gate_proj, up_proj)")
        style = TP_PLAN.get(leaf)
        if style is None or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if type(module) not in (nn.Linear, nn.Embedding):
            raise ValueError(f"{name} is a {type(module).__name__}, whose own forward a tensor-parallel swap would "
                             f"drop; only plain nn.Linear / nn.Embedding are split: remove '{leaf}' from TP_PLAN "
                             "or add a parallel module for this type")
        if isinstance(module, nn.Embedding) and style != "vocab":
            raise ValueError(f"{name} is an nn.Embedding but TP_PLAN says '{style}'; embeddings split as 'vocab'")
        size = module.in_features if style == "row" else (
            module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features)
        if size % world_size:
            what = {"column": "out_features", "row": "in_features", "vocab": "vocabulary size"}[style]
            raise ValueError(f"{name}: {what} {size} does not divide by the tensor-parallel size {world_size}; "
                             "use a tensor-parallel size that divides it")
        plan[name] = style

    if not any(style in ("column", "row") for style in plan.values()):
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:4]
        raise ValueError(f"no attention or MLP projection of this model matches TP_PLAN (its linear layers include "
                         f"{linears}); it would run unsharded on every rank: add their names to TP_PLAN")

    for parent_name, parent in model.named_modules():
        children = {n: plan.get(f"{parent_name}.{n}" if parent_name else n) for n, _ in parent.named_children()}
        if "row" in children.values() and "column" not in children.values():
            raise ValueError(f"{parent_name} has a row-parallel layer but no column-parallel sibling to split its "
                             "input; add the projections feeding it to TP_PLAN")
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, int) and "column" in children.values():
            for child, style in children.items():
                heads = getattr(parent, child).out_features // head_dim if style == "column" else 0
                if heads % world_size:
                    count = "num_key_value_heads" if child in ("k_proj", "v_proj") else "num_attention_heads"
                    raise ValueError(f"{parent_name}.{child}: {heads} heads ({count}) do not split over "
                                     f"tensor-parallel size {world_size}; use a tensor-parallel size that divides "
                                     f"{heads}")
    return plan


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Keep only this rank's slice of every ``TP_PLAN`` module of ``model`` (full weights in, shards out), in place.

    Every rank calls this on the same full model. Tied weights (the head sharing the embedding's table) stay
    tied: both modules hold the same shard. Attention needs no patching in transformers 5.x: it reshapes with
    ``(*input_shape, -1, head_dim)``, and ``num_key_value_groups`` (heads per kv head) is the same on every
    rank because both head counts are divided by ``world_size``. ``model.config`` keeps the full model's numbers.
    """
    plan = plan_model(model, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if world_size > 1 and _group_size(group) != world_size:
        raise ValueError(f"world_size={world_size} but the process group has {_group_size(group)} ranks; "
                         "pass the tensor-parallel group (or init_process_group with this world size)")
    shards: dict[int, nn.Parameter] = {}  # id(full weight) -> its vocab shard, so a tied head reuses the embedding's
    for name, style in plan.items():
        parent_name, _, leaf = name.rpartition(".")
        parent, base = model.get_submodule(parent_name), model.get_submodule(name)
        tied = shards.get(id(base.weight))
        if style == "column":
            new = ColumnParallelLinear(base, rank, world_size)
        elif style == "row":
            new = RowParallelLinear(base, rank, world_size, group)
        elif isinstance(base, nn.Embedding):
            new = VocabParallelEmbedding(base, rank, world_size, group, weight=tied)
        else:
            new = VocabParallelHead(base, rank, world_size, group, weight=tied)
        if style == "vocab":
            shards[id(base.weight)] = new.weight
        setattr(parent, leaf, new)
    model._lorakit_tensor_parallel = (rank, world_size)  # read by the engine's runner (KV heads per rank)
    return model
