"""Read a PEFT LoRA adapter folder and check that lorakit can serve it exactly as PEFT would.

``load_peft_adapter`` returns, for every base-model module the weights file names, the A, B, rank and scale PEFT's
``LoraLayer`` uses (linear ``y += scale * (x @ A.T) @ B.T``, embedding ``y += scale * A.T[ids] @ B.T``) and a DoRA
module's magnitudes, or raises ``AdapterError`` naming the adapter, the module and the fix; ``inspect_peft_adapter``
makes the same checks from the header alone. Nothing is unpickled. A file and config that disagree (weights of
modules the config does not adapt, which PEFT ignores; adapted modules without weights, which PEFT leaves untrained)
are refused unless ``strict=False`` asks for PEFT's behaviour. Which modules a config adapts: targets.py; token
rows: tokens.py; MoE experts: experts.py. Semantics of peft 0.21 (tuners/lora/{config,layer,model}.py,
utils/other.py, utils/save_and_load.py).
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import regex
import torch
from safetensors import SafetensorError, safe_open

from lorakit.peft.adapter import AdapterInfo, BaseModule, ModuleLora, PeftAdapter
from lorakit.peft.config import (
    _TRAINING_ONLY_KEYS,
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    _check_config,
    read_adapter_config,
)
from lorakit.peft.experts import (
    expert_factors,
    expert_shapes,
    expert_stems,
    fold_expert_linears,
    with_expert_linears,
)
from lorakit.peft.gil import pause
from lorakit.peft.targets import MATCH_SECONDS, lora_targets, token_targets
from lorakit.peft.tokens import (
    TokenParts,
    added_ids,
    check_token_shapes,
    module_tokens,
    parts_of,
    token_key,
)

__all__ = ["check_values", "inspect_peft_adapter", "load_peft_adapter", "plan_state_dict", "read_state_dict",
           "take_state_dict", "weights_file"]

logger = logging.getLogger("lorakit.adapter")

PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the base model, in every saved key

# "<module>.lora_A.weight" / "<module>.lora_embedding_A", optionally with a PEFT adapter name inside.
_LORA_KEY = re.compile(r"(?P<module>.+)\.(?:(?P<lin>lora_[AB])(?:\.(?P<an>[^.]+))?\.weight"
                       r"|(?P<emb>lora_embedding_[AB])(?:\.(?P<ean>[^.]+))?"
                       r"|(?P<mag>lora_magnitude_vector)(?:\.(?P<man>[^.]+)\.weight)?)")
# What an unexpected key most likely is, first match wins.
_KEY_HINTS = (("lora_B.bias", "lora_B biases (lora_bias)"),
              ("trainable_tokens", "trainable tokens (trainable_token_indices)"),
              (".bias", "biases of the base layers (bias='all' or 'lora_only')"),
              (".weight", "full module weights (modules_to_save, or an embedding resized during fine-tuning)"))


def load_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule], dtype: torch.dtype,
                      base_weights: Mapping[str, torch.Tensor] | None = None, *, strict: bool = True,
                      tied: bool = False) -> PeftAdapter:
    """Read config + adapter_model.safetensors, map keys to base module names, validate everything, cast weights
    to ``dtype`` (contiguous, on the CPU). ``base_weights``: the token-indexed modules' weights ([vocab, dim]),
    needed for a whole saved matrix of them (a modules_to_save copy, a resized vocabulary: only the rows that
    differ or are new are kept). ``strict=False``: load a file that disagrees with its config as PEFT does (its
    weights of modules the config does not adapt dropped, adapted modules without weights untrained), with a
    warning, instead of refusing it. ``tied``: the model's output head shares the input embedding's weight."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    base_modules = with_expert_linears(config, base_modules, path / WEIGHTS_NAME)  # per-expert linear targets
    pairs, token_parts, magnitudes = _read_weights(path, config, base_modules, where, strict, tied)
    modules = fold_expert_linears({m: _module_lora(m, kind, a, b, config, base_modules, dtype, where, magnitudes.get(m))
                                   for m, (kind, a, b) in pairs.items()}, base_modules, where)
    tokens = {m: module_tokens(m, t, base_modules[m], (base_weights or {}).get(m), dtype, where)
              for m, t in token_parts.items()}
    _check_token_modules(modules, tokens, where)
    _check_alora(config, pairs, tokens, base_modules, where)
    return PeftAdapter(name, path, config, modules, tokens)


