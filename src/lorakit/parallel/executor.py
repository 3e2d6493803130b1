"""The engine at ``tensor_parallel_size`` N > 1: one process per rank, one call protocol between them.

Rank 0 is the engine; the ``Executor`` spawns N - 1 workers that hold the same objects (a slot table, a
``ModelRunner``) on their shard and do what rank 0 does, in its order, as calls (``call(target, method, *args)``, as
nano-vllm's ``ModelRunner.call``). A worker that fails makes rank 0 raise ``TensorParallelError`` (a
``FatalEngineError``). Which calls, what crosses the pipes, and failures: docs/tensor-parallel.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Collection

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lorakit.engine.errors import TensorParallelError
from lorakit.engine.lifeline import on_main_thread
from lorakit.adapters.snapshot import Snapshot
from lorakit.layers.image import SlotImage
from lorakit.layers.slot_table import Loaded
from lorakit.layers.slots import LoraSlots
from lorakit.parallel import worker

__all__ = ["Executor", "TensorParallelError", "model_device"]


def model_device(device: str | None) -> str:
    """"cuda" or "cpu": the device the ranks run on (``None``: CUDA when there is one)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on CUDA devices or the CPU, not {device!r}")
    return kind


_VALUES = (int, float, bool, str, bytes, type(None), tuple, list, dict, np.ndarray, torch.dtype)


