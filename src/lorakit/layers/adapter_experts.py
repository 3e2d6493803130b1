"""PEFT's ``target_parameters`` on MoE experts, read as PEFT reads them (peft 0.21: tuners/tuners_utils.py
``_inject_parameters``, tuners/lora/layer.py ``ParamWrapper``): which stacked expert parameters a config adapts, the
keys their LoRA weights are saved under, and their shapes.

A targeted parameter [E, out, in] (or [E, in, out] where the experts are ``is_transposed``) gets ``lora_A`` [r * E, in]
and ``lora_B`` [out, r * E]; expert e's factors are ``A[e * r:(e + 1) * r]`` and ``B[:, j * E + e]`` for j < r, so
its weight becomes ``W_e + scale * B_e @ A_e``. Several parameters of one module are nested ParamWrappers, the first
in the module's parameter order innermost, so the i-th of n targeted parameters of module m is saved under
``m`` + ``.base_layer`` * (n - 1 - i). The model's expert parameters come as ``BaseModule``s of kind "experts" named
``<module>.<parameter>``, in the module's parameter order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lorakit.layers.adapter_config import CONFIG_NAME, AdapterError


def parameter_targets(config: dict, base_modules: Mapping, where: str) -> set[str]:
    """The expert parameters of ``base_modules`` the config's ``target_parameters`` adapts (a parameter is named by
    an entry that is its whole name or its end at a dot boundary, as PEFT matches them). Every entry must name one."""
    targets = config.get("target_parameters")
    if not targets:
        return set()
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise AdapterError(f"{where}: {CONFIG_NAME}: target_parameters must be a list of parameter names (such as "
                           f"'experts.gate_up_proj'), got {targets!r:.120}")
    for field, why in (("fan_in_fan_out", "fan_in_fan_out"), ("use_dora", "DoRA")):
        if config.get(field):
            raise AdapterError(f"{where}: {CONFIG_NAME}: target_parameters with {field}={config[field]!r}: PEFT's "
                               f"ParamWrapper does not work with {why}, so no such adapter can have been trained; "
                               f"fix the config")
    params = [n for n, m in base_modules.items() if m.kind == "experts"]
    found = set()
    for t in targets:
        hits = {n for n in params if n == t or n.endswith("." + t)}
        if not hits:
            known = sorted({".".join(n.split(".")[-2:]) for n in params})
            raise AdapterError(f"{where}: {CONFIG_NAME}: target_parameters entry {t!r} names no stacked MoE expert "
                               f"parameter of this model (lorakit serves target_parameters on the experts' parameters: "
                               f"{known or 'the model has none'}); was the adapter trained for another base model?")
        found |= hits
    return found


def expert_stems(targets, base_modules: Mapping) -> dict[str, str]:
    """{the module path a targeted parameter's ``lora_A`` / ``lora_B`` keys are saved under: the parameter's name},
    from PEFT's nesting of the targeted parameters of each module (the first in parameter order innermost)."""
    by_module: dict[str, list[str]] = {}
    for name, m in base_modules.items():  # the model's parameter order
        if m.kind == "experts" and name in targets:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
    stems = {}
    for module, names in by_module.items():
        for i, name in enumerate(names):
            stems[module + ".base_layer" * (len(names) - 1 - i)] = name
    return stems


def expert_shapes(at: str, base, kind: str, a_shape: tuple, b_shape: tuple) -> tuple[tuple, tuple]:
    """PEFT's shapes of an expert parameter's LoRA (A [r * E, in], B [out, r * E]), checked against the model, as one
    expert's (A [r, in], B [out, r])."""
    experts = base.num_experts
    if kind != "linear":
        raise AdapterError(f"{at} is a stacked MoE expert parameter but the adapter stores embedding LoRA weights "
                           f"(lora_embedding_A/B) for it; was it trained for another model?")
    for shape, label in ((a_shape, "A"), (b_shape, "B")):
        if len(shape) != 2:
            raise AdapterError(f"{at}: {label} must be a 2-D floating-point tensor, got shape {shape}")
    want = f"A [r * {experts}, {base.in_features}] and B [{base.out_features}, r * {experts}]"
    if (a_shape[0] % experts or a_shape[0] != b_shape[1] or a_shape[1] != base.in_features
            or b_shape[0] != base.out_features):
        raise AdapterError(f"{at}: A {a_shape} and B {b_shape} do not fit the model's {experts} experts "
                           f"({base.in_features} -> {base.out_features} each), which need {want} (PEFT's "
                           f"target_parameters layout); was the adapter trained for another base model?")
    rank = a_shape[0] // experts
    return (rank, base.in_features), (base.out_features, rank)


def expert_factors(A: torch.Tensor, B: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's A [r * E, in] and B [out, r * E] as each expert's factors: A [E, r, in], B [E, out, r] (contiguous)."""
    A3 = A.reshape(num_experts, -1, A.shape[-1])
    B3 = B.reshape(B.shape[0], -1, num_experts).permute(2, 0, 1)
    return A3.contiguous(), B3.contiguous()