def inspect_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule], *, strict: bool = True,
                         tied: bool = False) -> AdapterInfo:
    """Every check ``load_peft_adapter`` makes except those on the values (NaN, overflow, which rows of a whole
    matrix differ from the model's), from the config and the safetensors header alone: cheap enough to refuse a bad
    adapter when it is registered. ``strict`` and ``tied`` as for ``load_peft_adapter``, the same decision."""
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    base_modules = with_expert_linears(config, base_modules, path / WEIGHTS_NAME)  # per-expert linear targets
    pairs, token_parts, magnitudes = _read_weights(path, config, base_modules, where, strict, tied, header_only=True)
    modules = fold_expert_linears({m: _check_module(m, kind, a, b, config, base_modules, where, magnitudes.get(m))
                                   for m, (kind, a, b) in pairs.items()}, base_modules, where)
    added = set()
    for m, t in token_parts.items():
        base = base_modules[m]
        check_token_shapes(m, t, base, where)
        if base.tokens == "input":
            added |= added_ids(t, base)
    _check_token_modules(modules, token_parts, where)
    _check_alora(config, pairs, token_parts, base_modules, where)
    invocation = tuple(config.get("alora_invocation_tokens") or ()) or None
    return AdapterInfo(name, path, config, modules, frozenset(added), invocation, frozenset(magnitudes))


def _check_alora(config: dict, pairs: Mapping, token_parts: Mapping, base_modules: Mapping[str, BaseModule],
                 where: str) -> None:
    """An activated LoRA is served on the model's inner linear layers only: PEFT's aLoRA variant does not cover
    embeddings, and aLoRA on the output head (a Linear to PEFT) or on token rows is not held against PEFT here;
    such an adapter is refused rather than served in a way not known to match PEFT."""
    if not config.get("alora_invocation_tokens"):
        return
    odd = sorted({m for m, (kind, _, _) in pairs.items() if kind == "embedding" or base_modules[m].tokens}
                 | set(token_parts))
    if odd:
        raise AdapterError(f"{where}: alora_invocation_tokens is set (activated LoRA), which lorakit serves on "
                           f"linear layers only (not the input embedding, the output head or token rows), but the "
                           f"adapter also adapts {_some(odd)}; retrain with target_modules naming the inner linear "
                           f"layers only (no embed_tokens, lm_head, trainable_token_indices or modules_to_save)")


MAGNITUDE = "lora_magnitude_vector"  # a DoRA module's magnitudes, beside its lora_A / lora_B


def _check_dora(config: dict, pairs: Mapping, magnitudes: Mapping, where: str) -> None:
    """DoRA adapters (use_dora) need a magnitude for every adapted module, and only they may hold one; PEFT has no
    activated DoRA."""
    dora = bool(config.get("use_dora"))
    if magnitudes and not dora:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds DoRA magnitudes ({MAGNITUDE}) of "
                           f"{_some(magnitudes)} but {CONFIG_NAME} does not set use_dora; set use_dora to true if "
                           f"the adapter was trained with DoRA, else re-save it without them")
    if not dora:
        return
    missing = sorted(pairs.keys() - magnitudes.keys())
    if missing:
        raise AdapterError(f"{where}: use_dora is set but {_some(missing)} have no DoRA magnitude ({MAGNITUDE}) in "
                           f"{WEIGHTS_NAME}; the weights file is incomplete, re-save the adapter with PEFT's "
                           f"save_pretrained()")
    if config.get("alora_invocation_tokens"):
        raise AdapterError(f"{where}: use_dora and alora_invocation_tokens are both set; PEFT has no activated DoRA "
                           f"(it refuses this combination too): retrain with one of them")


# Fields of a config whose adapters need more than plain LoRA pairs on linear modules: read from a folder instead.
_NOT_PLAIN = ("use_dora", "alora_invocation_tokens", "trainable_token_indices", "modules_to_save", "target_parameters")


