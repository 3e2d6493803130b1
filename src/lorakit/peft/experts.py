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

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorakit.peft.adapter import BaseModule, ModuleLora
from lorakit.peft.config import CONFIG_NAME, AdapterError


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


# An adapter saved when transformers kept experts as a ModuleList of MLPs (transformers 4) names each expert's
# projections; transformers 5 stacks them, gate and up concatenated into gate_up_proj (its checkpoint conversion).
# Such an adapter is read against each expert's projections as linear modules, then folded into the stacked
# parameters exactly: gate_up's A is [A_gate; A_up] (rank r_gate + r_up) and its B block-diagonal, as PEFT's own
# conversion (utils/transformers_weight_conversion.py) does.
V4_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_V4_MODULE = re.compile(rf"(?P<experts>.+)\.(?P<e>\d+)\.(?P<proj>{'|'.join(V4_ROLES)})")
_V4_KEY = re.compile(rf"\.(\d+)\.({'|'.join(V4_ROLES)})\.lora_[AB]\.weight$")
MIXTRAL_V4 = ".block_sparse_moe.experts."  # transformers 4's Mixtral path of ".mlp.experts." (its conversion renames it)


def with_expert_linears(config: dict, base_modules: Mapping, weights_file: Path) -> Mapping:
    """``base_modules`` plus, for an adapter of per-expert linear targets (``target_modules`` naming the experts'
    projections, no ``target_parameters``), each expert's projections as linear modules ``<experts>.<e>.<proj>``: the
    names the config may name (a list's entries; for a pattern, the names the weights file uses)."""
    target = config.get("target_modules")
    if config.get("target_parameters") or not target or not any(m.kind == "experts" for m in base_modules.values()):
        return base_modules
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError):
        return base_modules  # reading the file fails later, with its message
    if isinstance(target, list):
        names = {t.rpartition(".")[2] for t in target} & V4_ROLES.keys()
    else:
        names = {m.group(2) for m in map(_V4_KEY.search, keys) if m}
    renamed = any(MIXTRAL_V4 in k for k in keys)  # transformers 4's Mixtral: the block was block_sparse_moe
    extra = {}
    for fqn, m in base_modules.items():
        module, _, param = fqn.rpartition(".")
        if m.kind != "experts" or param not in ("gate_up_proj", "down_proj"):
            continue
        if renamed:
            module = module.replace(".mlp.experts", MIXTRAL_V4.rstrip("."))
        out = m.out_features // 2 if param == "gate_up_proj" else m.out_features
        for name in sorted(n for n in names if (V4_ROLES[n] == "down") == (param == "down_proj")):
            for e in range(m.num_experts):
                extra[f"{module}.{e}.{name}"] = BaseModule("linear", m.in_features, out)
    return {**base_modules, **extra} if extra else base_modules


def fold_expert_linears(modules: dict, base_modules: Mapping, where: str) -> dict:
    """``modules`` with the LoRA of per-expert linear modules (``with_expert_linears``) folded into their stacked
    parameters. Values are ModuleLora (a loaded adapter) or (rank, scale) (an inspected one); a folded parameter's
    rank is the largest of its experts' (gate + up for gate_up), its scale the first part's, the other parts' scales
    folded into their B (exact where they are equal, as they are unless alpha_pattern or rank_pattern differ)."""
    groups: dict[str, dict[int, dict[str, object]]] = {}
    out = {}
    for name, value in modules.items():
        m = _V4_MODULE.fullmatch(name)
        experts = None if m is None else m["experts"].replace(MIXTRAL_V4.rstrip("."), ".mlp.experts")
        param = None if m is None else (f"{experts}.down_proj" if V4_ROLES[m["proj"]] == "down"
                                         else f"{experts}.gate_up_proj")
        if param is None or getattr(base_modules.get(param), "kind", None) != "experts":
            out[name] = value
            continue
        groups.setdefault(param, {}).setdefault(int(m["e"]), {})[V4_ROLES[m["proj"]]] = value
    for param, experts in groups.items():
        base = base_modules[param]
        roles = ("down",) if param.endswith(".down_proj") else ("gate", "up")
        first = next(iter(next(iter(experts.values())).values()))
        if not isinstance(first, tuple) and any(getattr(v, "magnitude", None) is not None
                                                for parts in experts.values() for v in parts.values()):
            raise AdapterError(f"{where}: DoRA on per-expert linear modules of {param.rpartition('.')[0]!r} cannot be "
                               f"served on its stacked experts (PEFT's ParamWrapper has no DoRA either)")
        rank = max(sum(_rank(p[r]) for r in roles if r in p) for p in experts.values())
        scale = first[1] if isinstance(first, tuple) else first.scale
        out[param] = (rank, scale) if isinstance(first, tuple) else _stacked(experts, roles, base, rank, scale)
    return out


def _rank(value) -> int:
    return value[0] if isinstance(value, tuple) else value.rank


def _stacked(experts: dict, roles: tuple, base, rank: int, scale: float):
    """One ModuleLora of the stacked parameter: A [E, rank, in], B [E, out, rank], zeros where an expert (or its
    gate or up) has none."""
    any_lora = next(iter(next(iter(experts.values())).values()))
    width = base.out_features // len(roles)  # gate and up: each half of gate_up's rows
    A = torch.zeros(base.num_experts, rank, base.in_features, dtype=any_lora.A.dtype)
    B = torch.zeros(base.num_experts, base.out_features, rank, dtype=any_lora.B.dtype)
    for e, parts in experts.items():
        r0 = 0
        for i, role in enumerate(roles):
            lora = parts.get(role)
            if lora is None:
                continue
            A[e, r0:r0 + lora.rank] = lora.A
            B[e, i * width:(i + 1) * width, r0:r0 + lora.rank] = lora.B * (lora.scale / scale)
            r0 += lora.rank
    return ModuleLora(A, B, rank, scale)
