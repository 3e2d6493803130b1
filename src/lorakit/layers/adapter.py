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
from dataclasses import dataclass, field
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
_DELTA = ".token_adapter.trainable_tokens_delta"  # PEFT's TrainableTokensWrapper rows

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
    embedding: (num_embeddings, embedding_dim). ``tokens``: "input" for the input embedding, "output" for the
    output head (the modules whose rows are tokens), else None."""

    kind: str
    in_features: int
    out_features: int
    tokens: str | None = None

    @property
    def vocab(self) -> int:
        return self.in_features if self.kind == "embedding" else self.out_features

    @property
    def dim(self) -> int:
        return self.out_features if self.kind == "embedding" else self.in_features

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
        return (sum(lora.A.nbytes + lora.B.nbytes for lora in self.modules.values())
                + sum(t.rows.nbytes for t in self.tokens.values()))


def load_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule], dtype: torch.dtype,
                      base_weights: Mapping[str, torch.Tensor] | None = None,
                      strict: bool = True) -> PeftAdapter:  # strict: merged with adapter-format
    """Read config + adapter_model.safetensors, map keys to base module names, validate everything, cast weights
    to ``dtype`` (contiguous, on the CPU). ``base_weights``: the token-indexed modules' weights ([vocab, dim]),
    needed for a full ``modules_to_save`` copy of them (only its rows that differ are kept)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    pairs, token_parts = _read_weights(path, config, base_modules, where)
    modules = {m: _module_lora(m, kind, a, b, config, base_modules, dtype, where) for m, (kind, a, b) in pairs.items()}
    tokens = {m: _module_tokens(m, how, ids, t, base_modules[m], (base_weights or {}).get(m), dtype, where)
              for m, (how, ids, t) in token_parts.items()}
    _check_token_modules(modules, tokens, where)
    return PeftAdapter(name, path, config, modules, tokens)


@dataclass(frozen=True)
class AdapterInfo:
    """What the config and the weights file's header say about an adapter, with no weights read:
    ``modules`` maps each targeted module to its (rank, scale); ``added_tokens``, the token ids past the base
    vocabulary the adapter defines (its requests may use them)."""

    name: str
    path: Path
    config: dict
    modules: dict[str, tuple[int, float]]
    added_tokens: frozenset[int] = frozenset()

    @property
    def max_rank(self) -> int:
        return max((rank for rank, _ in self.modules.values()), default=0)


def inspect_peft_adapter(name: str, path, base_modules: Mapping[str, BaseModule],
                         strict: bool = True) -> AdapterInfo:  # strict: merged with adapter-format
    """Every check ``load_peft_adapter`` makes except those on the values (NaN, overflow), from the config and
    the safetensors header alone: cheap enough to refuse a bad adapter when it is registered."""
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    config = read_adapter_config(name, path)
    pairs, token_parts = _read_weights(path, config, base_modules, where, header_only=True)
    modules = {m: _check_module(m, kind, a, b, config, base_modules, where) for m, (kind, a, b) in pairs.items()}
    added = set()
    for m, (how, ids, shape) in token_parts.items():
        base = base_modules[m]
        _check_token_shape(m, how, ids, shape, base, where)
        if base.tokens == "input":
            added |= set(range(base.vocab, shape[0])) if how == "full" else {i for i in ids if i >= base.vocab}
    _check_token_modules(modules, token_parts, where)
    return AdapterInfo(name, path, config, modules, frozenset(added))


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


def _read_weights(path: Path, config: dict, base_modules: Mapping[str, BaseModule], where: str,
                  header_only: bool = False) -> dict:
    """({module: (kind, A, B)}, {module: (how, ids, rows)}) from the weights file, every key accounted for; kind
    is 'linear' or 'embedding'; how is 'trainable' (rows of ``ids``) or 'full' (a modules_to_save copy, ids
    None). With header_only, tensors are their shapes, and only the header is read."""
    file = weights_file(path, where)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            parts, copies, token_keys = _sort_keys(list(f.keys()), config, base_modules, where)
            token_parts = {}
            for module, (how, ids, key) in token_keys.items():
                shape = _header_shape(f, module, key, "token rows", where)
                token_parts[module] = (how, ids, shape if header_only else f.get_tensor(key))
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
    return pairs, token_parts


def _header_shape(f, module: str, key: str, label: str, where: str) -> tuple[int, ...]:
    part = f.get_slice(key)
    if part.get_dtype() not in ("F64", "F32", "F16", "BF16"):
        raise AdapterError(f"{where}: module {module!r}: {label} must be a 2-D floating-point tensor, "
                           f"got {part.get_dtype()}")
    return tuple(part.get_shape())


