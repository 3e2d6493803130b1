"""Read a PEFT LoRA adapter folder and check that lorakit can serve it exactly as PEFT would.

Contract: ``load_peft_adapter`` returns, for every base-model module that the weights file names, the A, B,
rank and scale PEFT's ``LoraLayer`` uses (linear ``y += scale * (x @ A.T) @ B.T``, embedding
``y += scale * A.T[ids] @ B.T``), or raises ``AdapterError`` naming the adapter, the module and the fix.
Every ``LoraConfig`` field that changes PEFT's forward is matched or refused; nothing is unpickled.
Semantics are those of peft 0.21: tuners/lora/{config,layer,model}.py, utils/other.py, utils/save_and_load.py.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the base model, in every saved key

# LoraConfig fields that change the forward when truthy (PEFT's `resolve_lora_variant` tests bool(value)).
_UNSUPPORTED = {
    "use_dora": "DoRA rescales the adapted weight by a learned magnitude; merge it with PEFT's merge_and_unload()",
    "use_qalora": "QA-LoRA pools the input in groups before lora_A",
    "lora_bias": "lora_B carries a bias",
    "alora_invocation_tokens": "Activated LoRA applies the adapter only after the invocation tokens",
    "use_bdlora": "BD-LoRA stores block-diagonal lora_A/lora_B",
    "arrow_config": "Arrow routes each token among several adapters",
    "kasa_config": "KaSA adds a singular-value diagonal and truncates the base weight",
    "megatron_config": "Megatron tensor-parallel LoRA layers",
    "layer_replication": "layer replication changes the model's stack of layers",
    "target_parameters": "LoRA on nn.Parameter targets (e.g. MoE experts)",
    "trainable_token_indices": "trainable tokens replace rows of the embedding",
    "modules_to_save": "full trained copies of modules",
}
# Variants whose inference forward is vanilla LoRA; their training-only state in the weights file is skipped.
_TRAINING_ONLY_KEYS = {
    "velora_config": re.compile(r"\.lora_velora_embed$"),
    "monteclora_config": re.compile(r"\.lora_monteclora_sampler\.\w+$"),
}
# Fields read elsewhere in this file, or that do not change the forward at inference.
_KNOWN = {
    "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "bias", "init_lora_weights", "target_modules",
    "exclude_modules", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "megatron_core", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "qalora_group_size", "runtime_config", "ensure_weight_tying",
} | _UNSUPPORTED.keys() | _TRAINING_ONLY_KEYS.keys()
_INIT_OK = {"gaussian", "eva", "orthogonal", "mica"}  # inits that leave the base weights alone
_INIT_MUTATES_BASE = ("pissa", "olora", "corda", "lora_ga")  # subtract scale * B0 @ A0 from the base weight

# "<module>.lora_A.weight" / "<module>.lora_embedding_A", optionally with a PEFT adapter name inside.
_LORA_KEY = re.compile(r"(?P<module>.+)\.(?:(?P<lin>lora_[AB])(?:\.(?P<an>[^.]+))?\.weight"
                       r"|(?P<emb>lora_embedding_[AB])(?:\.(?P<ean>[^.]+))?)")
# What an unexpected key most likely is, first match wins.
_KEY_HINTS = (("lora_magnitude_vector", "DoRA magnitudes (use_dora)"), ("lora_B.bias", "lora_B biases (lora_bias)"),
              ("trainable_tokens", "trainable tokens (trainable_token_indices)"),
              (".bias", "biases of the base layers (bias='all' or 'lora_only')"),
              (".weight", "full module weights (modules_to_save, or an embedding resized during fine-tuning)"))


class AdapterError(ValueError):
    """A PEFT adapter that lorakit cannot serve: the message names the adapter, the module (if any) and the problem."""


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


def read_adapter_config(name: str, path) -> dict:
    """Parse and validate adapter_config.json (no weights read); returns its contents unchanged."""
    path = Path(path)
    where = f"adapter {name!r} at {path}"
    if not path.exists():
        raise AdapterError(f"{where}: no such folder; pass the folder PEFT's save_pretrained() wrote "
                           f"(it holds {CONFIG_NAME} and {WEIGHTS_NAME})")
    if not path.is_dir():
        raise AdapterError(f"{where}: this is a file, not a folder; pass the folder that holds {CONFIG_NAME}")
    file = path / CONFIG_NAME
    if not file.is_file():
        subs = sorted(p.name for p in path.iterdir() if (p / CONFIG_NAME).is_file())
        hint = (f"it has adapter subfolders {subs}: pass one of those" if subs else
                "it looks like a full model (config.json), not a PEFT adapter" if (path / "config.json").exists()
                else "pass the folder PEFT's save_pretrained() wrote")
        raise AdapterError(f"{where}: no {CONFIG_NAME} in the folder; {hint}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise AdapterError(f"{where}: {CONFIG_NAME} is not readable, valid JSON ({e}); re-save the adapter with "
                           f"PEFT's save_pretrained()") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_NAME} must hold a JSON object, got {type(config).__name__}")
    _check_config(config, where)
    return config


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_strs(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _check_config(cfg: dict, where: str) -> None:
    def bad(msg: str):
        raise AdapterError(f"{where}: {CONFIG_NAME}: {msg}")

    if cfg.get("peft_type") != "LORA":
        bad(f"peft_type is {cfg.get('peft_type')!r}; lorakit serves LoRA adapters only (peft_type 'LORA')")
    for field, what in _UNSUPPORTED.items():
        if cfg.get(field):
            bad(f"{field}={cfg[field]!r} is not supported yet ({what}); retrain or convert to plain LoRA")
    unknown = sorted(k for k in cfg.keys() - _KNOWN if cfg[k] not in (None, False, 0, "", [], {}))
    if unknown:
        by = f" (written by peft {cfg['peft_version']})" if cfg.get("peft_version") else ""
        bad(f"sets {unknown}, field(s) this lorakit does not know{by}; they may change the LoRA forward, so the "
            f"adapter is refused. If they do not, delete them from the file")
    if cfg.get("bias", "none") != "none":
        bad(f"bias={cfg['bias']!r} is not supported yet (trained biases of the base layers); only 'none' is")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_INIT_MUTATES_BASE):
        bad(f"init_lora_weights={init!r}: PEFT changed the base weights at init, so the adapter does not apply to "
            f"the original model; re-save it with save_pretrained(..., path_initial_model_for_weight_conversion=...)"
            f" which turns it into a plain LoRA adapter")
    if init == "loftq":
        bad("init_lora_weights='loftq': the adapter was trained against LoftQ's quantized base weights, "
            "not the original model, and lorakit does not serve those")
    if not isinstance(init, bool) and not (isinstance(init, str) and init.lower() in _INIT_OK):
        bad(f"init_lora_weights={init!r} is not one lorakit knows (true, false, {sorted(_INIT_OK)})")
    r = cfg.get("r", 8)
    if not _is_int(r) or r < 1:
        bad(f"r must be a positive int, got {r!r}")
    if not _is_real(cfg.get("lora_alpha", 8)):
        bad(f"lora_alpha must be a finite number, got {cfg['lora_alpha']!r}")
    for field in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(cfg.get(field, False), bool):
            bad(f"{field} must be true or false, got {cfg[field]!r}")
    for field in ("target_modules", "exclude_modules", "layers_pattern"):
        if cfg.get(field) is not None and not _is_strs(cfg[field]):
            bad(f"{field} must be a string, a list of strings or null, got {cfg[field]!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (_is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
        bad(f"layers_to_transform must be an int, a list of ints or null, got {layers!r}")
    if isinstance(cfg.get("target_modules"), str) and (layers is not None or cfg.get("layers_pattern") is not None):
        bad("layers_to_transform and layers_pattern cannot be used when target_modules is a regex string")
    if cfg.get("layers_pattern") and layers is None:
        bad("layers_pattern is set but layers_to_transform is not; set both or neither")
    for field, ok, kind in (("rank_pattern", lambda v: _is_int(v) and v >= 1, "positive ints"),
                            ("alpha_pattern", _is_real, "finite numbers")):
        patterns = cfg.get(field) or {}
        if not isinstance(patterns, dict) or not all(ok(v) for v in patterns.values()):
            bad(f"{field} must map module-name patterns to {kind}, got {patterns!r}")
        for key in patterns:
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as e:
                bad(f"{field} key {key!r} is not a valid regular expression ({e})")


def _read_weights(path: Path, config: dict, base_modules: Mapping[str, BaseModule], where: str) -> dict:
    """{module: (kind, A, B)} from the weights file, every key accounted for; kind is 'linear' or 'embedding'."""
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
                pairs[module] = (kind, f.get_tensor(slot[a]), f.get_tensor(slot[b]))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} is not a readable safetensors file ({e}); "
                           f"re-save the adapter with PEFT's save_pretrained()") from e
    return pairs


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


def _module_lora(module, kind, a, b, config, base_modules, dtype, where) -> ModuleLora:
    base = _base_module(module, base_modules, where)
    at = f"{where}: module {module!r}"
    if base.kind != kind:
        stored = "lora_embedding_A/B" if kind == "embedding" else "lora_A/lora_B"
        raise AdapterError(f"{at} is {'an' if base.kind == 'embedding' else 'a'} {base.kind} in the model but the "
                           f"adapter stores {kind} LoRA weights ({stored}) for it; was it trained for another model?")
    for t, label in ((a, "A"), (b, "B")):
        if t.dim() != 2 or not t.dtype.is_floating_point:
            raise AdapterError(f"{at}: {label} must be a 2-D floating-point tensor, got {t.dtype} "
                               f"{tuple(t.shape)}")
    rank = a.shape[0]
    if b.shape[1] != rank:
        raise AdapterError(f"{at}: A has rank {rank} (shape {tuple(a.shape)}) but B has rank {b.shape[1]} "
                           f"(shape {tuple(b.shape)}); the weights file is inconsistent")
    want_a, want_b = (rank, base.in_features), (base.out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise AdapterError(f"{at}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's module "
                           f"({base.kind} {base.in_features} -> {base.out_features}), which needs A {want_a} and "
                           f"B {want_b}; was the adapter trained for another base model?")
    r, r_from = _pattern_value(config, "rank_pattern", "r", 8, module)
    if r != rank:
        raise AdapterError(f"{at}: the weights have rank {rank} but {CONFIG_NAME} gives rank {r} (from {r_from}); "
                           f"fix r / rank_pattern to match the weights")
    alpha, _ = _pattern_value(config, "alpha_pattern", "lora_alpha", 8, module)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    out = []
    for t, label in ((a, "A"), (b, "B")):
        if not torch.isfinite(t).all():
            raise AdapterError(f"{at}: {label} holds NaN or inf values; the adapter is broken, retrain or re-export")
        cast = t.to(dtype).contiguous()
        if not torch.isfinite(cast).all():
            raise AdapterError(f"{at}: {label} overflows {dtype} (largest |value| {t.abs().max().item():.3g}); "
                               f"load it in a wider dtype such as torch.bfloat16 or torch.float32")
        out.append(cast)
    return ModuleLora(out[0], out[1], rank, float(scale))
