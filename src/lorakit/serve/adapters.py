"""Adapters loaded and unloaded at run time, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` as vLLM
has them.

Loading from paths is a security boundary: off unless ``allow_runtime_lora``, and then only folders inside
``lora_roots`` (``confined``: a relative path is taken inside them; symbolic links resolved, so neither ``..`` nor a
link escapes; every file is checked again when it is read) or Hugging Face hub ids that an ``allow_lora_repos``
pattern matches (at a revision git could name, downloaded into the hub cache and read only from the repo's own
folder there: ``lorakit.adapters.hub``), only safetensors (the loader never unpickles), only names the pool accepts
(``check_name``). The files are read once and checked in full off the engine thread; what is served is that snapshot
(``lorakit.adapters.snapshot``). A load under a registered name is a hot-swap: running requests keep their version,
and a load that fails leaves the old version serving. ``PUT /v1/lora_adapters/NAME`` takes an adapter pushed from a
training loop: its weights as the body, a safetensors file (its header's metadata holds the config as
``adapter_config``; ``lorakit.serve.push`` writes one), checked in full as a folder is; no path is involved. From a
client on this host, the body may instead be JSON naming a buffer in the client's CUDA memory (``IpcPush``: the
tensors are copied device to device, never through the host); it is taken only over a loopback connection.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
from pathlib import Path

import msgspec

from lorakit.adapters.pool import TooManyVersions, VersionTaken, check_name
from lorakit.adapters.shared import SharedWeights
from lorakit.adapters.hub import ADAPTER_FILES, check_revision, from_hub, hub_id, repo_folder
from lorakit.peft import AdapterError
from lorakit.serve.protocol import ApiError, LoadBody, UnloadBody, parse_version
from lorakit.serve.push import IPC_CONTENT_TYPE, IpcPush, is_loopback
from lorakit.serve.state import ServerState

__all__ = ["PUSH_PREFIX", "confined", "load", "push", "unload"]

PUSH_PREFIX = "/v1/lora_adapters/"

_OFF = "runtime adapter loading is off; start the server with --allow-runtime-lora"
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


async def load(body: LoadBody, state: ServerState) -> dict:
    config = state.config
    if not config.allow_runtime_lora:
        raise ApiError(403, f"{_OFF} (and --lora-root DIR)")
    try:
        check_name(body.lora_name)
    except ValueError as e:
        raise ApiError(400, str(e), "lora_name") from None
    if body.lora_name == config.model_name:
        raise ApiError(400, f"{body.lora_name!r} is the base model's name; pick another", "lora_name")
    roots = None
    parsed = hub_id(body.lora_path) if len(body.lora_path) <= MAX_PATH_CHARS and "\0" not in body.lora_path else None
    if parsed is not None and not _in_roots(body.lora_path, parsed[1], config.lora_roots):
        path, roots = await _from_hub(*parsed, config.allow_lora_repos)
    else:
        path = confined(body.lora_path, config.lora_roots)
    try:
        version = await state.register_adapter(body.lora_name, path, roots)
    except TooManyVersions as e:
        raise _busy(e) from None
    except (AdapterError, ValueError) as e:
        raise ApiError(400, str(e), "lora_path") from None
    return {"status": "ok", "lora_name": body.lora_name, "version": version}


async def push(name: str, body: bytes, state: ServerState, content_type: str = "", peer: str | None = None,
               version: str | None = None) -> dict:
    """A new version of ``name`` from a safetensors body, its config in the header's metadata (or, with
    ``IPC_CONTENT_TYPE`` from a ``peer`` on the loopback, a buffer in the client's CUDA memory); answers the version
    and the content's sha256. ``version`` (the query's): the number the new version takes, above every one the name
    has had (409 otherwise). A push that fails its checks leaves the previous version serving (400 naming why)."""
    if not state.config.allow_runtime_lora:
        raise ApiError(403, _OFF)
    try:
        check_name(name)
    except ValueError as e:
        raise ApiError(400, str(e), "lora_name") from None
    if name == state.config.model_name:
        raise ApiError(400, f"{name!r} is the base model's name; pick another", "lora_name")
    number = parse_version(version)
    weights: bytes | memoryview | SharedWeights
    if content_type.split(";")[0].strip().lower() == IPC_CONTENT_TYPE:
        weights, config = _ipc_push(body, peer)
        if weights.size > state.config.max_push_bytes:
            raise ApiError(413, f"the pushed CUDA buffer has {weights.size} bytes, more than --max-push-bytes "
                                f"{state.config.max_push_bytes}", "body")
    else:
        weights, config = body, None  # its config is in its header, read with its tensors (not here, on the loop)
    try:
        ref = await state.push_adapter(name, weights, config, number)
    except TooManyVersions as e:
        raise _busy(e) from None
    except VersionTaken as e:
        raise ApiError(409, str(e), "version") from None
    except (AdapterError, ValueError) as e:
        raise ApiError(400, str(e), "body") from None
    return {"status": "ok", "lora_name": name, "version": ref.version, "sha256": ref.sha256}


def _busy(error: TooManyVersions) -> ApiError:
    """A new version refused while the older ones still run requests: 429, retry once they end."""
    return ApiError(429, str(error), "lora_name", {"retry-after": "1"})


def _ipc_push(body: bytes, peer: str | None) -> tuple[SharedWeights, dict]:
    """A push through CUDA IPC: only from this host (a loopback peer), its JSON checked against ``IpcPush``."""
    if not is_loopback(peer):
        raise ApiError(403, f"a push through CUDA IPC ({IPC_CONTENT_TYPE}) is taken only from this host, over the "
                            f"loopback; this one came from {peer}: send the safetensors body instead", "body")
    try:
        found = msgspec.json.decode(body, type=IpcPush)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the CUDA IPC push is malformed ({e}); send one from lorakit.serve.push.push_adapter",
                       "body") from None
    return found.cuda_ipc, found.config


async def unload(body: UnloadBody, state: ServerState) -> dict:
    if not state.config.allow_runtime_lora:
        raise ApiError(403, _OFF)
    try:
        await state.unregister_adapter(body.lora_name)
    except AdapterError as e:
        raise ApiError(404, str(e), "lora_name") from None
    return {"status": "ok", "lora_name": body.lora_name}


async def _from_hub(repo: str, revision: str | None, allowed: list[str]) -> tuple[Path, list[Path]]:
    """The snapshot of hub repo ``repo`` at ``revision`` (downloaded off the event loop if not cached) and the one
    folder its files may lie in, the repo's own in the hub cache (a snapshot's files are links into its blobs), if
    ``repo`` matches an ``--allow-lora-repo`` pattern (else a 403) and the revision is a git name that keeps to that
    folder (else a 400, the same whatever lies outside it)."""
    spec = f"{repo}@{revision}" if revision else repo
    if not any(fnmatch.fnmatchcase(repo, pattern) for pattern in allowed):
        raise ApiError(403, f"lora_path {_shown(spec)} is a hub id that no --allow-lora-repo pattern allows"
                            f"{' (none is given)' if not allowed else ''}", "lora_path")
    try:
        folder = await asyncio.to_thread(from_hub, repo, revision, "lora_path", ADAPTER_FILES)
    except (FileNotFoundError, ValueError) as e:
        raise ApiError(400, str(e), "lora_path") from None
    return folder, [repo_folder(repo)]


def _in_roots(path: str, revision: str | None, roots: list[Path]) -> bool:
    """Whether ``path``, spelled like a hub id, is a folder inside a --lora-root: there a folder wins over the id, and
    no folder elsewhere (the server's working directory) does. One whose revision is no git name is not looked up:
    ``_from_hub`` refuses it by name."""
    if not roots:
        return False
    try:
        check_revision(revision) if revision is not None else None
        return confined(path, roots).is_dir()
    except (ApiError, ValueError):
        return False


def confined(path: str, roots: list[Path]) -> Path:
    """``path`` resolved (links followed) if it and every file in it lie inside one of ``roots``; else ApiError
    (400 for what is not a path: NUL bytes, more than ``MAX_PATH_CHARS``, a name the system refuses). A relative
    ``path`` is taken inside the roots, not the server's working directory: under the first root where it exists, else
    the first root; ``..`` or a link out of it is outside, as for an absolute path."""
    if not roots:
        raise ApiError(403, "runtime loading has no --lora-root to load from", "lora_path")
    if "\0" in path or len(path) > MAX_PATH_CHARS:
        raise ApiError(400, f"lora_path must be a folder path of at most {MAX_PATH_CHARS} characters without NUL "
                            f"bytes, got {len(path)} characters", "lora_path")
    try:
        roots = [Path(root).expanduser().resolve() for root in roots]
        given = Path(path).expanduser()
        if not given.is_absolute():  # under the first root where it exists (a link counts), else the first root
            given = next((root / given for root in roots if os.path.lexists(root / given)), roots[0] / given)
        resolved = given.resolve()
        for root in roots:
            if resolved.is_relative_to(root):
                if resolved.is_dir() and any(not f.resolve().is_relative_to(root) for f in resolved.iterdir()):
                    break  # a link inside the folder points outside the root
                return resolved
    except (OSError, RuntimeError) as e:  # a name too long, a loop of links
        raise ApiError(400, f"lora_path {_shown(path)} cannot be resolved ({getattr(e, 'strerror', None) or e})",
                       "lora_path") from None
    raise ApiError(403, f"lora_path {_shown(path)} is outside the allowed --lora-root folders", "lora_path")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 200 else f"{text[:160]!r}... ({len(text)} characters)"