def read_state_dict(name: str, tensors: Mapping[str, torch.Tensor], config: dict, path: Path,
                    base_modules: Mapping[str, BaseModule], *, strict: bool = True, tied: bool = False
                    ) -> tuple[AdapterInfo, PeftAdapter] | None:
    """A PEFT state dict held in memory (``get_peft_model_state_dict``'s keys; tensors on any device, kept there, not
    copied) checked as ``load_peft_adapter`` checks a folder: the config, every key, module, shape and rank, every
    value (one device sync for all). Plain LoRA on linear modules only: for anything more (DoRA, token rows,
    embeddings, MoE experts, an activated LoRA) it returns None, and the caller reads the adapter as a folder.
    ``path`` names where it came from in errors."""
    where = f"adapter {name!r} at {path}"
    plan = plan_state_dict(tensors, config, base_modules, where, strict=strict, tied=tied)
    return None if plan is None else take_state_dict(name, tensors, config, path, plan)


def plan_state_dict(tensors: Mapping[str, torch.Tensor], config: dict, base_modules: Mapping[str, BaseModule],
                    where: str, *, strict: bool = True, tied: bool = False
                    ) -> dict[str, tuple[str, str, int, float]] | None:
    """``read_state_dict``'s checks of everything but the values: {module: (A's key, B's key, rank, scale)}, the same
    for every state dict of the same config, keys, shapes and dtypes; None when it is more than plain LoRA."""
    _check_config(config, where)
    if any(config.get(field) for field in _NOT_PLAIN) or any(m.kind == "experts" for m in base_modules.values()):
        return None
    parts, copies, token_keys = _sort_keys(list(tensors), config, base_modules, where, strict, tied)
    if copies or token_keys or any(set(slot) - {"lora_A", "lora_B"} for slot in parts.values()):
        return None
    plan = {}
    for module, slot in parts.items():
        pause()
        if set(slot) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{where}: module {module!r} has {sorted(slot)} but needs exactly lora_A and lora_B; "
                               f"the weights are incomplete")
        a, b = tensors[slot["lora_A"]], tensors[slot["lora_B"]]
        for t, label in ((a, "A"), (b, "B")):
            if not t.dtype.is_floating_point or t.dim() != 2:
                raise AdapterError(f"{where}: module {module!r}: {label} must be a 2-D floating-point tensor, got "
                                   f"{t.dtype} {tuple(t.shape)}")
        if base_modules[module].kind != "linear":
            return None
        rank, scale = _check_module(module, "linear", tuple(a.shape), tuple(b.shape), config, base_modules, where)
        plan[module] = (slot["lora_A"], slot["lora_B"], rank, scale)
    return plan


def take_state_dict(name: str, tensors: Mapping[str, torch.Tensor], config: dict, path: Path,
                    plan: Mapping[str, tuple[str, str, int, float]], values: bool = True
                    ) -> tuple[AdapterInfo, PeftAdapter]:
    """The adapter ``plan_state_dict`` planned, its values checked (``check_values``; ``values=False``: the caller
    checks them)."""
    modules = {}
    for module, (a, b, rank, scale) in plan.items():
        pause()
        modules[module] = ModuleLora(tensors[a].detach(), tensors[b].detach(), rank, scale)
    if values:
        check_values(modules, f"adapter {name!r} at {path}")
    shapes = {module: (rank, scale) for module, (_, _, rank, scale) in plan.items()}
    return AdapterInfo(name, path, config, shapes), PeftAdapter(name, path, config, modules)


def check_values(modules: Mapping[str, ModuleLora], where: str) -> None:
    """Every A and B finite, and within float32 where it is wider: each tensor's largest magnitude, reduced where it
    lies (a GPU's tensors on the GPU) and read back at once."""
    tensors = [(module, label, t) for module, lora in modules.items() for label, t in (("A", lora.A), ("B", lora.B))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, _, t) in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    largest = [0.0] * len(tensors)
    for (device, _), indices in groups.items():
        group = [tensors[i][2] for i in indices]
        # max |value| per tensor, NaN where one is NaN: on a GPU one fused reduction (clip_grad_norm_'s) and one
        # read back for all, on the CPU one reduction per tensor (faster there)
        if device.type != "cpu" and hasattr(torch, "_foreach_norm"):
            norms = torch._foreach_norm(group, float("inf"))
        else:
            norms = []
            for t in group:
                pause()  # beside a stepping engine: lorakit.peft.gil
                norms.append(t.abs().amax())
        for i, v in zip(indices, torch.stack(norms).double().tolist()):
            largest[i] = v
    for (module, label, t), v in zip(tensors, largest):
        if not math.isfinite(v):
            raise AdapterError(f"{where}: module {module!r}: {label} holds NaN or inf values; the adapter is broken, "
                               f"retrain or re-export")
        if v > torch.finfo(torch.float32).max:
            raise AdapterError(f"{where}: module {module!r}: {label} overflows torch.float32 (largest |value| "
                               f"{v:.3g}); train it in a narrower range")


