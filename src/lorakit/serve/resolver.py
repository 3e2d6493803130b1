"""Adapter sources for a fleet: a replica asked for an adapter by name finds its folder through a resolver.

    resolver = LocalRoots([Path("/adapters")])                  # /adapters/<name>/ (adapter_config.json + safetensors)
    resolver = SharedCache(LocalRoots([...]), Path("/fast/cache"))  # copied once into a cache every replica reads
    path = resolver.resolve("customer-42")                       # a folder the pool can register, or AdapterError

Resolving is the same security boundary as runtime loading (``lorakit.serve.adapters``): a name is checked by the
pool's rules before it becomes part of a path (no separators, no ``..``), the folder must lie inside a root after
links are resolved, and only safetensors weights are accepted (``.bin`` / pickle files are refused). The cache is
safe for many processes at once: one copies under an exclusive file lock into a temporary folder and renames it into
place, the others wait on the lock and then find it complete.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from lorakit.adapters.pool import check_name
from lorakit.peft import AdapterError
from lorakit.peft.config import CONFIG_NAME, WEIGHTS_NAME

__all__ = ["AdapterResolver", "LocalRoots", "SharedCache"]


class AdapterResolver(Protocol):
    def resolve(self, name: str) -> Path:
        """The folder of adapter ``name``; ``AdapterError`` naming the problem when there is none."""

    def names(self) -> list[str]:
        """The adapters this resolver can find (for listings; may be expensive)."""


def _checked_name(name: str) -> str:
    try:
        check_name(name)
    except ValueError as e:
        raise AdapterError(str(e)) from None
    if name in (".", ".."):
        raise AdapterError(f"adapter name {name!r} is not a folder name")
    return name


def _adapter_folder(folder: Path) -> bool:
    return (folder / CONFIG_NAME).is_file() and (folder / WEIGHTS_NAME).is_file()


class LocalRoots:
    """Adapters as folders ``<root>/<name>`` under one or more roots (the first root holding the name wins)."""

    def __init__(self, roots: list[Path]):
        if not roots:
            raise ValueError("LocalRoots needs at least one root folder")
        self.roots = [Path(r).resolve() for r in roots]
        for root in self.roots:
            if not root.is_dir():
                raise ValueError(f"adapter root {str(root)!r} is not a folder")

    def resolve(self, name: str) -> Path:
        _checked_name(name)
        for root in self.roots:
            folder = (root / name).resolve()
            if not folder.is_relative_to(root):
                raise AdapterError(f"adapter {name!r} resolves outside its root {str(root)!r} (a link?)")
            if folder.is_dir():
                if not _adapter_folder(folder):
                    raise AdapterError(f"{str(folder)!r} holds no {CONFIG_NAME} and {WEIGHTS_NAME}: not a PEFT "
                                       f"adapter saved with safetensors")
                for file in folder.rglob("*"):
                    if not file.resolve().is_relative_to(root):
                        raise AdapterError(f"{str(file)!r} in adapter {name!r} links outside its root {str(root)!r}")
                return folder
        raise AdapterError(f"no adapter {name!r} under {', '.join(repr(str(r)) for r in self.roots)}")

    def names(self) -> list[str]:
        return sorted({p.name for root in self.roots for p in root.iterdir() if _adapter_folder(p)})


class SharedCache:
    """A filesystem cache in front of a slower ``source``, shared by every replica that points at ``folder``.

    Only the adapter's own files (``adapter_config.json`` and ``*.safetensors``) are copied; a cached copy is used
    as it is (a new version needs a new name, or the cache entry removed)."""

    def __init__(self, source: AdapterResolver, folder: Path):
        self.source = source
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def resolve(self, name: str) -> Path:
        target = self.folder / _checked_name(name)
        if _adapter_folder(target):
            return target
        with open(self.folder / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _adapter_folder(target):  # another replica copied it while this one waited
                return target
            source = self.source.resolve(name)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.folder))
            try:
                for file in source.iterdir():
                    if file.name == CONFIG_NAME or file.suffix == ".safetensors":
                        shutil.copyfile(file, tmp / file.name)
                os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return target

    def names(self) -> list[str]:
        return self.source.names()
