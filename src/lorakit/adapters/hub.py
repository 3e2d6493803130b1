"""Models and adapters named by Hugging Face hub id: ``ORG/NAME``, or ``ORG/NAME@REVISION`` (a branch, tag or
commit), downloaded once into the hub's own cache (``HF_HOME`` / ``HF_HUB_CACHE``) by ``huggingface_hub``, which
also honours ``HF_HUB_OFFLINE`` (the cache only) and ``HF_TOKEN``.

A folder that exists locally wins over an id of the same spelling; the log says which was used. Only what lorakit
reads is downloaded: configs, safetensors weights, tokenizer and chat-template files. Never a pickle (``*.bin``,
``*.pt``, ``*.pth``, ``*.pkl``) or code (``*.py``): a repo that has only pickled weights resolves to a folder
without weights, which the model or adapter checks then refuse by name. ``lorakit serve`` resolves its ``--model``
and ``--lora`` ids before it starts the engine core, its API servers or tensor-parallel ranks, so they all read one
download.

A revision is checked as git checks a ref name before anything reads the cache, and what is read must lie in the
repo's own cache folder once links are resolved: an id names that repo's files and nothing else on the disk.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

__all__ = ["ADAPTER_FILES", "MODEL_FILES", "check_revision", "from_hub", "hub_id", "local_or_hub", "repo_folder"]

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
_COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_REVISION_CHARS = 255
_OUTSIDE = "the hub cache's files for it lead outside the repo's own cache folder (a link or ref to elsewhere); refused"


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``spec`` reads as ``ORG/NAME[@REVISION]``; None otherwise (a path)."""
    repo, at, revision = spec.partition("@")
    if "/" not in repo or not _ID.fullmatch(repo) or (at and not revision):
        return None
    return repo, revision or None


def check_revision(revision: str) -> str:
    """``revision`` when git could name a commit, branch or tag by it (``git check-ref-format``'s rules, at most
    MAX_REVISION_CHARS): nothing in it can leave the repo's ``refs/`` or ``snapshots/`` folder. ValueError naming
    the rule it breaks otherwise."""
    problem = _revision_problem(revision)
    if problem:
        shown = repr(revision) if len(revision) <= 200 else f"{revision[:160]!r}... ({len(revision)} characters)"
        raise ValueError(f"revision {shown} is not a commit hash, branch or tag name: {problem}")
    return revision


def _revision_problem(revision: str) -> str | None:
    if not revision:
        return "it is empty"
    if len(revision) > MAX_REVISION_CHARS:
        return f"it is longer than {MAX_REVISION_CHARS} characters"
    if any(c.isspace() or not c.isprintable() for c in revision):
        return "it holds a control character or space"
    if revision.startswith("/") or revision.endswith("/"):
        return f"it {'starts' if revision.startswith('/') else 'ends'} with '/'"
    for text in ("..", "//", "\\", "@{", "~", "^", ":", "?", "*", "["):
        if text in revision:
            return f"it holds {text!r}"
    if revision == "@":
        return "it is '@'"
    if revision.endswith(".") or any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        return "a part of it starts with '.' or ends with '.lock', or it ends with '.'"
    return None