def weights_file(path: Path, where: str) -> Path:
    """The folder's safetensors weights file; AdapterError (naming the fix) when there is none or only a pickle."""
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        if (Path(path) / PICKLE_NAME).exists():
            raise AdapterError(f"{where}: only {PICKLE_NAME} (a pickle) is there, and lorakit loads safetensors "
                               f"only; convert it: load the adapter with PEFT (PeftModel.from_pretrained) and call "
                               f"save_pretrained(folder, safe_serialization=True)")
        raise AdapterError(f"{where}: no {WEIGHTS_NAME} in the folder; re-save the adapter with PEFT's "
                           f"save_pretrained()")
    return file


def _read_weights(path: Path, config: dict, base_modules: Mapping[str, BaseModule], where: str, strict: bool,
                  tied: bool, header_only: bool = False) -> tuple[dict, dict, dict]:
    """({module: (kind, A, B)}, {module: TokenParts}, {module: DoRA magnitude}) from the weights file, every key
    accounted for; kind is 'linear' or 'embedding'. With header_only, tensors are their shapes, and only the header
    is read."""
    file = weights_file(path, where)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            parts, copies, token_keys = _sort_keys(list(f.keys()), config, base_modules, where, strict, tied)
            token_parts = {}
            for module, keys in token_keys.items():
                found = parts_of(keys)
                got = {part: _header_shape(f, module, key, "token rows", where) for part, key in found.items()}
                if not header_only:
                    got = {part: f.get_tensor(key) for part, key in found.items()}
                token_parts[module] = replace(keys, **got)
            for module, key in copies.items():  # PEFT saves the base weight of targeted embeddings / lm_head
                _check_base_copy(module, tuple(f.get_slice(key).get_shape()), parts, base_modules, where)
            pairs, magnitudes = {}, {}
            for module, slot in parts.items():
                kind = "embedding" if any(p.startswith("lora_embedding") for p in slot) else "linear"
                a, b = ("lora_embedding_A", "lora_embedding_B") if kind == "embedding" else ("lora_A", "lora_B")
                magnitude = slot.pop(MAGNITUDE, None)
                if magnitude is not None:
                    shape = _header_shape(f, module, magnitude, "the DoRA magnitude", where)
                    magnitudes[module] = shape if header_only else f.get_tensor(magnitude)
                if set(slot) != {a, b}:
                    raise AdapterError(f"{where}: module {module!r} has {sorted(slot)} but needs exactly {a} and "
                                       f"{b}; the weights file is incomplete, re-save the adapter")
                if header_only:
                    pairs[module] = (kind, *(_header_shape(f, module, slot[k], k[-1], where) for k in (a, b)))
                else:
                    pairs[module] = (kind, f.get_tensor(slot[a]), f.get_tensor(slot[b]))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} is not a readable safetensors file ({e}); "
                           f"re-save the adapter with PEFT's save_pretrained()") from e
    _check_dora(config, pairs, magnitudes, where)
    return pairs, token_parts, magnitudes


def _header_shape(f, module: str, key: str, label: str, where: str) -> tuple[int, ...]:
    part = f.get_slice(key)
    if part.get_dtype() not in ("F64", "F32", "F16", "BF16"):
        raise AdapterError(f"{where}: module {module!r}: {label} must be a 2-D floating-point tensor, "
                           f"got {part.get_dtype()}")
    return tuple(part.get_shape())


