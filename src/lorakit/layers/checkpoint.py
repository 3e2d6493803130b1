"""Load a transformers checkpoint with quantized base weights, a tensor at a time: a bf16 checkpoint quantized as it
is read (``--quantization fp8 | int4``), or one saved quantized (compressed-tensors fp8, as llm-compressor writes
it: ``RedHatAI/...-FP8-dynamic``), read as saved.

The model is built with its parameters on the meta device (buffers, e.g. rotary frequencies, are built as usual);
then each tensor is read from the safetensors files (``safe_open``) and moved to the device, and each linear layer to
be quantized is quantized there as soon as its weight arrives. The full-precision model never exists on the device
(nor on the host beyond one tensor): a 70B model in fp8 loads on one 141 GB GPU from its 140 GB bf16 checkpoint.

A saved fp8 checkpoint's layers are the ones that have a ``weight_scale`` tensor (its ``ignore`` list, the head
usually, is saved in bf16 and loaded so). Its ``input_scale`` tensors are not read: lorakit is weight-only, and
activations stay in the model's dtype (more precise than the checkpoint's fp8 activations; outputs differ from a
W8A8 engine's by that rounding). What is refused, by name: a saved scheme other than per-channel or per-tensor fp8
weights (int4 packed, block-wise fp8, GPTQ, AWQ, bitsandbytes), and a checkpoint that is not safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from lorakit.layers.quant import FROM_LINEAR, Fp8Linear, check_scheme, shape_reason

logger = logging.getLogger("lorakit.quant")


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def safetensors_files(folder: Path) -> dict[str, Path]:
    """{checkpoint key: the safetensors file holding it}."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json; quantized and "
                                f"sharded loading read safetensors checkpoints only")
    with safe_open(single, "pt") as f:
        return {key: single for key in f.keys()}


def saved_scheme(config) -> str | None:
    """The scheme a checkpoint's config.json says its weights are saved in ("fp8"), None for full precision; raises
    ValueError naming what lorakit does not read."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
            if scheme not in (("float", 8, "channel"), ("float", 8, "tensor")) or weights.get("symmetric") is False:
                raise ValueError(f"compressed-tensors group {name!r} saves weights as {weights.get('type')} "
                                 f"{weights.get('num_bits')}-bit by {weights.get('strategy')}; lorakit reads fp8 "
                                 f"weights per channel or per tensor only (FP8 / FP8_DYNAMIC schemes): load a bf16 "
                                 f"checkpoint with --quantization fp8 or int4 instead")
        return "fp8"
    what = {"fp8": "block-wise fp8 (transformers' FineGrainedFP8, weight_scale_inv)", "gptq": "GPTQ int4",
            "awq": "AWQ int4", "bitsandbytes": "bitsandbytes"}.get(method, f"quant_method {method!r}")
    raise ValueError(f"the checkpoint is saved as {what}, which lorakit does not read yet; load its bf16 checkpoint "
                     f"with --quantization fp8 or int4, or a compressed-tensors fp8 (per channel) one")


def load_quantized(folder: str | Path, scheme: str | None, dtype: torch.dtype, device: str | torch.device
                   ) -> nn.Module:
    """The causal LM saved in ``folder`` on ``device``, its linear layers quantized as ``scheme`` asks (a bf16
    checkpoint) or as saved (a compressed-tensors fp8 one; ``scheme`` must then be None or "fp8"). The output head
    and layers no scheme can hold keep ``dtype``, as ``lorakit.quantize`` leaves them."""
    import transformers

    folder, device = Path(folder), torch.device(device)
    config = transformers.AutoConfig.from_pretrained(folder)
    saved = saved_scheme(config)
    if scheme is not None:
        check_scheme(scheme)
        if saved is not None and scheme != saved:
            raise ValueError(f"{folder} is saved quantized as {saved}; it cannot be loaded as {scheme}: drop "
                             f"--quantization, or give its bf16 checkpoint")
    scheme = scheme or saved
    if scheme is None:
        raise ValueError(f"{folder}: no quantization asked for and none saved; load it with from_pretrained")
    if saved is not None:
        del config.quantization_config  # read here; transformers' own quantizer is not involved
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    files = safetensors_files(folder)
    head = model.get_output_embeddings()
    handles: dict[Path, object] = {}

    def read(key: str) -> torch.Tensor:
        path = files[key]
        if path not in handles:
            handles[path] = stack.enter_context(safe_open(path, "pt", device="cpu"))
        return handles[path].get_tensor(key)

    count, kept = 0, {}
    with contextlib.ExitStack() as stack:
        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear or module is head or f"{name}.weight" not in files:
                continue
            reason = shape_reason(module.in_features, module.out_features, scheme)
            stored = f"{name}.weight_scale" in files
            if saved is not None and not stored:
                continue  # saved in full precision (the checkpoint's ignore list): loaded as such below
            if reason is not None and not stored:
                kept[name] = reason
                continue
            bias = read(f"{name}.bias").to(device, dtype) if module.bias is not None else None
            if stored:
                weight, scale = read(f"{name}.weight"), read(f"{name}.weight_scale").float().reshape(-1)
                if weight.dtype != torch.float8_e4m3fn or scale.numel() not in (1, module.out_features):
                    raise ValueError(f"{folder}: {name} is saved as {weight.dtype} with {scale.numel()} scales; "
                                     f"lorakit reads float8_e4m3fn weights with one scale per channel or per tensor")
                layer = Fp8Linear(weight.to(device), scale.expand(module.out_features).to(device), bias, dtype)
            else:
                linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
                linear.weight = nn.Parameter(read(f"{name}.weight").to(device, dtype), requires_grad=False)
                linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
                layer = FROM_LINEAR[scheme](linear)
                del linear
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            count += 1
        _load_the_rest(model, read, files, folder, dtype, device)
    if kept:
        logger.info("%s: %d linear layers keep their dtype: %s", scheme, len(kept),
                    "; ".join(f"{n} ({why})" for n, why in list(kept.items())[:4]) + (" ..." if len(kept) > 4 else ""))
    logger.info("%s: %d linear layers %s", scheme, count, "read as saved" if saved else "quantized as they loaded")
    return model


def _load_the_rest(model: nn.Module, read, files: dict[str, Path], folder: Path, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Every parameter still on the meta device, read in ``dtype`` (tied ones once, for all their owners)."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if param.device.type == "meta":
                owners.setdefault(id(param), []).append((module, attr, f"{module_name}.{attr}".lstrip(".")))
    for places in owners.values():
        key = next((name for _, _, name in places if name in files), None)
        if key is None:
            raise ValueError(f"{folder}: the checkpoint has no tensor for {[n for _, _, n in places]}")
        tensor = read(key)
        param = nn.Parameter(tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype),
                             requires_grad=False)
        for owner, attr, _ in places:
            setattr(owner, attr, param)
    for name, buffer in model.named_buffers():
        if buffer.device != device:
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = buffer.to(device)


def load_causal_lm(folder: str | Path, dtype: torch.dtype, device: str | torch.device,
                   quantization: str | None = None) -> nn.Module:
    """The causal LM in ``folder`` on ``device``: with ``quantization``, or saved quantized, through
    ``load_quantized`` (a tensor at a time); else transformers' ``from_pretrained``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    if quantization is None and saved_scheme(config) is None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return load_quantized(folder, quantization, dtype, device)
