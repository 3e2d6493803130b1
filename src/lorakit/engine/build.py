"""The model side of building an engine: the model loaded (or its tensor-parallel workers started), quantized,
patched, its runner made, and the config's "auto" sizes resolved from the model and the device's free memory.

Nothing here keeps state: ``Engine.__init__`` calls these once and holds what they return.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from lorakit.engine.config import EngineConfig
from lorakit.engine.runner import ModelRunner, kv_shape
from lorakit.layers.handle import LoraHandle
from lorakit.layers.patch import patch, slot_bytes
from lorakit.layers.quant import QuantizedLinear, quantize, weight_bytes
from lorakit.ops import cdiv

__all__ = ["build_runner", "eos_token_id", "load_model", "patch_model", "patched", "quantized", "resolve_config",
           "slot_count", "start_workers"]

logger = logging.getLogger("lorakit.engine")

# The device memory free after the weights is one budget: the KV cache and the adapter slots (at max_rank) together
# take at most KV_SHARE of it by default, and slots chosen automatically at most ADAPTER_SHARE (the rest is
# activations, CUDA graphs and the allocator's slack). On the CPU, CPU_MEMORY stands for the free memory.
KV_SHARE, ADAPTER_SHARE, CPU_MEMORY = 0.5, 0.1, 4 << 30
AUTO_MAX_LORAS = 64  # the most slots "auto" gives: past it an adapter's slot would rarely be used before eviction


def load_model(model: nn.Module | Callable[[], nn.Module], config: EngineConfig, device: str | None
               ) -> tuple[nn.Module, EngineConfig]:
    """One process's model (built by ``model`` when it is a function, moved to ``device``), quantized as the config
    asks, and the config with its slot count resolved."""
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be a torch.nn.Module or a function that builds one, got "
                            f"{type(model).__name__}")
        model = model()
        model = model.to(device) if device is not None else model
    quantized(model, config)
    return model, slot_count(model, config)


def start_workers(factory, config: EngineConfig, device: str | None):
    """The tensor-parallel executor (``lorakit.parallel.executor``): every rank builds the model with ``factory``,
    keeps its shard, quantizes and patches it as rank 0 (``executor.model``) is about to; and the config with its
    slot count resolved. The workers are stopped if any of it fails."""
    n = config.tensor_parallel_size
    if isinstance(factory, nn.Module) or not callable(factory):
        raise ValueError(f"tensor_parallel_size={n} needs a picklable function that builds the model, not a "
                         f"{type(factory).__name__}: each of the {n} processes builds the full model with it and "
                         f"keeps its shard (e.g. functools.partial(lorakit.parallel.load_sharded, path))")
    # The engine's one import of lorakit.parallel (the package above it), made only when it starts workers.
    from lorakit.parallel.executor import Executor, model_device

    workers = Executor(factory, n, model_device(device))
    try:
        if config.quantization is not None:  # every rank its shard, at once: row shards all-reduce their fp8 scales
            workers.call("rank", "quantize", config.quantization)
            quantized(workers.model, config)
        config = slot_count(workers.model, config)  # from rank 0's shard: every rank's slots hold a shard alike
        workers.call("rank", "patch", config)  # every worker patches its shard as rank 0 is about to
    except BaseException:
        workers.close()
        raise
    return workers, config


def patch_model(model: nn.Module, config: EngineConfig, workers=None) -> tuple[LoraHandle, EngineConfig, int]:
    """The model patched (``patched``; with ``workers``, every rank's slot writes mirrored), the config with its
    sizes resolved (``resolve_config``), and the model's vocabulary size."""
    handle = patched(model, config)
    if workers is not None:  # the pool's slot writes are made on every rank
        workers.mirror_slots(handle)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return handle, resolve_config(config, model, text_config, handle.device), text_config.vocab_size


def build_runner(model: nn.Module, handle: LoraHandle, config: EngineConfig, workers=None) -> ModelRunner:
    """The model runner (KV cache, CUDA graphs) at the config's sizes; with ``workers``, every rank builds its own
    (and captures its graphs) at once."""
    settings = dict(num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                    max_seq_len=config.max_seq_len, cuda_graphs=config.cuda_graphs, compile=config.compile,
                    graph_sizes=config.graph_sizes, graph_token_sizes=config.graph_token_sizes,
                    max_num_batched_tokens=config.max_num_batched_tokens, base_twins=config.base_twins,
                    fuse_siblings=config.fuse_siblings)
    mirror = None if workers is None else workers.mirror_runner(settings)
    return ModelRunner(model, handle, **settings, mirror=mirror)


def eos_token_id(model: nn.Module, tokenizer) -> int | list[int] | None:
    """The model's end of sequence token(s): its generation config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return eos if eos is not None else getattr(tokenizer, "eos_token_id", None)


def quantized(model: nn.Module, config: EngineConfig) -> None:
    """Quantize the model's base weights as the config asks, in place (before it is patched); a model already
    quantized with that scheme is left as it is."""
    scheme = config.quantization
    if scheme is None:
        return
    schemes = {m.scheme for m in model.modules() if isinstance(m, QuantizedLinear)}
    if schemes:
        if schemes != {scheme}:
            raise ValueError(f"the model's layers are already quantized as {sorted(schemes)}, but the engine config "
                             f"asks for quantization={scheme!r}; give the engine an unquantized model, or that scheme")
        return
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError(f"quantization={scheme!r} needs an unpatched model (the LoRA wrappers must wrap the "
                         f"quantized layers): give the engine the model before lorakit.patch, or quantize it with "
                         f"lorakit.quantize before patching")
    count = quantize(model, scheme)
    size = weight_bytes(model)
    logger.info("quantization %s: %d linear layers, %.2f GiB of weights (%.2f GiB quantized, %.2f GiB in %s)", scheme,
                count, sum(size.values()) / 2**30, size["quantized"] / 2**30, size["other"] / 2**30,
                str(next(model.parameters()).dtype).removeprefix("torch."))


def patched(model: nn.Module, config: EngineConfig) -> LoraHandle:
    """The model's handle: patched now with the config's layout, or already patched with the same one."""
    handle = getattr(model, "_lorakit_handle", None)
    if handle is None:
        return patch(model, config.max_loras, max_rank=config.max_rank)
    if not isinstance(handle, LoraHandle):
        raise TypeError("the model's lorakit handle is not a LoraHandle")
    have = (handle.config.max_loras, handle.config.max_rank)
    if have != (config.max_loras, config.max_rank):
        raise ValueError(f"the model is already patched with max_loras={have[0]}, max_rank={have[1]}, but the engine "
                         f"config asks for max_loras={config.max_loras}, max_rank={config.max_rank}; give the engine "
                         f"the values the model was patched with, or an unpatched model")
    return handle


def free_memory(device: torch.device) -> int:
    """The free memory sizing reads: the GPU's; on the CPU, CPU_MEMORY (or less where less is available), so that
    the KV cache and slots stay the size one model needs, not a share of the machine's memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return min(CPU_MEMORY, available_cpu_memory() or CPU_MEMORY)


def available_cpu_memory() -> int | None:
    """The machine's available memory (Linux's MemAvailable), in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def slot_count(model: nn.Module, config: EngineConfig) -> EngineConfig:
    """The config with ``max_loras`` "auto" (None) resolved: the slots of a model already patched, else as many as
    ADAPTER_SHARE of the free memory holds at max_rank, from 1 to AUTO_MAX_LORAS."""
    if config.max_loras is not None:
        return config
    handle = getattr(model, "_lorakit_handle", None)
    if isinstance(handle, LoraHandle):
        return dataclasses.replace(config, max_loras=handle.num_slots)
    per_slot = max(slot_bytes(model, config.max_rank), 1)
    free = free_memory(next(model.parameters()).device)
    count = max(1, min(AUTO_MAX_LORAS, int(ADAPTER_SHARE * free) // per_slot))
    logger.info("max_loras auto: %d slots of %.1f MiB at max_rank=%d (%s)", count, per_slot / 2**20,
                config.max_rank, free_text(free, next(model.parameters()).device))
    return dataclasses.replace(config, max_loras=count)


def free_text(free: int, device: torch.device) -> str:
    """The log's words for ``free`` (what sizing read): on the CPU, the machine's available memory beside it."""
    if device.type == "cuda":
        return f"{free / 2**30:.1f} GiB free"
    available = available_cpu_memory()
    shown = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
    return f"{shown} available on the CPU, sized from {free / 2**30:.1f} GiB"


def resolve_config(config: EngineConfig, model: nn.Module, text_config, device: torch.device) -> EngineConfig:
    """The config with max_seq_len and num_blocks resolved from the model and the device, checked against them."""
    limit = getattr(text_config, "max_position_embeddings", None) or 4096
    max_seq_len = min(limit, 4096) if config.max_seq_len is None else config.max_seq_len
    if max_seq_len > limit:
        raise ValueError(f"max_seq_len must be in [2, {limit}] (the model's max_position_embeddings), "
                         f"got {max_seq_len}")
    block_size = config.block_size
    blocks_per_seq = cdiv(max_seq_len, block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        layers, kv_heads, head_dim = kv_shape(model)
        per_block = 2 * layers * block_size * kv_heads * head_dim * next(model.parameters()).element_size()
        handle = model._lorakit_handle  # the slot buffers still to grow to max_rank come out of the same budget
        slots = max(0, handle.slot_bytes(config.max_rank) - handle.memory()["slot_buffers"])
        budget = int(KV_SHARE * free_memory(device)) - slots
        num_blocks = max(min(config.max_num_seqs * blocks_per_seq, budget // per_block), blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_seq_len={max_seq_len} "
                         f"({blocks_per_seq} blocks of {block_size}); raise num_blocks or lower max_seq_len")
    return dataclasses.replace(config, max_seq_len=max_seq_len, num_blocks=num_blocks)
