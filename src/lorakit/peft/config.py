"""Read and validate a PEFT LoRA ``adapter_config.json``: every LoraConfig field that changes PEFT's
forward is matched by lorakit or refused with an ``AdapterError`` (lorakit's one adapter error type, defined here)
naming the adapter and the fix.
Semantics are those of peft 0.21 (tuners/lora/config.py). The work is bounded: a config larger than
``MAX_CONFIG_BYTES`` is refused unread, one nested deeper than ``MAX_JSON_DEPTH`` unparsed."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1 KiB
MAX_JSON_DEPTH = 64  # arrays and objects inside one another; PEFT's configs nest 3 deep
MAX_INVOCATION_TOKENS = 256  # an activated LoRA's invocation sequence; trained ones are a few tokens


class AdapterError(ValueError):
    """A PEFT adapter that lorakit cannot serve: the message names the adapter, the module (if any) and the problem."""


# LoraConfig fields that change the forward when truthy (PEFT's `resolve_lora_variant` tests bool(value)).
_UNSUPPORTED = {
    "use_qalora": "QA-LoRA pools the input in groups before lora_A",
    "lora_bias": "lora_B carries a bias",
    "use_bdlora": "BD-LoRA stores block-diagonal lora_A/lora_B",
    "arrow_config": "Arrow routes each token among several adapters",
    "kasa_config": "KaSA adds a singular-value diagonal and truncates the base weight",
    "megatron_config": "Megatron tensor-parallel LoRA layers",
    "layer_replication": "layer replication changes the model's stack of layers",
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
    "trainable_token_indices", "modules_to_save",  # checked against the model in targets.py and tokens.py
    "alora_invocation_tokens",  # activated LoRA: the engine applies the adapter from the invocation on
    "target_parameters",  # stacked MoE expert parameters: experts.py
    "use_dora",  # DoRA: the magnitudes are checked in read.py, the rescale computed in layers/dora.py
} | _UNSUPPORTED.keys() | _TRAINING_ONLY_KEYS.keys()
_INIT_OK = {"gaussian", "eva", "orthogonal", "mica"}  # inits that leave the base weights alone
_INIT_MUTATES_BASE = ("pissa", "olora", "corda", "lora_ga")  # subtract scale * B0 @ A0 from the base weight


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
    config = read_json(file, where, MAX_CONFIG_BYTES, "re-save the adapter with PEFT's save_pretrained()")
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_NAME} must hold a JSON object, got {type(config).__name__}")
    _check_config(config, where)
    return config


def read_json(file: Path, where: str, max_bytes: int, fix: str):
    """The JSON value in ``file``, refused (AdapterError naming the file and ``fix``) when it is larger than
    ``max_bytes`` (read no further), nested deeper than ``MAX_JSON_DEPTH``, or not readable, valid JSON."""
    name = Path(file).name
    try:
        with open(file, "rb") as f:
            data = f.read(max_bytes + 1) if os.fstat(f.fileno()).st_size <= max_bytes else None
    except OSError as e:
        raise AdapterError(f"{where}: {name} is not readable ({e}); {fix}") from e
    if data is None or len(data) > max_bytes:
        raise AdapterError(f"{where}: {name} is larger than {max_bytes} bytes, far more than such a file holds; "
                           f"{fix}")
    return parse_json(data, f"{where}: {name}", fix)


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def parse_json(data: bytes, what: str, fix: str):
    """``data`` parsed as JSON, nested at most ``MAX_JSON_DEPTH`` deep (counted before parsing: Python's parser
    recurses), else AdapterError naming ``what`` and ``fix``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AdapterError(f"{what} is not UTF-8 text ({e}); {fix}") from e
    depth = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", text)):  # brackets outside strings
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise AdapterError(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} deep; {fix}")
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError
        raise AdapterError(f"{what} is not readable, valid JSON ({e}); {fix}") from e


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
    invocation = cfg.get("alora_invocation_tokens")
    if invocation and not (isinstance(invocation, list) and len(invocation) <= MAX_INVOCATION_TOKENS
                           and all(_is_int(t) and 0 <= t < 2**31 for t in invocation)):
        bad(f"alora_invocation_tokens must be null or a list of at most {MAX_INVOCATION_TOKENS} token ids (ints "
            f"in [0, 2**31)), got {invocation!r:.120}; set it to the ids of the invocation string the activated "
            f"LoRA was trained with")
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