def _sort_keys(keys: list[str], config: dict, base_modules: Mapping[str, BaseModule], where: str, strict: bool,
               tied: bool) -> tuple:
    """Split the file's keys into {module: {param: key}} LoRA weights, {module: key} copies of base weights and
    {module: TokenParts} token rows; any other key is an error, except the training-only state of variants the config
    enables. Then hold the file against what the config adapts (``_disagreements``)."""
    skip = [pattern for field, pattern in _TRAINING_ONLY_KEYS.items() if config.get(field)]
    targets = lora_targets(config, base_modules, tied, where)
    stems = expert_stems(targets or (), base_modules)  # where target_parameters' LoRA weights are saved
    tt = token_targets(config, base_modules, tied, where)
    roles = {name for name, m in base_modules.items() if m.tokens}
    parts: dict[str, dict[str, str]] = {}
    copies: dict[str, str] = {}
    tokens: dict[str, dict[str, str]] = {}
    stray_rows: set[str] = set()  # trainable-token rows of a token module the config gives none
    unexpected = []
    for key in keys:
        if not key.startswith(PEFT_PREFIX):
            if not any(p.search(key) for p in skip):
                unexpected.append(key)
            continue
        rest = key[len(PEFT_PREFIX):]
        token = token_key(rest, roles, tt, targets or set())
        if token is not None:
            module, part = token
            if part is None:
                stray_rows.add(module)
            else:
                tokens.setdefault(module, {})[part] = key
            continue
        m = _LORA_KEY.fullmatch(rest)
        if m is not None:
            adapter_name = m["an"] or m["ean"] or m["man"]
            if adapter_name not in (None, "default"):  # PeftModel.from_pretrained loads "default" keys as they are
                raise AdapterError(f"{where}: weight {key!r} still holds the PEFT adapter name {adapter_name!r}, "
                                   f"which PEFT loads only as adapter_name={adapter_name!r}; re-save it with PEFT's "
                                   f"save_pretrained(), which leaves the name out")
            param = m["lin"] or m["emb"] or m["mag"]
            slot = parts.setdefault(stems.get(m["module"], m["module"]), {})
            if param in slot:
                raise AdapterError(f"{where}: module {m['module']!r} has {param} twice ({slot[param]!r} and "
                                   f"{key!r}); keep one")
            slot[param] = key
        elif rest.endswith(".base_layer.weight"):
            copies[rest[:-len(".base_layer.weight")]] = key
        elif not any(p.search(key) for p in skip):
            unexpected.append(key)
    if unexpected:
        what = sorted({h for h in map(_key_hint, unexpected) if h})
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds {len(unexpected)} weight(s) that are not plain LoRA A/B: "
                           f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                           f"{' (' + '; '.join(what) + ')' if what else ''}; lorakit does not support them")
    for module in parts:
        _base_module(module, base_modules, where)  # a module the model lacks: trained for another model
    if not parts and not tokens and not stray_rows:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds no LoRA weights (no '*.lora_A.weight' or "
                           f"'*.lora_embedding_A' keys under '{PEFT_PREFIX}')")
    missing_rows = {m for m in tt.trainable if m not in tt.optional and "delta" not in tokens.get(m, {})}
    missing_rows |= {m for m in tt.full if "full" not in tokens.get(m, {})}
    dropped, untrained = _disagreements(config, targets, parts, stray_rows, missing_rows, where, strict)
    for module in dropped | untrained:  # (an untrained module's copy of its base weight is PEFT's to load)
        parts.pop(module, None)
        copies.pop(module, None)
    for module in missing_rows:
        tokens.pop(module, None)  # what is left of them PEFT loads, but into rows that stay untrained
    if not parts and not tokens:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds no LoRA weights that {CONFIG_NAME} adapts")
    token_keys = {m: TokenParts(ids=tt.trainable.get(m) if "delta" in t else None, **t) for m, t in tokens.items()}
    return parts, copies, token_keys


