"""Read a PEFT LoRA adapter folder and check that lorakit can serve it exactly as PEFT would.

Contract: ``load_peft_adapter`` returns, for every base-model module that the weights file names, the A, B,
rank and scale PEFT's ``LoraLayer`` uses (linear ``y += scale * (x @ A.T) @ B.T``, embedding
``y += scale * A.T[ids] @ B.T``), or raises ``AdapterError`` naming the adapter, the module and the fix.
Every ``LoraConfig`` field that changes PEFT's forward is matched or refused; nothing is unpickled.
Semantics are those of peft 0.21: tuners/lora/{config,layer,model}.py, utils/other.py, utils/save_and_load.py.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorakit.layers.adapter_config import (
    _TRAINING_ONLY_KEYS,
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    _is_int,
    read_adapter_config,
)

__all__ = ["AdapterError", "AdapterInfo", "BaseModule", "ModuleLora", "PeftAdapter", "inspect_peft_adapter",
           "load_peft_adapter", "read_adapter_config"]

PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the base model, in every saved key

# "<module>.lora_A.weight" / "<module>.lora_embedding_A", optionally with a PEFT adapter name inside.
_LORA_KEY = re.compile(r"(?P<module>.+)\.(?:(?P<lin>lora_[AB])(?:\.(?P<an>[^.]+))?\.weight"
                       r"|(?P<emb>lora_embedding_[AB])(?:\.(?P<ean>[^.]+))?)")
# What an unexpected key most likely is, first match wins.
_KEY_HINTS = (("lora_magnitude_vector", "DoRA magnitudes (use_dora)"), ("lora_B.bias", "lora_B biases (lora_bias)"),
              ("trainable_tokens", "trainable tokens (trainable_token_indices)"),
              (".bias", "biases of the base layers (bias='all' or 'lora_only')"),
              (".weight", "full module weights (modules_to_save, or an embedding resized during fine-tuning)"))


@dataclass(frozen=True)
class BaseModule:
    """A base-model module an adapter may target. linear: (in_features, out_features);
    embedding: (num_embeddings, embedding_dim)."""

    kind: str
    in_features: int
    out_features: int

    def __post_init__(self):
        if self.kind not in ("linear", "embedding"):
            raise ValueError(f"BaseModule.kind must be 'linear' or 'embedding', got {self.kind!r}")
        for field in ("in_features", "out_features"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"BaseModule.{field} must be a positive int, got {value!r}")


@dataclass(frozen=True, eq=False)
class ModuleLora:
    """One module's LoRA: A [rank, in_features], B [out_features, rank] (embedding: in = num_embeddings,
    out = embedding_dim), and the scale PEFT multiplies B @ A by."""

    A: torch.Tensor
    B: torch.Tensor
    rank: int
    scale: float

    def __post_init__(self):
        if self.A.dim() != 2 or self.B.dim() != 2 or self.A.shape[0] != self.rank or self.B.shape[1] != self.rank:
            raise ValueError(f"ModuleLora needs A [rank, in] and B [out, rank] with rank={self.rank}, "
                             f"got A {tuple(self.A.shape)} and B {tuple(self.B.shape)}")
        if not math.isfinite(self.scale):
            raise ValueError(f"ModuleLora.scale must be finite, got {self.scale}")


@dataclass(frozen=True, eq=False)
class PeftAdapter:
    """A loaded adapter: ``modules`` is keyed by the base model's fully-qualified module name."""

    name: str
    path: Path
    config: dict
    modules: dict[str, ModuleLora]

    def __post_init__(self):
        if not self.modules:
            raise ValueError(f"adapter {self.name!r} at {self.path}: a PeftAdapter needs at least one module")

    @property
    def max_rank(self) -> int:
        return max(lora.rank for lora in self.modules.values())

    def nbytes(self) -> int:
        return sum(lora.A.nbytes + lora.B.nbytes for lora in self.modules.values())


