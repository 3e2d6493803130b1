"""Models and adapters named by Hugging Face hub id: ``ORG/NAME``, or ``ORG/NAME@REVISION`` (a branch, tag or
commit), downloaded once into the hub's own cache (``HF_HOME`` / ``HF_HUB_CACHE``) by ``huggingface_hub``, which
also honours ``HF_HUB_OFFLINE`` (the cache only) and ``HF_TOKEN``.

A folder that exists locally wins over an id of the same spelling; the log says which was used. Only what lorakit
reads is downloaded: configs, safetensors weights, tokenizer and chat-template files. Never a pickle (``*.bin``,
``*.pt``, ``*.pth``, ``*.pkl``) or code (``*.py``): a repo that has only pickled weights resolves to a folder
without weights, which the model or adapter checks then refuse by name. ``lorakit serve`` resolves its ``--model``
and ``--lora`` ids before it starts the engine core, its API servers or tensor-parallel ranks, so they all read one
download.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

__all__ = ["ADAPTER_FILES", "MODEL_FILES", "hub_id", "local_or_hub"]

logger = logging.getLogger("lorakit.adapters.hub")

_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken", "chat_template.json",
                    "chat_template.jinja"]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               *_TOKENIZER_FILES]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", *_TOKENIZER_FILES]

# What the hub accepts as a repo id: an optional namespace and a name of letters, digits, "-", "_" and "." (no "--"
# or ".." and no leading or trailing "-" / "."), each at most 96 characters.
_PART = r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_ID = re.compile(rf"(?:{_PART}/)?{_PART}")


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``spec`` reads as ``ORG/NAME[@REVISION]``; None otherwise (a path)."""
    repo, at, revision = spec.partition("@")
    if "/" not in repo or not _ID.fullmatch(repo) or (at and not revision):
        return None
    return repo, revision or None


def local_or_hub(spec: str, what: str, files: list[str]) -> Path:
    """The folder ``spec`` names: a local path when one exists there, else the hub id's snapshot (``files`` of it:
    MODEL_FILES or ADAPTER_FILES), downloaded if it is not in the cache. ``what`` names it in the log and in errors
    (``--model``, ``--lora sql``). A spec that is neither an existing path nor an id comes back as a path (the
    caller's checks say "no such folder"). FileNotFoundError, in one line naming the id and the cache, when the id
    cannot be had: not in the cache while offline, no such repo or revision, no network."""
    path = Path(spec).expanduser()
    parsed = hub_id(spec)
    if path.exists() or parsed is None:
        if parsed is not None:
            logger.info("%s %s: the local folder %s (a folder of that name wins over the hub id)", what, spec,
                        path.resolve())
        return path
    repo, revision = parsed
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision}" if revision else ""
    cache = constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=files))
    except GatedRepoError:
        raise FileNotFoundError(f"{what} {spec}: the hub repo {repo} is gated; accept its terms on the hub and set "
                                f"HF_TOKEN") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{what} {spec}: the hub repo {repo} has no revision {revision}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{what} {spec}: no hub repo {repo} (or it is private: set HF_TOKEN), and no local "
                                f"folder of that name") from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else " and the hub cannot be reached"
        raise FileNotFoundError(f"{what} {spec}: {repo}{at} is not in the Hugging Face cache at {cache}{offline}; "
                                f"download it once with network, or give a local folder") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"{what} {spec}: the hub answered {e}".splitlines()[0]) from None
    weights = "adapter_model.safetensors" if files is ADAPTER_FILES else "*.safetensors"
    if not any(folder.glob(weights)):
        raise FileNotFoundError(f"{what} {spec}: the hub repo {repo}{at} has no {weights} (lorakit reads no pickled "
                                f"weights such as *.bin); use a revision or repo with safetensors weights")
    logger.info("%s %s: hub repo %s%s, from the cache at %s", what, spec, repo, at, folder)
    return folder