def _disagreements(config: dict, targets: set | None, parts: dict, stray_rows: set, missing_rows: set, where: str,
                   strict: bool) -> set:
    """Refuse (strict) or warn about a weights file that disagrees with what its config adapts; returns the
    modules whose LoRA weights PEFT would drop, and those it would run untrained."""
    found = set(parts)
    extra = found - targets if targets is not None else set()
    missing = targets - found if targets is not None else set()
    problems = []  # (what is wrong, what strict=False does about it)
    if targets is None:
        problems.append(("the config names no target_modules (PEFT would adapt its defaults for the model type, "
                         "which lorakit cannot hold the file against)", "serving the LoRA weights the file holds"))
    if extra:
        problems.append((f"it holds LoRA weights of {_some(extra)} that target_modules="
                         f"{config.get('target_modules')!r:.120} does not adapt (PEFT ignores them without a word)",
                         f"dropping the LoRA weights of {_some(extra)}"))
    if stray_rows:
        problems.append((f"it holds trainable-token rows of {_some(stray_rows)} that trainable_token_indices does "
                         f"not name (PEFT ignores them)", f"dropping the token rows of {_some(stray_rows)}"))
    if missing:
        problems.append((f"the config adapts {_some(missing)} that have no LoRA weights in it (PEFT runs them "
                         f"untrained)", f"serving {_some(missing)} untrained (no LoRA delta)"))
    if missing_rows:
        problems.append((f"the config trains token rows of {_some(missing_rows)} (trainable_token_indices or "
                         f"modules_to_save) that have none in it (PEFT leaves them untrained)",
                         f"serving the token rows of {_some(missing_rows)} untrained (the model's own)"))
    if problems and strict:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} does not match what {CONFIG_NAME} adapts: "
                           f"{'; '.join(p for p, _ in problems)}. Re-save the adapter with PEFT's save_pretrained(), "
                           f"or make target_modules (trainable_token_indices, modules_to_save) name exactly the "
                           f"modules the file holds; to serve it as PEFT loads it anyway, pass strict=False "
                           f"(lorakit serve: --lora-non-strict)")
    if problems:
        logger.warning("%s: strict=False, loaded as PEFT loads it: %s", where, "; ".join(w for _, w in problems))
    return extra, missing


def _some(names) -> str:
    """'3 module(s) ['a', 'b', 'c']': the first few, sorted, and how many in all."""
    names = sorted(names)
    return f"{len(names)} module(s) {names[:4]}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"


def _key_hint(key: str) -> str | None:
    if not key.startswith(PEFT_PREFIX):
        return f"keys outside the '{PEFT_PREFIX}' prefix PEFT's save_pretrained() writes"
    return next((hint for pattern, hint in _KEY_HINTS if pattern in key), None)


def _base_module(module: str, base_modules: Mapping[str, BaseModule], where: str) -> BaseModule:
    if module in base_modules:
        return base_modules[module]
    rooted = [n for n in base_modules if module.endswith("." + n) or n.endswith("." + module)]
    close = difflib.get_close_matches(module, list(base_modules), n=1, cutoff=0.8)
    hint = (f" (it has {rooted[0]!r}: are base_modules named from a different root module?)" if rooted else
            f" (did you mean {close[0]!r}?)" if close else "")
    raise AdapterError(f"{where}: the model has no module {module!r} that this adapter targets{hint}; "
                       f"was the adapter trained for another base model?")


def _check_base_copy(module: str, shape: tuple, parts: dict, base_modules: Mapping[str, BaseModule], where: str):
    """A copy of a targeted module's base weight is ignored when its shape matches the model's."""
    if module not in parts:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds a base weight for {module!r}, which has no LoRA "
                           f"weights; lorakit does not support replacing base weights")
    base = _base_module(module, base_modules, where)
    if base.kind == "embedding":
        ok = [(base.in_features, base.out_features)]
    else:
        ok = [(base.out_features, base.in_features), (base.in_features, base.out_features)]  # nn.Linear, Conv1D
    if shape not in ok:
        raise AdapterError(f"{where}: module {module!r}: the saved base weight has shape {list(shape)} but the "
                           f"model's is {list(ok[0])}; the vocabulary was probably resized during fine-tuning, "
                           f"which lorakit does not support")


def _check_token_modules(modules: Mapping, tokens: Mapping, where: str) -> None:
    both = modules.keys() & tokens.keys()
    if both:
        raise AdapterError(f"{where}: {sorted(both)} has both LoRA weights and token rows; lorakit serves one or "
                           f"the other per module")


def _pattern_value(config: dict, field: str, fallback: str, default, module: str, at: str):
    """PEFT's get_pattern_key (utils/other.py) as LoraModel._create_and_replace uses it: the first key of
    ``config[field]``, in file order (PEFT writes them sorted), that matches the end of the module name at a dot
    boundary, else ``config[fallback]``. Returns the value and where it came from."""
    patterns = config.get(field) or {}
    for key in patterns:
        try:
            found = regex.match(rf"(.*\.)?({key})$", module, timeout=MATCH_SECONDS)
        except TimeoutError:
            raise AdapterError(f"{at}: the {field} key {key!r:.80} takes too long to match a module name (over "
                               f"{MATCH_SECONDS} s: catastrophic backtracking); simplify it") from None
        if found:
            return patterns[key], f"{field}[{key!r}]"
    return config.get(fallback, default), fallback


