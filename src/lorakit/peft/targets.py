"""Which of a model's modules a PEFT ``LoraConfig`` adapts, resolved against the model's module names exactly as
PEFT resolves them when it loads the adapter (peft 0.21: tuners/tuners_utils.py ``check_target_module_exists``,
``_maybe_include_all_linear_layers`` and ``_check_tied_modules``; utils/other.py ``set_additional_trainable_modules``).
Names only: nothing here reads weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import regex

from lorakit.peft.config import CONFIG_NAME, AdapterError, _is_int
from lorakit.peft.experts import parameter_targets

EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")  # peft.utils.constants: what ensure_weight_tying looks for


# The config's patterns come from whoever wrote the adapter folder (a runtime load is a security boundary): each
# match gets a time limit, so a pattern built to backtrack forever is refused instead of holding a thread.
MATCH_SECONDS = 0.1


def _fullmatch(pattern: str, name: str):
    return regex.fullmatch(pattern, name, timeout=MATCH_SECONDS)


def _match(pattern: str, name: str):
    return regex.match(pattern, name, timeout=MATCH_SECONDS)


def lora_targets(config: dict, base_modules: Mapping, tied: bool, where: str) -> set[str] | None:
    """The modules of ``base_modules`` PEFT wraps with LoRA layers for this config; None when the config names no
    target_modules (PEFT then picks defaults by model type, which lorakit cannot know). ``tied``: the model's output
    head shares the input embedding's weight."""
    target = config.get("target_modules")
    params = parameter_targets(config, base_modules, where)  # target_parameters: stacked MoE experts
    if target is None:
        return params or None
    try:
        if isinstance(target, str) and target.lower() == "all-linear":  # every linear but the output head
            target = [n for n, m in base_modules.items() if m.kind == "linear" and m.tokens != "output"]
        found = {n for n, m in base_modules.items() if m.kind != "experts" and _is_target(config, target, n)}
        copied = any(m.split(".")[-1] in EMBEDDING_LAYER_NAMES for m in config.get("modules_to_save") or [])
        if tied and config.get("ensure_weight_tying") and not copied and _names_embedding(config["target_modules"]):
            # PEFT adapts the input embedding and ties the head's LoRA layer to it, whatever else the config says
            found |= {n for n, m in base_modules.items() if m.tokens == "input" and not _is_excluded(config, n)}
            found |= {n for n, m in base_modules.items() if m.tokens == "output"}
    except regex.error as e:
        raise AdapterError(f"{where}: {CONFIG_NAME}: target_modules, exclude_modules, layers_pattern or "
                           f"modules_to_save holds an invalid regular expression ({e})") from e
    except TimeoutError as e:
        raise AdapterError(f"{where}: {CONFIG_NAME}: a pattern in target_modules, exclude_modules, layers_pattern "
                           f"or modules_to_save takes too long to match a module name (over {MATCH_SECONDS} s: "
                           f"catastrophic backtracking); simplify it") from e
    return found | params


def _names_embedding(target) -> bool:
    if isinstance(target, str):
        return any(_fullmatch(target, name) for name in EMBEDDING_LAYER_NAMES)
    return any(t.split(".")[-1] in EMBEDDING_LAYER_NAMES for t in target)


def _is_excluded(config: dict, name: str) -> bool:
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and _fullmatch(exclude, name):
        return True
    if isinstance(exclude, list) and (name in exclude or any(name.endswith("." + e) for e in exclude)):
        return True
    # adapters never wrap a modules_to_save module (its copy is trained whole)
    return any(_match(rf"(^|.*\.){m}($|\..*)", name) for m in config.get("modules_to_save") or [])


def _is_target(config: dict, target, name: str) -> bool:
    """PEFT's check_target_module_exists: a string is a regex the whole name must match; a list entry is the whole
    name, or its end at a dot boundary, the latter filtered by layers_to_transform / layers_pattern."""
    if _is_excluded(config, name):
        return False
    if isinstance(target, str):
        return _fullmatch(target, name) is not None
    if name in target:
        return True
    if not any(name.endswith("." + t) for t in target):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    if not patterns:
        match = _match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)  # the first numbered segment
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = _match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match["idx"])
    return index == layers if _is_int(layers) else index in layers


@dataclass(frozen=True)
class TokenTargets:
    """The token modules (input embedding, output head) a config trains rows of: ``trainable``, module -> the
    ids of its trainable_token_indices rows; ``optional``, those of them whose rows PEFT may leave out of the file
    (a head tied to the embedding shares its rows); ``full``, the modules_to_save modules (copied whole)."""

    trainable: dict[str, list[int]]
    optional: frozenset[str]
    full: frozenset[str]


def token_targets(config: dict, base_modules: Mapping, tied: bool, where: str) -> TokenTargets:
    """trainable_token_indices and modules_to_save resolved to the model's token modules as PEFT resolves them:
    a list targets the input embedding, a dict key or a modules_to_save entry matches the end of a module name;
    with a tied head, PEFT gives the head the embedding's token adapter unless the dict names the head with other
    ids."""
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

    inputs = [n for n, role in roles.items() if role == "input"]
    heads = [n for n, role in roles.items() if role == "output"]
    tti = config.get("trainable_token_indices") or {}
    if isinstance(tti, list):
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
    optional = set()
    if tied and inputs and heads and inputs[0] in trainable and heads[0] not in full:
        ids = trainable[inputs[0]]
        if trainable.setdefault(heads[0], ids) == ids:  # named with other ids, the head is wrapped on its own
            optional.add(heads[0])
    return TokenTargets(trainable, frozenset(optional), frozenset(full))
