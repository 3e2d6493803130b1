"""Token rows in a PEFT weights file, read as PEFT loads them: trainable-token rows (``trainable_token_indices``),
which replace chosen rows of the input embedding or output head; whole matrices (a ``modules_to_save`` copy, or the
resized embedding and head PEFT saves beside the adapter when a fine-tune grew the vocabulary), of which lorakit
keeps only the rows that differ from the model's and the rows past its vocabulary; trainable rows on top of a whole
matrix win, as PEFT writes them into the matrix it loaded. Semantics of peft 0.21 (tuners/trainable_tokens,
utils/save_and_load.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lorakit.peft.adapter import BaseModule, ModuleTokens
from lorakit.peft.config import AdapterError
from lorakit.peft.targets import TokenTargets

DELTA = ".token_adapter.trainable_tokens_delta"  # PEFT's TrainableTokensWrapper rows
TOKEN_BASE = ".token_adapter.base_layer.weight"  # the whole (resized) matrix under that wrapper
# What a modules_to_save module's keys hold: the copy, PEFT's second copy of it, the base weight it was made from.
FULL_KEYS = ((".modules_to_save.weight", "twin"), (".original_module.weight", "original"), (".weight", "full"))


@dataclass(frozen=True)
class TokenParts:
    """Where one token module's rows are in the file (keys, then header shapes or tensors): ``delta``, PEFT's
    trainable-token rows of ``ids``, which replace those rows; ``full``, a whole matrix that replaces the weight (a
    modules_to_save copy, or the resized matrix PEFT saves when the vocabulary grew); ``twin``, PEFT's second
    copy of a modules_to_save matrix; ``original``, its copy of the model's weight."""

    ids: list[int] | None = None
    delta: object = None
    full: object = None
    twin: object = None
    original: object = None


def parts_of(t: TokenParts) -> dict:
    """The parts of ``t`` the file holds: {part: key, shape or tensor}."""
    return {p: getattr(t, p) for p in ("delta", "full", "twin", "original") if getattr(t, p) is not None}


def token_key(rest: str, roles: set, tt: TokenTargets, targets: set) -> tuple[str, str | None] | None:
    """(module, part) of a key holding a token module's rows (part None: rows the config gives that module none);
    None for any other key."""
    for suffix, part in ((DELTA, "delta"), (TOKEN_BASE, "full")):
        module = rest[:-len(suffix)] if rest.endswith(suffix) else None
        if module in roles:
            return module, part if module in tt.trainable else None
    for suffix, part in FULL_KEYS:
        module = rest[:-len(suffix)] if rest.endswith(suffix) else None
        if module in tt.full:
            return module, part
    module = rest[:-len(".weight")] if rest.endswith(".weight") else None
    if module in roles and module not in tt.trainable and module not in targets:
        return module, "full"  # the resized matrix PEFT saves (save_embedding_layers) when the vocabulary grew
    return None


def added_ids(t: TokenParts, base: BaseModule) -> set[int]:
    """From shapes: the ids past the model's vocabulary ``t`` gives rows to (every row of a whole matrix past it,
    the trainable ids past it)."""
    added = set(range(base.vocab, t.full[0])) if t.full is not None else set()
    return added | ({i for i in t.ids if i >= base.vocab} if t.delta is not None else set())


