"""Load one rank's shard of a transformers checkpoint, reading only its slices.

``shard_model`` takes a full model and keeps one rank's slices, so every rank holds the whole model in memory for a
moment: N copies on one host at tensor-parallel size N (8 x 140 GB for a 70B model in bf16 at tp=8).
``load_sharded(folder)`` builds the same sharded model without ever holding the whole. It builds the model with its
parameters on the meta device (buffers, e.g. rotary frequencies, are built as usual), shards it on the meta device
(``shard_model``), then reads each parameter's slice from the safetensors files (``safe_open(...).get_slice``:
only those bytes are read) into CPU memory. The result equals ``shard_model(from_pretrained(folder), rank, N)``
parameter for parameter (``tests/test_tp_load.py``).

Checkpoint keys must be the model's parameter names, as transformers saves them for the architectures ``TP_PLAN``
covers (Llama, Qwen2, Mistral). A parameter the files do not hold (and that is not tied to one they hold) is an
error naming it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from lorakit.layers.checkpoint import parameters_on_meta, safetensors_files, saved_scheme
from lorakit.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_model)


def _slice(module: nn.Module, attr: str) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's slice of ``module.attr`` in the full tensor; None for the whole."""
    if isinstance(module, ColumnParallelLinear):  # the vocab-parallel head too
        n = module.out_features
        return 0, module.rank * n, n
    if isinstance(module, RowParallelLinear):
        return (1, module.rank * module.in_features, module.in_features) if attr == "weight" else None
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.vocab_start, module.num_embeddings
    return None


def load_sharded(folder: str | Path, rank: int | None = None, world_size: int | None = None,
                 dtype: torch.dtype | str | None = None) -> nn.Module:
    """This rank's shard of the causal LM saved in ``folder`` (on the CPU), reading only its slices; ``rank`` and
    ``world_size`` default to the initialized ``torch.distributed`` group's (rank 0 of 1 without one)."""
    import transformers

    folder = Path(folder)
    if rank is None or world_size is None:
        joined = dist.is_initialized()
        rank = dist.get_rank() if joined else 0 if rank is None else rank
        world_size = dist.get_world_size() if joined else 1 if world_size is None else world_size
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config = transformers.AutoConfig.from_pretrained(folder)
    if saved_scheme(config) is not None:  # fp8 weights read as bf16 without their scales would be garbage
        raise ValueError(f"{folder} is saved quantized ({saved_scheme(config)}); tensor parallelism splits bf16 "
                         f"weights only: serve it on one GPU, or split its bf16 checkpoint")
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model.eval(), rank, world_size)
    files = safetensors_files(folder)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}  # id(param) -> (module, attr, full name), tied included
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr, f"{module_name}.{attr}" if module_name else attr))
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for places in owners.values():
            key = next((name for _, _, name in places if name in files), None)
            if key is None:
                raise ValueError(f"{folder}: the checkpoint has no tensor for {[n for _, _, n in places]}; "
                                 f"load the model with transformers and shard_model instead")
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, "pt"))
            module, attr, _ = next(p for p in places if p[2] == key)
            part = handles[path].get_slice(key)
            cut = _slice(module, attr)
            if cut is None:
                tensor = part[:]
            elif cut[0] == 0:
                tensor = part[cut[1]: cut[1] + cut[2]]
            else:
                tensor = part[:, cut[1]: cut[1] + cut[2]]
            param = nn.Parameter(tensor.to(dtype).contiguous(), requires_grad=False)
            for owner, name, _ in places:
                setattr(owner, name, param)
    return model