def repo_folder(repo: str) -> Path:
    """Hub repo ``repo``'s own folder in the hub cache (its refs, snapshots and blobs), links resolved."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(os.path.realpath(Path(constants.HF_HUB_CACHE).expanduser() / repo_folder_name(repo_id=repo,
                                                                                                repo_type="model")))


def local_or_hub(spec: str, what: str, files: list[str]) -> Path:
    """The folder ``spec`` names: a local path when one exists there, else the hub id's snapshot (``from_hub``). A
    spec that is neither an existing path nor an id comes back as a path (the caller's checks say "no such
    folder")."""
    path = Path(spec).expanduser()
    parsed = hub_id(spec)
    if path.exists() or parsed is None:
        if parsed is not None:
            logger.info("%s %s: the local folder %s (a folder of that name wins over the hub id)", what, spec,
                        path.resolve())
        return path
    return from_hub(*parsed, what, files)


def from_hub(repo: str, revision: str | None, what: str, files: list[str]) -> Path:
    """The snapshot of hub repo ``repo`` at ``revision`` (None: main), ``files`` of it (MODEL_FILES or
    ADAPTER_FILES) downloaded if they are not in the cache. ``what`` names it in the log and in errors (``--model``,
    ``--lora sql``). ValueError when ``repo`` is no repo id, the revision no git name, or the cache leads outside
    ``repo_folder(repo)`` (said before the cache is read, the same whatever lies outside); FileNotFoundError, in one
    line naming the id and the cache, when the id cannot be had: not in the cache while offline, no such repo or
    revision, no network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    spec, at = (f"{repo}@{revision}", f" at revision {revision}") if revision else (repo, "")
    if not _ID.fullmatch(repo):
        raise ValueError(f"{what} {repo!r}: not a hub repo id (NAME or ORG/NAME of letters, digits, '-', '_' and '.')")
    if revision is not None:
        try:
            check_revision(revision)
        except ValueError as e:
            raise ValueError(f"{what} {repo}: {e}") from None
    root, cache = repo_folder(repo), constants.HF_HUB_CACHE
    try:
        _check_cached(root, revision or constants.DEFAULT_REVISION, f"{what} {spec}")
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
    except OSError as e:  # the cache's own folders unreadable or unwritable
        raise FileNotFoundError(f"{what} {spec}: the Hugging Face cache at {cache} cannot be used "
                                f"({e.strerror or e})") from None
    _check_inside(folder, root, f"{what} {spec}")
    weights = "adapter_model.safetensors" if files is ADAPTER_FILES else "*.safetensors"
    if not any(folder.glob(weights)):
        raise FileNotFoundError(f"{what} {spec}: the hub repo {repo}{at} has no {weights} (lorakit reads no pickled "
                                f"weights such as *.bin); use a revision or repo with safetensors weights")
    logger.info("%s %s: hub repo %s%s, from the cache at %s", what, spec, repo, at, folder)
    return folder


def _check_cached(root: Path, revision: str, where: str) -> None:
    """What ``snapshot_download`` would read of repo folder ``root`` for a checked ``revision`` (its ref file, the
    commit hash in it, that commit's snapshot) lies inside ``root``; ValueError otherwise. Reads one ref file of
    ``root`` at most and looks at nothing outside it: the answer is the same whatever lies there."""
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = root / "refs" / revision
        _check_inside(ref, root, where, files=False)
        if not ref.exists():
            return  # not cached: nothing to check before the download
        if not ref.is_file():
            raise ValueError(f"{where}: the hub cache's refs/{revision} is a folder of refs, not a branch or tag")
        with open(ref, "rb") as f:
            commit = f.read(41).decode("ascii", "replace")
        if not _COMMIT.fullmatch(commit):
            raise ValueError(f"{where}: the hub cache's refs/{revision} holds no commit hash (a damaged cache: "
                             f"delete the repo's cache folder and download it again)")
    _check_inside(root / "snapshots" / commit, root, where)


def _check_inside(path: Path, root: Path, where: str, files: bool = True) -> None:
    """ValueError unless ``path`` (and, with ``files``, everything in it when it is a folder) lies inside ``root``
    once links are resolved; a dangling link counts where it points, and nothing outside ``root`` is looked at."""
    real = Path(os.path.realpath(path))
    inside = real.is_relative_to(root)
    if inside and files and real.is_dir():
        inside = all(Path(os.path.realpath(Path(top, name))).is_relative_to(root)
                     for top, folders, names in os.walk(real) for name in folders + names)
    if not inside:
        raise ValueError(f"{where}: {_OUTSIDE}")