def _token_targets(config: dict, base_modules: Mapping[str, BaseModule], where: str) -> tuple[dict, set]:
    """({module: ids} of trainable_token_indices, {modules} of modules_to_save), resolved to the model's token
    modules (the input embedding, the output head) as PEFT resolves them: a list targets the input embedding,
    a dict key or a modules_to_save entry matches the end of a module name."""
    roles = {name: m.tokens for name, m in base_modules.items() if m.tokens}

    def resolve(key: str, field: str) -> str:
        hits = [n for n in roles if n == key or n.endswith("." + key)]
        if not hits:
            others = [n for n in base_modules if n == key or n.endswith("." + key)]
            what = (f"{others[0]!r} is not a token embedding or output head" if others
                    else "the model has no such module")
            raise AdapterError(f"{where}: {field} names {key!r}, but {what}; lorakit serves token rows of the "
                               f"input embedding and output head only ({sorted(roles) or 'none found'})")
        return hits[0]

    tti = config.get("trainable_token_indices") or {}
    if isinstance(tti, list):
        inputs = [n for n, role in roles.items() if role == "input"]
        if not inputs:
            raise AdapterError(f"{where}: trainable_token_indices needs the model's input embedding, which lorakit "
                               f"did not find")
        tti = {inputs[0]: tti}
    if not isinstance(tti, dict):
        raise AdapterError(f"{where}: trainable_token_indices must be a list of ids or a dict module -> ids, "
                           f"got {tti!r:.80}")
    trainable = {}
    for key, ids in tti.items():
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids) or len(set(ids)) != len(ids):
            raise AdapterError(f"{where}: trainable_token_indices[{key!r}] must be distinct non-negative token "
                               f"ids, got {ids!r:.80}")
        trainable[resolve(key, "trainable_token_indices")] = list(ids)
    full = {resolve(key, "modules_to_save") for key in (config.get("modules_to_save") or [])}
    both = full & trainable.keys()
    if both:
        raise AdapterError(f"{where}: {sorted(both)} is in both modules_to_save and trainable_token_indices; "
                           f"PEFT refuses this too, keep one")
    return trainable, full


def _sort_keys(keys: list[str], config: dict, base_modules: Mapping[str, BaseModule], where: str) -> tuple:
    """Split the file's keys into {module: {param: key}} LoRA weights, {module: key} copies of base weights and
    {module: (how, ids, key)} token rows; any other key is an error, except the training-only state of
    variants the config enables."""
    skip = [pattern for field, pattern in _TRAINING_ONLY_KEYS.items() if config.get(field)]
    trainable, full = _token_targets(config, base_modules, where)
    parts: dict[str, dict[str, str]] = {}
    copies: dict[str, str] = {}
    tokens: dict[str, tuple] = {}
    unexpected = []
    for key in keys:
        module = key.removeprefix(PEFT_PREFIX) if key.startswith(PEFT_PREFIX) else None
        if module is not None and module.endswith(_DELTA) and module[:-len(_DELTA)] in trainable:
            module = module[:-len(_DELTA)]
            tokens[module] = ("trainable", trainable[module], key)
            continue
        if module is not None and module.endswith(".weight") and module[:-len(".weight")] in full:
            module = module[:-len(".weight")]
            tokens[module] = ("full", None, key)
            continue
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
    missing = (trainable.keys() | full) - tokens.keys()
    if missing:
        raise AdapterError(f"{where}: {CONFIG_NAME} names token rows for {sorted(missing)} but {WEIGHTS_NAME} "
                           f"holds none for them; the weights file is incomplete, re-save the adapter")
    if not parts and not tokens:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} holds no LoRA weights (no '*.lora_A.weight' or "
                           f"'*.lora_embedding_A' keys under '{PEFT_PREFIX}')")
    return parts, copies, tokens


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


def _check_token_shape(module: str, how: str, ids, shape: tuple, base: BaseModule, where: str) -> None:
    at = f"{where}: module {module!r}"
    if len(shape) != 2 or shape[1] != base.dim:
        raise AdapterError(f"{at}: token rows have shape {list(shape)} but the model's rows are {base.dim} wide; "
                           f"was the adapter trained for another base model?")
    if how == "trainable" and shape[0] != len(ids):
        raise AdapterError(f"{at}: {len(ids)} trainable_token_indices but {shape[0]} saved rows; the weights file "
                           f"does not match its config")
    if how == "full" and shape[0] < base.vocab:
        raise AdapterError(f"{at}: the saved copy has {shape[0]} rows, fewer than the model's vocabulary "
                           f"({base.vocab}); was the adapter trained for another base model?")


def _module_tokens(module: str, how: str, ids, t: torch.Tensor, base: BaseModule, base_weight, dtype,
                   where: str) -> ModuleTokens:
    """The rows an adapter replaces or adds: all of a trainable-tokens delta; of a full copy, the rows that
    differ from the base weight and every row past the base vocabulary."""
    at = f"{where}: module {module!r}"
    _check_token_shape(module, how, ids, tuple(t.shape), base, where)
    if not t.dtype.is_floating_point:
        raise AdapterError(f"{at}: token rows must be floating-point, got {t.dtype}")
    if not torch.isfinite(t).all():
        raise AdapterError(f"{at}: token rows hold NaN or inf values; the adapter is broken, retrain or re-export")
    if how == "full":
        if base_weight is None:
            raise AdapterError(f"{at}: a full modules_to_save copy needs the base weight to compare against")
        base_rows = base_weight.detach().to("cpu", t.dtype)
        changed = (t[: base.vocab] != base_rows).any(dim=1).nonzero()[:, 0]
        ids = torch.cat([changed, torch.arange(base.vocab, t.shape[0])])
        t = t[ids]
    else:
        ids = torch.tensor(ids, dtype=torch.int64)
    order = ids.argsort()
    rows = t[order].to(dtype).contiguous()
    if not torch.isfinite(rows).all():
        raise AdapterError(f"{at}: token rows overflow {dtype}; load it in a wider dtype such as torch.float32")
    return ModuleTokens(ids[order].contiguous(), rows)


def _check_token_modules(modules: Mapping, tokens: Mapping, where: str) -> None:
    both = modules.keys() & tokens.keys()
    if both:
        raise AdapterError(f"{where}: {sorted(both)} has both LoRA weights and token rows; lorakit serves one or "
                           f"the other per module")


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