def check_token_shapes(module: str, t: TokenParts, base: BaseModule, where: str) -> None:
    """``t`` holds shapes: rows as wide as the model's, and as many as the ids or the vocabulary need."""
    at = f"{where}: module {module!r}"
    for shape in parts_of(t).values():
        if len(shape) != 2 or shape[1] != base.dim:
            raise AdapterError(f"{at}: token rows have shape {list(shape)} but the model's rows are {base.dim} "
                               f"wide; was the adapter trained for another base model?")
    if t.delta is not None and t.delta[0] != len(t.ids):
        raise AdapterError(f"{at}: {len(t.ids)} trainable_token_indices but {t.delta[0]} saved rows; the weights "
                           f"file does not match its config")
    for part in ("full", "original"):
        shape = getattr(t, part)
        if shape is not None and shape[0] < base.vocab:
            raise AdapterError(f"{at}: the saved matrix has {shape[0]} rows, fewer than the model's vocabulary "
                               f"({base.vocab}); was the adapter trained for another base model?")
    if t.twin is not None and t.twin != t.full:
        raise AdapterError(f"{at}: the two saved copies of the module have shapes {list(t.full)} and "
                           f"{list(t.twin)}; the weights file is inconsistent, re-save the adapter")
    if t.full is not None and t.delta is not None and max(t.ids, default=-1) >= t.full[0]:
        raise AdapterError(f"{at}: trainable token id {max(t.ids)} is past the {t.full[0]} rows of the saved "
                           f"matrix; the weights file does not match its config")


def module_tokens(module: str, t: TokenParts, base: BaseModule, base_weight, dtype, where: str) -> ModuleTokens:
    """The rows an adapter replaces or adds, as PEFT loads them: of a whole saved matrix, the rows that differ from
    the model's and every row past its vocabulary; over those, the trainable-token rows (PEFT writes them into
    the loaded matrix, so they win)."""
    at = f"{where}: module {module!r}"
    check_token_shapes(module, replace(t, **{p: tuple(x.shape) for p, x in parts_of(t).items()}), base, where)
    for x in parts_of(t).values():
        if not x.dtype.is_floating_point:
            raise AdapterError(f"{at}: token rows must be floating-point, got {x.dtype}")
        if not torch.isfinite(x).all():
            raise AdapterError(f"{at}: token rows hold NaN or inf values; the adapter is broken, retrain or re-export")
    ids = torch.zeros(0, dtype=torch.int64)
    rows = torch.zeros(0, base.dim, dtype=dtype)
    if t.full is not None:
        if base_weight is None:
            raise AdapterError(f"{at}: a whole saved matrix of the module needs the model's weight to compare against")
        if t.twin is not None and not torch.equal(t.twin, t.full):
            raise AdapterError(f"{at}: the two saved copies of the module differ; the weights file is inconsistent, "
                               f"re-save the adapter")
        if t.original is not None and changed_rows(t.original, base_weight, base.vocab).numel():
            raise AdapterError(f"{at}: the saved copy of the model's weight differs from this model's; was the "
                               f"adapter trained for another base model?")
        ids = torch.cat([changed_rows(t.full, base_weight, base.vocab), torch.arange(base.vocab, t.full.shape[0])])
        rows = t.full[ids].to(dtype)
    if t.delta is not None:
        trained = torch.tensor(t.ids, dtype=torch.int64)
        keep = ~torch.isin(ids, trained)
        ids, rows = torch.cat([ids[keep], trained]), torch.cat([rows[keep], t.delta.to(dtype)])
    order = ids.argsort()
    rows = rows[order].contiguous()
    if not torch.isfinite(rows).all():
        raise AdapterError(f"{at}: token rows overflow {dtype}; load it in a wider dtype such as torch.float32")
    return ModuleTokens(ids[order].contiguous(), rows)


def changed_rows(matrix: torch.Tensor, base_weight: torch.Tensor, vocab: int, chunk: int = 8192) -> torch.Tensor:
    """Ids of the rows of ``matrix`` below ``vocab`` that differ from the model's weight, compared in the matrix's
    dtype a chunk of rows at a time (no CPU copy of a whole vocabulary-sized weight)."""
    found = []
    for start in range(0, vocab, chunk):
        stop = min(start + chunk, vocab)
        rows = base_weight[start:stop].detach().to("cpu", matrix.dtype)
        found.append((matrix[start:stop] != rows).any(dim=1).nonzero()[:, 0] + start)
    return torch.cat(found)