class Sender(pickle.Pickler):
    """Pickles a call for the workers; what each rank holds its own of goes by reference (``persistent_id``,
    resolved by ``worker.Receiver``), whatever the call: a slot store by its index in the handle (every rank patched
    alike), a slot's tenant (a version of the pool's) as its name, number and snapshot without the image, a slot
    image as nothing: each rank packs its own shard of the adapter from the snapshot's files."""

    def __init__(self, file, stores: dict[int, int]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.stores = stores  # id(store) -> its index

    def persistent_id(self, obj):
        if type(obj) in _VALUES:  # the common case first: a step's metadata
            return None
        if isinstance(obj, LoraSlots):
            return "store", self.stores[id(obj)]
        if isinstance(obj, SlotImage):
            return ("image",)
        if isinstance(obj, Loaded):
            raise TypeError("at tensor_parallel_size > 1 adapters are loaded through the engine's adapter pool, "
                            "not handle.load_adapter")
        snapshot = getattr(obj, "snapshot", None)
        if isinstance(snapshot, Snapshot):  # a slot's tenant
            return "tenant", obj.name, obj.number, dataclasses.replace(snapshot, image=None, reader=None)
        return None


class Executor:
    """Rank 0's side: start the workers, join the group, build rank 0's shard (``model``), make calls on every
    worker (see the module docstring)."""

    def __init__(self, factory: Callable[[], nn.Module], world_size: int, device: str):
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices, this machine has "
                             f"{torch.cuda.device_count()}; lower it, or run on the CPU (device 'cpu', gloo)")
        try:
            pickle.dumps(factory)
        except Exception as e:
            raise ValueError(f"tensor_parallel_size={world_size} needs a picklable model factory (each process "
                             f"builds its own model), e.g. functools.partial of a module-level function; pickling "
                             f"{factory!r} failed: {e}") from e
        self.world_size = world_size
        self._stores: dict[int, int] = {}
        self._folder = tempfile.mkdtemp(prefix="lorakit-tp-")  # mode 0700: only this user can rendezvous here
        init_file = os.path.join(self._folder, "rendezvous")
        ctx = mp.get_context("spawn")
        self._pipes, self._procs = [], []
        # The server's engine core is a daemonic process (it dies with the server), and multiprocessing refuses
        # children to those, since a daemon is killed without stopping them. These workers cannot outlive it either:
        # they are daemonic, and exit as soon as rank 0's end of their pipe closes.
        config = mp.current_process()._config
        daemonic = config.get("daemon", False)
        config["daemon"] = False
        lifeline = (os.getpid(), on_main_thread())
        try:
            for rank in range(1, world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker.run, args=(rank, world_size, init_file, factory, device, theirs,
                                                            lifeline),
                                   name=f"lorakit-tp-{rank}", daemon=True)
                proc.start()
                theirs.close()
                self._pipes.append(ours)
                self._procs.append(proc)
        finally:
            config["daemon"] = daemonic
        self.closed = False
        try:
            self.device = worker.join(0, world_size, init_file, device)
            self.model = worker.shard(factory, 0, world_size, self.device)
        except BaseException:
            self.close()
            raise

    # The call protocol.

    def call(self, target: str, method: str, *args, wait: str | None = None, **kwargs) -> None:
        """Run ``target.method(*args, **kwargs)`` on every worker (``target``: "rank", "slots" or "runner", see
        ``worker.Rank``), pickled once, in order with every call before it. ``wait``: what the call does, to wait
        for every worker's answer (and name it in the error); None: go on at once."""
        self.check()
        buffer = io.BytesIO()
        Sender(buffer, self._stores).dump((target, method, args, kwargs, wait is not None))
        message = buffer.getvalue()
        for rank, pipe in enumerate(self._pipes, 1):
            try:
                pipe.send_bytes(message)
            except OSError as e:  # its end closed: it is gone, or going
                raise TensorParallelError(f"{self._death(rank, 'stepping')} (its pipe: {e})") from None
        if wait is not None:
            self.wait(wait)

    def mirror(self, target: str, waits: Collection[str] = ()) -> Callable[..., None]:
        """The hook rank 0's ``target`` object calls before each of its calls that every rank must make:
        ``hook(method, *args, **kwargs)`` makes it on every worker; the ``waits`` methods wait for their answers."""

        def hook(method: str, *args, **kwargs) -> None:
            self.call(target, method, *args, wait=f"running {target}.{method}" if method in waits else None, **kwargs)

        return hook

    def mirror_slots(self, handle) -> None:
        """Make rank 0's slot table (``handle.slots``, the pool's) make every write on every rank. A put waits for
        every worker's answer, so a worker that cannot read the adapter fails the load there."""
        self._stores.update({id(store): i for i, store in enumerate(handle._stores.values())})
        handle.slots.mirror = self.mirror("slots", waits={"put"})

    def mirror_runner(self, settings: dict) -> Callable[..., None]:
        """Build every worker's ``ModelRunner`` with ``settings`` (each captures its graphs now, as rank 0's does
        next); returns the hook rank 0's runner takes (its ``mirror``), so each step and recapture runs on every
        rank."""
        self.call("rank", "start_runner", settings)
        return self.mirror("runner")

    # Failure and shutdown.

    def wait(self, what: str) -> None:
        """Wait until every worker has answered the last call that asks for an answer."""
        for rank, pipe in enumerate(self._pipes, 1):
            try:
                reply = pipe.recv()
            except (EOFError, OSError):
                raise TensorParallelError(self._death(rank, what)) from None
            if reply[0] == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed while {what}:\n{reply[1]}")

    def check(self) -> None:
        """Raise if a worker has exited or reported an error."""
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers were stopped")
        for rank, (pipe, proc) in enumerate(zip(self._pipes, self._procs), 1):
            if pipe.poll():
                try:
                    reply = pipe.recv()
                except (EOFError, OSError):  # nothing said: it was killed
                    raise TensorParallelError(self._death(rank, "stepping")) from None
                raise TensorParallelError(f"tensor-parallel rank {rank} failed:\n{reply[1]}")
            if not proc.is_alive():
                raise TensorParallelError(self._death(rank, "stepping"))

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank - 1]
        proc.join(timeout=1.0)
        return f"tensor-parallel rank {rank} exited (exit code {proc.exitcode}) while {what}"

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (an empty message: they leave the group) and remove the rendezvous folder."""
        if getattr(self, "closed", True) and not self._procs:
            return
        self.closed = True
        for pipe in self._pipes:
            try:
                pipe.send_bytes(b"")
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self._pipes:
            pipe.close()
        self._procs, self._pipes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._folder, ignore_errors=True)
