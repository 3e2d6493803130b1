"""``lorakit.patch``: put LoRA slots into any transformers model, in place.

Like torchao's ``quantize_``: a recursive swap by fully-qualified name with an optional filter. Every
linear-like module (nn.Linear, GPT-2's Conv1D) and every nn.Embedding becomes a LoRA wrapper that keeps
the original as ``base_layer`` and calls it unchanged; a wrapper costs nothing until an adapter targets
it. The model's forward then takes ``lora_ids``. The returned ``LoraHandle`` holds what patching fixed
(the wrapped modules, the slot count); its ``SlotTable`` owns what changes (which adapter sits in which slot).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lorakit.layers.context import LoraContext
from lorakit.layers.embedding import LoraEmbedding
from lorakit.layers.handle import LoraHandle
from lorakit.layers.tokens import TokenRows
from lorakit.layers.linear import LoraLinear, LoraLinearGroup, LoraLinearMember, linear_shape
from lorakit.layers.moe import LoraExperts, expert_params, unsupported_experts
from lorakit.layers.sharded import ShardedLayer, full_features, is_vocab_parallel
from lorakit.ops import MAX_SLICES, KernelOptions

logger = logging.getLogger("lorakit.patch")


@dataclass(frozen=True)
class PatchConfig:
    """max_loras: adapter slots (adapters served at once). max_rank: the largest rank accepted.
    rank_multiple: padding granularity; a layer's max rank grows in these steps as adapters need.
    filter_fn(module, fqn): which modules get LoRA slots (default: every linear and embedding).
    max_token_rows: the most token rows (trainable or added tokens) one adapter may replace in the input
    embedding or the output head; each row costs hidden_size x dtype bytes in every slot.
    kernels: how the LoRA layers launch their kernels (``lorakit.ops.KernelOptions``: programmatic dependent
    launch, eager calls without the dispatcher); never what they compute."""

    max_loras: int = 8
    max_rank: int = 64
    rank_multiple: int = 16
    filter_fn: Callable[[nn.Module, str], bool] | None = None
    max_token_rows: int = 1024
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self):
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive int, got {self.max_loras!r}")
        if not isinstance(self.max_rank, int) or self.max_rank < 1:
            raise ValueError(f"max_rank must be a positive int, got {self.max_rank!r}")
        if self.rank_multiple not in (1, 2, 4, 8, 16, 32, 64):
            raise ValueError(f"rank_multiple must be a power of two up to 64, got {self.rank_multiple!r}")
        if not isinstance(self.max_token_rows, int) or self.max_token_rows < 0:
            raise ValueError(f"max_token_rows must be a non-negative int, got {self.max_token_rows!r}")
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"kernels must be a lorakit.ops.KernelOptions, got {self.kernels!r}")


def patch(model: nn.Module, max_loras: int = PatchConfig.max_loras, *, max_rank: int = PatchConfig.max_rank,
          rank_multiple: int = PatchConfig.rank_multiple, filter_fn: Callable[[nn.Module, str], bool] | None = None,
          max_token_rows: int = PatchConfig.max_token_rows,
          kernels: KernelOptions = PatchConfig.kernels) -> LoraHandle:
    """Give ``model`` LoRA slots in place and return the handle that loads adapters into them.

    After patching, ``model(..., lora_ids=handle.ids(["sql", None]))`` serves each sequence (or token)
    with its adapter; without ``lora_ids`` the model computes exactly what it did before.

    A tensor-parallel model (``lorakit.parallel.shard_model`` first, on every rank) gets LoRA on its column and
    row layers and on its vocab-parallel embedding and head, each rank's slots holding its shard (token rows: whole;
    see ``lorakit.parallel.lora``). Each sharded base layer names the wrapper it needs (``ShardedLayer``).
    """
    config = PatchConfig(max_loras, max_rank, rank_multiple, filter_fn, max_token_rows, kernels)
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError("this model is already patched by lorakit; use the handle patch() returned")
    ctx = LoraContext(config.max_loras, config.kernels)
    token_modules = _token_modules(model)
    linears, embeddings, vocab_parallel, experts = {}, {}, {}, {}
    for name, module in model.named_modules():
        if not name or (config.filter_fn is not None and not config.filter_fn(module, name)):
            continue
        if is_vocab_parallel(module):
            vocab_parallel[name] = module
        if linear_shape(module) is not None:
            linears[name] = module
        elif isinstance(module, (nn.Embedding, ShardedLayer)):  # a sharded layer not linear: an embedding
            embeddings[name] = module
        elif expert_params(module) is not None:  # stacked MoE experts (layers/moe.py)
            why = unsupported_experts(module)
            if why is None:
                experts[name] = module
            else:
                logger.warning("%s: not given expert LoRA slots: %s", name, why)
    if not linears and not embeddings and not experts:
        raise ValueError("found no nn.Linear, Conv1D or nn.Embedding module to patch (check filter_fn)")

    layers: dict[str, nn.Module] = {}
    grouped = set()
    # A layer that wants a wrapper of its own is never grouped (a row-parallel layer's LoRA all-reduces its shrink).
    groupable = {n: m for n, m in linears.items() if _wrapper(m) is None}
    for k, names in enumerate(_siblings(model, groupable)):
        group = LoraLinearGroup([linears[n] for n in names], ctx, config.max_loras, config.rank_multiple)
        model.get_submodule(names[0].rpartition(".")[0]).add_module(f"lorakit_group_{k}", group)
        for index, name in enumerate(names):
            layers[name] = LoraLinearMember(linears[name], group, index)
            grouped.add(name)
    for name, module in linears.items():
        if name not in grouped:
            wrapper = _wrapper(module) or LoraLinear
            layers[name] = wrapper(module, ctx, config.max_loras, config.rank_multiple)
    for name, module in embeddings.items():
        layers[name] = LoraEmbedding(module, ctx, config.max_loras, config.rank_multiple)
    for name, module in experts.items():
        layers[name] = LoraExperts(module, ctx, config.max_loras, config.rank_multiple)
    for name, role in token_modules.items():
        layer = layers.get(name)
        if isinstance(layer, (LoraEmbedding, LoraLinear)):
            features = full_features(layer)  # token rows are by global id: the whole vocabulary
            vocab, dim = features if role == "input" else features[::-1]
            layer.tokens = TokenRows(config.max_loras, vocab, dim, layer.dtype, layer.lora_B.device,
                                     config.rank_multiple)
            if role == "output" and type(layer) is LoraLinear:
                _take_softcap(model, layer)
    for name, wrapper in layers.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
    for name in experts:  # each adapted parameter is a store of its own, named as PEFT's target_parameters name it
        for param, store in layers.pop(name).slots.items():
            layers[f"{name}.{param}"] = store

    handle = LoraHandle(model, ctx, layers, config, vocab_parallel=set(vocab_parallel))
    model._lorakit_handle = handle
    model.register_forward_pre_hook(_take_lora_ids(ctx), with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: ctx.end())
    return handle


def slot_bytes(model: nn.Module, rank: int, rank_multiple: int = PatchConfig.rank_multiple) -> int:
    """Bytes one adapter slot of ``patch(model)`` takes once its buffers are padded to ``rank``: A and B of every
    linear and embedding it would wrap (token rows, which only adapters that add tokens fill, not counted). Read from
    the unpatched model, so a slot count can be chosen from memory before patching (``EngineConfig.max_loras``
    "auto")."""
    r = -(-rank // rank_multiple) * rank_multiple
    total = 0
    for name, module in model.named_modules():
        shape = linear_shape(module) if name else None
        if shape is None and isinstance(module, nn.Embedding):
            shape = (module.num_embeddings, module.embedding_dim)
        names = expert_params(module) if shape is None and name else None
        if names is not None:  # stacked experts: each parameter's [E, out, in], E experts' A and B
            weights = [getattr(module, n) for n in names]
            total += sum(w.shape[0] * (r * (w.shape[1] + w.shape[2]) * w.dtype.itemsize + 8) for w in weights)
        if shape is not None:
            weight = getattr(module, "weight", None)
            dtype = getattr(module, "compute_dtype", None) or (weight.dtype if weight is not None else None)
            itemsize = dtype.itemsize if dtype is not None and dtype.is_floating_point else 2
            total += r * (shape[0] + shape[1]) * itemsize + 8
    return total


def _wrapper(module: nn.Module) -> type[nn.Module] | None:
    """The LoRA wrapper a sharded base layer asks for, None for the usual one."""
    return module.lora_wrapper if isinstance(module, ShardedLayer) else None


def _take_softcap(model: nn.Module, head: LoraLinear) -> None:
    """A model that soft-caps its logits (Gemma 2: ``final_logit_softcapping``) has the head do it instead, so the
    columns a row may not take (another adapter's added tokens) are masked after the cap, not capped to -cap.
    The values are the model's own: the same operations on the same logits."""
    configs = {id(c): c for c in (getattr(model, "config", None), _text_config(model)) if c is not None}
    caps = {getattr(c, "final_logit_softcapping", None) for c in configs.values()} - {None}
    if len(caps) == 1:
        head.softcap = float(caps.pop())
        for c in configs.values():
            if getattr(c, "final_logit_softcapping", None) is not None:
                c.final_logit_softcapping = None


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else None


def _token_modules(model: nn.Module) -> dict[str, str]:
    """{name: "input" | "output"} of the model's input embedding and output head, where it has them."""
    found = {}
    for role, getter in (("input", "get_input_embeddings"), ("output", "get_output_embeddings")):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        name = next((n for n, m in model.named_modules() if m is module and n), None)
        if name is not None:
            found[name] = role
    return found


def _siblings(model: nn.Module, linears: dict[str, nn.Module]) -> list[list[str]]:
    """Linear modules under one parent that read the very same input tensor, seen in one forward pass
    on the model's dummy inputs (at most MAX_SLICES a group). Without a traced pass, no groups: every
    module then takes its own launches, which is slower but exact."""
    seen: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(name, args[0])  # the tensor itself, kept alive: identity is exact
        return hook

    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict) or not inputs:
        logger.info("%s has no dummy_inputs; sibling projections are not grouped", type(model).__name__)
        return []
    device = next(model.parameters()).device
    hooks = [module.register_forward_pre_hook(record(name)) for name, module in linears.items()]
    try:
        with torch.no_grad():
            model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    except Exception as e:  # a model that needs more than dummy inputs: correct without groups
        logger.info("tracing %s on dummy inputs failed (%s); no sibling groups",
                    type(model).__name__, e)
        return []
    finally:
        for hook in hooks:
            hook.remove()
    groups: list[list[str]] = []
    for name in linears:
        if name not in seen:
            continue
        parent = name.rpartition(".")[0]
        for group in groups:
            first = group[0]
            if (first.rpartition(".")[0] == parent and seen[first] is seen[name] and len(group) < MAX_SLICES
                    and linear_shape(linears[first])[0] == linear_shape(linears[name])[0]):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def _take_lora_ids(ctx: LoraContext):
    def hook(module, args, kwargs):
        step = kwargs.get("lorakit_step")  # a StepContext: left in kwargs for transformers to pass to attention
        ids = kwargs.pop("lora_ids", None) if step is None else step.lora_ids
        ctx.begin(ids, kwargs.get("logits_to_keep"))
        return args, kwargs

    return hook
