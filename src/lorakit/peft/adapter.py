"""What a PEFT adapter is once read: the model's modules it is held against (``BaseModule``), and what it gives
each of them (``ModuleLora``: A, B, rank, scale; ``ModuleTokens``: replaced token rows), whole (``PeftAdapter``) or
from its header alone (``AdapterInfo``). Plain data, checked on construction; reading them is read.py's job."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorakit.peft.config import _is_int


@dataclass(frozen=True)
class BaseModule:
    """A base-model module an adapter may target. linear: (in_features, out_features);
    embedding: (num_embeddings, embedding_dim). ``tokens``: "input" for the input embedding, "output" for the
    output head (the modules whose rows are tokens), else None. experts: a stacked MoE expert parameter
    (``<module>.<parameter>``, experts.py): (in_features, out_features) of each of its experts."""

    kind: str
    in_features: int
    out_features: int
    tokens: str | None = None
    num_experts: int = 1  # kind "experts": a stacked MoE parameter of this many experts, in -> out each

    @property
    def vocab(self) -> int:
        return self.in_features if self.kind == "embedding" else self.out_features

    @property
    def dim(self) -> int:
        return self.out_features if self.kind == "embedding" else self.in_features

    def __post_init__(self):
        if self.kind not in ("linear", "embedding", "experts"):
            raise ValueError(f"BaseModule.kind must be 'linear' or 'embedding' (or 'experts', a stacked MoE "
                             f"parameter), got {self.kind!r}")
        for field in ("in_features", "out_features", "num_experts"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"BaseModule.{field} must be a positive int, got {value!r}")


@dataclass(frozen=True, eq=False)
class ModuleLora:
    """One module's LoRA: A [rank, in_features], B [out_features, rank] (embedding: in = num_embeddings,
    out = embedding_dim), and the scale PEFT multiplies B @ A by; a DoRA module's ``magnitude``, float32
    [out_features] (None for plain LoRA)."""

    A: torch.Tensor
    B: torch.Tensor
    rank: int
    scale: float
    magnitude: torch.Tensor | None = None

    def __post_init__(self):
        # stacked MoE experts (experts.py): A [E, rank, in], B [E, out, rank]
        if (self.A.dim() not in (2, 3) or self.B.dim() != self.A.dim() or self.A.shape[-2] != self.rank
                or self.B.shape[-1] != self.rank or self.A.shape[:-2] != self.B.shape[:-2]):
            raise ValueError(f"ModuleLora needs A [rank, in] and B [out, rank] (experts: [E, rank, in] and "
                             f"[E, out, rank]) with rank={self.rank}, "
                             f"got A {tuple(self.A.shape)} and B {tuple(self.B.shape)}")
        if not math.isfinite(self.scale):
            raise ValueError(f"ModuleLora.scale must be finite, got {self.scale}")
        if self.magnitude is not None and tuple(self.magnitude.shape) != (self.B.shape[0],):
            raise ValueError(f"ModuleLora.magnitude must be [out_features={self.B.shape[0]}], "
                             f"got {tuple(self.magnitude.shape)}")


@dataclass(frozen=True, eq=False)
class ModuleTokens:
    """Rows an adapter puts in place of a token-indexed weight's (input embedding or output head):
    ids [k] (ascending, int64; ids past the base vocabulary are tokens the adapter adds) and rows [k, dim]."""

    ids: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class PeftAdapter:
    """A loaded adapter: ``modules`` (LoRA) and ``tokens`` (token rows) are keyed by the base model's
    fully-qualified module name."""

    name: str
    path: Path
    config: dict
    modules: dict[str, ModuleLora]
    tokens: dict[str, ModuleTokens] = field(default_factory=dict)

    def __post_init__(self):
        if not self.modules and not self.tokens:
            raise ValueError(f"adapter {self.name!r} at {self.path}: a PeftAdapter needs at least one module")

    @property
    def max_rank(self) -> int:
        return max((lora.rank for lora in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return (sum(lora.A.nbytes + lora.B.nbytes + (0 if lora.magnitude is None else lora.magnitude.nbytes)
                    for lora in self.modules.values())
                + sum(t.rows.nbytes for t in self.tokens.values()))


@dataclass(frozen=True)
class AdapterInfo:
    """What the config and the weights file's header say about an adapter, with no weights read:
    ``modules`` maps each targeted module to its (rank, scale); ``added_tokens``, the token ids past the base
    vocabulary the adapter defines (its requests may use them); ``invocation_tokens``, an activated LoRA's
    invocation sequence (None for a plain LoRA): see ``activation_start``; ``dora``, the modules it adapts with
    DoRA."""

    name: str
    path: Path
    config: dict
    modules: dict[str, tuple[int, float]]
    added_tokens: frozenset[int] = frozenset()
    invocation_tokens: tuple[int, ...] | None = None
    dora: frozenset[str] = frozenset()

    @property
    def max_rank(self) -> int:
        return max((rank for rank, _ in self.modules.values()), default=0)


def activation_start(token_ids: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Where an activated LoRA starts in ``token_ids``: the index of the last occurrence of ``invocation``
    (non-empty), None if it does not occur (PEFT's calculate_alora_offsets: start = len(token_ids) - offset)."""
    inv = list(invocation)
    if not inv:
        raise ValueError("activation_start needs a non-empty invocation sequence")
    ids, k = list(token_ids), len(inv)
    first = inv[0]
    for i in range(len(ids) - k, -1, -1):
        if ids[i] == first and ids[i: i + k] == inv:
            return i
    return None
