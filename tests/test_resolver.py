"""Adapter resolvers: folders found by name under roots, confined to them, safetensors only; a cache shared by
processes copies each adapter once."""

import multiprocessing
import os
from pathlib import Path

import pytest

from lorakit.peft import AdapterError
from lorakit.serve.resolver import LocalRoots, SharedCache


def adapter(folder: Path, weights: bytes = b"w") -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text("notes")
    return folder


def test_local_roots_find_adapters_by_name_first_root_first(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    adapter(a / "sql")
    adapter(b / "sql")
    adapter(b / "chat")
    resolver = LocalRoots([a, b])
    assert resolver.resolve("sql") == (a / "sql").resolve()
    assert resolver.resolve("chat") == (b / "chat").resolve()
    assert resolver.names() == ["chat", "sql"]


@pytest.mark.parametrize("name, message", [
    ("../a", "adapter name"), ("a/b", "adapter name"), (".hidden", "adapter name"), ("", "adapter name"),
    ("missing", "no adapter 'missing'"),
])
def test_local_roots_refuse_bad_and_missing_names(tmp_path, name, message):
    (tmp_path / "root").mkdir()
    with pytest.raises(AdapterError, match=message):
        LocalRoots([tmp_path / "root"]).resolve(name)


def test_local_roots_refuse_links_out_of_the_root_and_pickles(tmp_path):
    root = tmp_path / "root"
    outside = adapter(tmp_path / "outside")
    root.mkdir()
    (root / "escape").symlink_to(outside)
    with pytest.raises(AdapterError, match="outside its root"):
        LocalRoots([root]).resolve("escape")
    inner = adapter(root / "inner")
    (inner / "adapter_model.safetensors").unlink()
    (inner / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="links outside"):
        LocalRoots([root]).resolve("inner")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="safetensors"):
        LocalRoots([root]).resolve("pickled")


def test_local_roots_need_existing_folders(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        LocalRoots([tmp_path / "nope"])
    with pytest.raises(ValueError, match="at least one root"):
        LocalRoots([])


def test_shared_cache_copies_the_adapter_files_once(tmp_path):
    source = adapter(tmp_path / "root" / "sql", b"weights")
    cache = SharedCache(LocalRoots([tmp_path / "root"]), tmp_path / "cache")
    path = cache.resolve("sql")
    assert path == tmp_path / "cache" / "sql"
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights"
    (source / "adapter_model.safetensors").write_bytes(b"changed")  # a cached copy is used as it is
    assert (cache.resolve("sql") / "adapter_model.safetensors").read_bytes() == b"weights"
    with pytest.raises(AdapterError, match="no adapter 'other'"):
        cache.resolve("other")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name != "sql"], "a failed copy was left"


def _resolve(args) -> str:
    root, cache = args
    return str(SharedCache(LocalRoots([Path(root)]), Path(cache)).resolve("big"))


def test_shared_cache_is_safe_for_processes_at_once(tmp_path):
    adapter(tmp_path / "root" / "big", os.urandom(8 << 20))
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        paths = pool.map(_resolve, [(str(tmp_path / "root"), str(tmp_path / "cache"))] * 8)
    assert set(paths) == {str(tmp_path / "cache" / "big")}
    assert (tmp_path / "cache" / "big" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "root" / "big" / "adapter_model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == ["big"]