def load_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule], dtype: torch.dtype) -> PeftAdapter:
    """Read config + adapter_model.safetensors, map keys to base module names, validate everything, cast weights
    to ``dtype`` (contiguous, on the CPU)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    pairs = _read_weights(path, config, base_modules, where)
    modules = {m: _module_lora(m, kind, a, b, config, base_modules, dtype, where) for m, (kind, a, b) in pairs.items()}
    return PeftAdapter(name, path, config, modules)


@dataclass(frozen=True)
class AdapterInfo:
    """What the config and the weights file's header say about an adapter, with no weights read:
    ``modules`` maps each targeted module to its (rank, scale)."""

    name: str
    path: Path
    config: dict
    modules: dict[str, tuple[int, float]]

    @property
    def max_rank(self) -> int:
        return max(rank for rank, _ in self.modules.values())


def inspect_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule]) -> AdapterInfo:
    """Every check ``load_peft_adapter`` makes except those on the values (NaN, overflow), from the config and
    the safetensors header alone: cheap enough to refuse a bad adapter when it is registered."""
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    pairs = _read_weights(path, config, base_modules, where, header_only=True)
    modules = {m: _check_module(m, kind, a, b, config, base_modules, where) for m, (kind, a, b) in pairs.items()}
    return AdapterInfo(name, path, config, modules)


def _read_weights(path: Path, config: dict, base_modules: Mapping[str, BaseModule], where: str,
                  header_only: bool = False) -> dict:
    """{module: (kind, A, B)} from the weights file, every key accounted for; kind is 'linear' or 'embedding'.
    With header_only, A and B are their shapes, and only the header is read."""
    file = path / WEIGHTS_NAME
    if not file.is_file():
        if (path / PICKLE_NAME).exists():
            raise AdapterError(f"{where}: only {PICKLE_NAME} (a pickle) is there, and lorakit loads safetensors "
                               f"only; convert it: load the adapter with PEFT (PeftModel.from_pretrained) and call "
                               f"save_pretrained(folder, safe_serialization=True)")
        raise AdapterError(f"{where}: no {WEIGHTS_NAME} in the folder; re-save the adapter with PEFT's "
                           f"save_pretrained()")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            parts, copies = _sort_keys(list(f.keys()), config, where)
            for module, key in copies.items():  # PEFT saves the base weight of targeted embeddings / lm_head
                _check_base_copy(module, tuple(f.get_slice(key).get_shape()), parts, base_modules, where)
            pairs = {}
            for module, slot in parts.items():
                kind = "embedding" if any(p.startswith("lora_embedding") for p in slot) else "linear"
                a, b = ("lora_embedding_A", "lora_embedding_B") if kind == "embedding" else ("lora_A", "lora_B")
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
    return pairs


def _header_shape(f, module: str, key: str, label: str, where: str) -> tuple[int, ...]:
    part = f.get_slice(key)
    if part.get_dtype() not in ("F64", "F32", "F16", "BF16"):
        raise AdapterError(f"{where}: module {module!r}: {label} must be a 2-D floating-point tensor, "
                           f"got {part.get_dtype()}")
    return tuple(part.get_shape())


def _sort_keys(keys: list[str], config: dict, where: str) -> tuple[dict, dict]:
    """Split the file's keys into {module: {param: key}} LoRA weights and {module: key} copies of base weights;
    any other key is an error, except the training-only state of variants the config enables."""
    skip = [pattern for field, pattern in _TRAINING_ONLY_KEYS.items() if config.get(field)]
    parts: dict[str, dict[str, str]] = {}
    copies: dict[str, str] = {}
    unexpected = []
    for key in keys:
        m = _LORA_KEY.fullmatch(key.removeprefix(PEFT_PREFIX)) if key.startswith(PEFT_PREFIX) else None
        if m is not None:
            adapter_name = m["an"] or m["ean"]
            if adapter_name not in (None, "default"):  # PeftModel.from_pretrained loads "default" keys as they are
                raise AdapterError(f"{where}: weight {key!r} still holds the PEFT adapter name {adapter_name!r}, "
                                   f"which PEFT loads only as adapter_name={adapter_name!r}; re-save it with PEFT's "
                                   f"save_pretrained(), which leaves the name out")
            param = m["lin"] or m["emb"]
            slot = parts.setdefault(m["module"], {})
            if param in slot:
                raise AdapterError(f"{where}: module {m['module']!r} has {param} twice ({slot[param]!r} and "
                                   f"{key!r}); keep one")
            slot[param] = key
        elif key.startswith(PEFT_PREFIX) and key.endswith(".base_layer.weight"):
            copies[key[len(PEFT_PREFIX):-len(".base_layer.weight")]] = key
        elif not any(p.search(key) for p in skip):
            unexpected.append(key)
    if unexpected:
        what = sorted({h for h in map(_key_hint, unexpected) if h})
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds {len(unexpected)} weight(s) that are not plain LoRA A/B: "
                           f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                           f"{' (' + '; '.join(what) + ')' if what else ''}; lorakit does not support them")
    if not parts:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds no LoRA weights (no '*.lora_A.weight' or "
                           f"'*.lora_embedding_A' keys under '{PEFT_PREFIX}')")
    return parts, copies


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


def _pattern_value(config: dict, field: str, fallback: str, default, module: str):
    """PEFT's get_pattern_key (utils/other.py) as LoraModel._create_and_replace uses it: the first key of
    ``config[field]``, in file order (PEFT writes them sorted), that matches the end of the module name at a dot
    boundary, else ``config[fallback]``. Returns the value and where it came from."""
    patterns = config.get(field) or {}
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key], f"{field}[{key!r}]"
    return config.get(fallback, default), fallback


def _check_module(module, kind, a_shape, b_shape, config, base_modules, where) -> tuple[int, float]:
    """The rank and scale of one module's LoRA, after checking its shapes against the model and the config."""
    base = _base_module(module, base_modules, where)
    at = f"{where}: module {module!r}"
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
    r, r_from = _pattern_value(config, "rank_pattern", "r", 8, module)
    if r != rank:
        raise AdapterError(f"{at}: the weights have rank {rank} but {CONFIG_NAME} gives rank {r} (from {r_from}); "
                           f"fix r / rank_pattern to match the weights")
    alpha, _ = _pattern_value(config, "alpha_pattern", "lora_alpha", 8, module)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return rank, float(scale)


def _module_lora(module, kind, a, b, config, base_modules, dtype, where) -> ModuleLora:
    at = f"{where}: module {module!r}"
    for t, label in ((a, "A"), (b, "B")):
        if not t.dtype.is_floating_point:
            raise AdapterError(f"{at}: {label} must be a 2-D floating-point tensor, got {t.dtype} {tuple(t.shape)}")
    rank, scale = _check_module(module, kind, tuple(a.shape), tuple(b.shape), config, base_modules, where)
    out = []
    for t, label in ((a, "A"), (b, "B")):
        if not torch.isfinite(t).all():
            raise AdapterError(f"{at}: {label} holds NaN or inf values; the adapter is broken, retrain or re-export")
        cast = t.to(dtype).contiguous()
        if not torch.isfinite(cast).all():
            raise AdapterError(f"{at}: {label} overflows {dtype} (largest |value| {t.abs().max().item():.3g}); "
                               f"load it in a wider dtype such as torch.bfloat16 or torch.float32")
        out.append(cast)
    return ModuleLora(out[0], out[1], rank, scale)
