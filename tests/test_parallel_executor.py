"""The tensor-parallel call protocol in one process (no workers): what a call carries from rank 0 to a worker, and
the import direction (``layers`` and ``engine`` import nothing from ``lorakit.parallel``)."""

from __future__ import annotations

import ast
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _peft_models import save_adapter, tiny_model
from peft import LoraConfig

import lorakit
from lorakit.engine import AdapterPool
from lorakit.adapters.snapshot import Snapshot
from lorakit.parallel import shard_model
from lorakit.parallel.executor import Sender
from lorakit.parallel.worker import Rank, Receiver, Tenant

SRC = Path(__file__).resolve().parents[1] / "src" / "lorakit"


class _Config:  # the EngineConfig fields a worker's Rank.patch reads
    max_loras, max_rank, cpu_budget_bytes, lora_strict = 2, 16, 1 << 24, True


def _pickled(call: tuple, handle) -> bytes:
    buffer = io.BytesIO()
    Sender(buffer, {id(s): i for i, s in enumerate(handle._stores.values())}).dump(call)
    return buffer.getvalue()


def test_a_call_carries_references_not_rank_0s_objects(tmp_path):
    """A put's tenant arrives as its snapshot without the image (the worker packs its own shard from the files), its
    image as nothing, a reserve's stores as the worker's stores of the same index."""
    base = tiny_model("llama", 0)
    adapter = save_adapter(base, "a", LoraConfig(r=4, target_modules=["q_proj", "down_proj"]), tmp_path, seed=1)
    ours = shard_model(copy.deepcopy(base), 0, 1)  # world size 1: the sharded modules, no process group
    handle = lorakit.patch(ours, 2, max_rank=16)
    pool = AdapterPool(handle)
    pool.register("a", adapter.path)
    [slot0] = pool.acquire(["a"])  # rank 0's own put
    version = handle.slots[slot0]  # the pool's tenant
    image = handle.pack(handle.read_adapter("a", adapter.path), pin=False)
    store = next(iter(handle._stores.values()))

    theirs = Rank(shard_model(copy.deepcopy(base), 0, 1), torch.device("cpu"))
    theirs.patch(_Config)
    target, method, args, kwargs, answer = Receiver(_pickled(("slots", "put", (1, version, image), {}, True),
                                                             handle), theirs).load()
    assert (target, method, kwargs, answer) == ("slots", "put", {}, True)
    slot, tenant, got_image = args
    assert slot == 1 and got_image is None and isinstance(tenant, Tenant)
    assert (tenant.name, tenant.number) == ("a", 1)
    assert isinstance(tenant.snapshot, Snapshot) and tenant.snapshot.sha256 == version.snapshot.sha256
    assert tenant.snapshot.image is None and tenant.snapshot.reader is None

    (ranks,), _ = Receiver(_pickled(("slots", "reserve", ({store: 16},), {}, False), handle), theirs).load()[2:4]
    assert ranks == {next(iter(theirs.handle._stores.values())): 16}

    theirs.slots.put(slot, tenant, got_image)  # reads the files again, checked against the snapshot's sha256
    assert theirs.handle.slots[1] == tenant
    for mine, yours in zip(handle._stores.values(), theirs.stores):  # what rank 0's put wrote, in slot 1
        torch.testing.assert_close(mine.lora_A[slot0], yours.lora_A[1])
        torch.testing.assert_close(mine.lora_B[slot0], yours.lora_B[1])


def test_a_handle_loaded_tenant_is_refused_at_tp(tmp_path):
    base = tiny_model("llama", 0)
    adapter = save_adapter(base, "a", LoraConfig(r=4, target_modules=["q_proj"]), tmp_path, seed=1)
    handle = lorakit.patch(shard_model(copy.deepcopy(base), 0, 1), 2, max_rank=16)
    handle.load_adapter("a", adapter.path)
    with pytest.raises(TypeError, match="through the engine's adapter pool"):
        _pickled(("slots", "put", (0, handle.slots[0], None), {}, True), handle)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at module level) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
    return found


def test_layers_and_engine_import_nothing_from_parallel():
    """The package order is ops -> layers -> engine -> parallel: ``layers`` never imports ``lorakit.parallel``; the
    engine only inside the function that starts the workers (at tensor_parallel_size > 1)."""
    for package in ("ops", "layers", "engine"):
        for path in sorted((SRC / package).glob("*.py")):
            for module, top in _imports(path):
                if module.startswith("lorakit.parallel"):
                    assert package == "engine" and not top, f"{path.name} imports {module}"
    code = "import sys, lorakit; print(sorted(m for m in sys.modules if m.startswith('lorakit.parallel')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert out.stdout.strip() == "[]"