def _check_module(module, kind, a_shape, b_shape, config, base_modules, where, m_shape=None) -> tuple[int, float]:
    """The rank and scale of one module's LoRA, after checking its shapes (and a DoRA magnitude's, ``m_shape``)
    against the model and the config."""
    base = _base_module(module, base_modules, where)
    at = f"{where}: module {module!r}"
    if base.kind == "experts":  # PEFT's [r * E, in] / [out, r * E], checked; then as one expert's linear LoRA
        a_shape, b_shape = expert_shapes(at, base, kind, a_shape, b_shape)
        kind, base = "linear", replace(base, kind="linear")
    if base.kind != kind:
        stored = "lora_embedding_A/B" if kind == "embedding" else "lora_A/lora_B"
        raise AdapterError(f"{at} is {'an' if base.kind == 'embedding' else 'a'} {base.kind} in the model but the "
                           f"adapter stores {kind} LoRA weights ({stored}) for it; was it trained for another model?")
    for shape, label in ((a_shape, "A"), (b_shape, "B")):
        if len(shape) != 2:
            raise AdapterError(f"{at}: {label} must be a 2-D floating-point tensor, got shape {shape}")
    rank = a_shape[0]
    if b_shape[1] != rank:
        raise AdapterError(f"{at}: A has rank {rank} (shape {a_shape}) but B has rank {b_shape[1]} "
                           f"(shape {b_shape}); the weights file is inconsistent")
    want_a, want_b = (rank, base.in_features), (base.out_features, rank)
    if a_shape != want_a or b_shape != want_b:
        raise AdapterError(f"{at}: A {a_shape} and B {b_shape} do not fit the model's module "
                           f"({base.kind} {base.in_features} -> {base.out_features}), which needs A {want_a} and "
                           f"B {want_b}; was the adapter trained for another base model?")
    if m_shape is not None and tuple(m_shape) != (base.out_features,):
        raise AdapterError(f"{at}: the DoRA magnitude has shape {list(m_shape)} but the model's module needs "
                           f"[{base.out_features}] (one per {'embedding dimension' if kind == 'embedding' else 'output'}"
                           f"); was the adapter trained for another base model?")
    r, r_from = _pattern_value(config, "rank_pattern", "r", 8, module, at)
    if r != rank:
        raise AdapterError(f"{at}: the weights have rank {rank} but {CONFIG_NAME} gives rank {r} (from {r_from}); "
                           f"fix r / rank_pattern to match the weights")
    alpha, _ = _pattern_value(config, "alpha_pattern", "lora_alpha", 8, module, at)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return rank, float(scale)


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: its largest magnitude is (a NaN anywhere makes it NaN); one reduction,
    ~10x faster than ``isfinite(t).all()`` on the CPU."""
    return t.numel() == 0 or math.isfinite(float(t.abs().amax()))


def _module_lora(module, kind, a, b, config, base_modules, dtype, where, magnitude=None) -> ModuleLora:
    at = f"{where}: module {module!r}"
    for t, label in ((a, "A"), (b, "B")):
        if not t.dtype.is_floating_point:
            raise AdapterError(f"{at}: {label} must be a 2-D floating-point tensor, got {t.dtype} {tuple(t.shape)}")
    rank, scale = _check_module(module, kind, tuple(a.shape), tuple(b.shape), config, base_modules, where,
                                None if magnitude is None else tuple(magnitude.shape))
    if magnitude is not None:
        magnitude = magnitude.float()
        if not _finite(magnitude):
            raise AdapterError(f"{at}: the DoRA magnitude holds NaN or inf values; the adapter is broken, retrain or "
                               f"re-export")
    out = []
    for t, label in ((a, "A"), (b, "B")):
        cast = t.to(dtype).contiguous()
        if not _finite(cast):  # checked once, on the cast (a bf16 tensor is checked ~5x slower on the CPU)
            if not _finite(t):
                raise AdapterError(f"{at}: {label} holds NaN or inf values; the adapter is broken, retrain or "
                                   f"re-export")
            raise AdapterError(f"{at}: {label} overflows {dtype} (largest |value| {t.abs().max().item():.3g}); "
                               f"load it in a wider dtype such as torch.bfloat16 or torch.float32")
        out.append(cast)
    if base_modules[module].kind == "experts":
        out = expert_factors(*out, base_modules[module].num_experts)
    return ModuleLora(out[0], out[1], rank, scale, magnitude)
