"""The engine at ``tensor_parallel_size`` N > 1: one process per rank, the scheduler and adapter pool on rank 0.

``Engine(factory, tensor_parallel_size=N)`` spawns N - 1 worker processes (``torch.multiprocessing``, spawn), so
the user runs one command. Every rank joins one ``torch.distributed`` group (NCCL on CUDA, gloo on the CPU, through a
rendezvous file in a private folder), builds the full model with the same picklable ``factory``, keeps its shard
(``lorakit.parallel.shard_model``), moves it to its device (``cuda:rank``) and patches it with the same slot layout.
Rank 0 is the engine: requests, scheduler, prefix cache, adapter pool, sampling. The workers hold no request; they
run what rank 0 tells them, in the order it tells them, through one pipe each::

    rank 0 (Engine)                                      rank r (worker)
    pool: put / vacate / reserve a slot  ------------->  the same slot write, of its own shard (the adapter's
                                                         files read again, checked against the sha256 rank 0 read)
    runner: ("runner", settings)         ------------->  its ModelRunner (KV cache of kv_heads / N heads per
                                                         layer; captures the same graphs)
    runner: ("step", packed, keep, shape) ------------>  the same packed step metadata through its shard, the same
                                                         graph bucket or eager shape; its logits are dropped
    runner: ("capture",)                 ------------->  every graph again (the slots grew)

The collectives inside the forward (the row-parallel layers' all-reduces, the head's all-gather) are what make the
ranks meet; each step's metadata crosses once, as one pickled message written to every pipe. With async scheduling
a step's placeholder tokens (sampled by the step before, on rank 0's device) follow on the device, by a broadcast
(``ModelRunner._send_step`` / ``run_packed``).

Failure: a worker that raises reports the traceback on its pipe and exits; rank 0 checks its workers before each
message and raises ``TensorParallelError``, a ``FatalEngineError``: the engine cannot step any more, it is never
taken for a request's fault (the server's core exits non-zero and a supervisor restarts it). So does a pipe that
breaks, and anything that fails on rank 0 once a step has gone to the workers (``ModelRunner``): the ranks are then
out of step, whatever the cause (a peer gone mid-collective shows up as a gloo ``RuntimeError``). Workers exit when
rank 0's end of the pipe closes (rank 0 exited or the engine was collected), and within a fraction of a second of
rank 0's process dying, a SIGKILL too (``lifeline.die_with_parent``), even inside a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lorakit.engine.errors import TensorParallelError
from lorakit.engine.lifeline import die_with_parent, on_main_thread

__all__ = ["TensorParallelError", "Workers", "mirror_slots", "model_device"]

logger = logging.getLogger("lorakit.tp")

JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits longer for a peer fails


def _join(rank: int, world_size: int, init_file: str, device: str) -> torch.device:
    """Join the group and return this rank's device."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend, where = "nccl", torch.device("cuda", rank)
    else:
        backend, where = "gloo", torch.device("cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the loopback interface
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=JOIN_TIMEOUT)
    return where


def _shard(factory: Callable[[], nn.Module], rank: int, world_size: int, device: torch.device) -> nn.Module:
    from lorakit.parallel import shard_model

    model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    done = getattr(model, "_lorakit_tensor_parallel", None)  # a factory may build the shard itself (load_sharded)
    if done is None:
        shard_model(model.eval(), rank, world_size)
    elif done != (rank, world_size):
        raise ValueError(f"the model factory returned the shard of rank {done[0]} of {done[1]}, on rank {rank} of "
                         f"{world_size}")
    return model.eval().to(device)


def model_device(device: str | None) -> str:
    """"cuda" or "cpu": the device the ranks run on (``None``: CUDA when there is one)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on CUDA devices or the CPU, not {device!r}")
    return kind


class Workers:
    """Rank 0's side: start the workers, join the group, build rank 0's shard (``model``), send commands."""

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
                proc = ctx.Process(target=_worker, args=(rank, world_size, init_file, factory, device, theirs,
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
            self.device = _join(0, world_size, init_file, device)
            self.model = _shard(factory, 0, world_size, self.device)
        except BaseException:
            self.close()
            raise

    def send(self, command: tuple) -> None:
        """Send ``command`` to every worker (pickled once)."""
        self.check()
        message = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self._pipes, 1):
            try:
                pipe.send_bytes(message)
            except OSError as e:  # its end closed: it is gone, or going
                raise TensorParallelError(f"{self._death(rank, 'stepping')} (its pipe: {e})") from None

    def wait(self, what: str) -> None:
        """Wait until every worker has answered the last command that asks for an answer."""
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
        """Stop the workers (they leave the group) and remove the rendezvous folder."""
        if getattr(self, "closed", True) and not self._procs:
            return
        self.closed = True
        for pipe in self._pipes:
            try:
                pipe.send_bytes(pickle.dumps(("stop",)))
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


def mirror_slots(handle, workers: Workers) -> None:
    """Make rank 0's slot table tell the workers every write before it makes it (``SlotTable.mirror``): a ``put``
    as the adapter's snapshot (each worker reads its files again and packs its own shard, and answers before rank 0
    goes on, so a worker that cannot read it fails the load there), ``vacate``, and ``reserve`` with the stores by
    their index in the handle."""
    stores = list(handle._stores.values())

    def mirror(write: tuple) -> None:
        kind = write[0]
        if kind == "put":
            _, slot, tenant = write
            snapshot = getattr(tenant, "snapshot", None)
            if snapshot is None:
                raise TypeError("at tensor_parallel_size > 1 adapters are loaded through the engine's adapter pool, "
                                "not handle.load_adapter")
            workers.send(("put", slot, dataclasses.replace(snapshot, image=None, reader=None)))
            workers.wait(f"loading adapter {snapshot.name!r}")
        elif kind == "reserve":
            workers.send(("reserve", {stores.index(store): rank for store, rank in write[1].items()}))
        else:
            workers.send(write)

    handle.slots.mirror = mirror


@dataclasses.dataclass(frozen=True)
class _Tenant:
    name: str
    number: int


def _worker(rank: int, world_size: int, init_file: str, factory, device: str, pipe,
            lifeline: tuple[int, bool]) -> None:
    """A worker process: join, build the shard, then run rank 0's commands until "stop" or rank 0 is gone
    (``lifeline``: rank 0's pid, and whether the kernel may kill this process with it: ``die_with_parent``)."""
    die_with_parent(lifeline[0], f"tensor-parallel rank {rank}", kernel=lifeline[1])
    what = "starting"
    try:
        import lorakit
        from lorakit.engine.pool import ImageCache
        from lorakit.engine.runner import ModelRunner
        from lorakit.engine.snapshot import reread

        where = _join(rank, world_size, init_file, device)
        model = _shard(factory, rank, world_size, where)
        config = pickle.loads(pipe.recv_bytes())[1]  # ("config", the resolved EngineConfig)
        handle = lorakit.patch(model, config.max_loras, max_rank=config.max_rank)
        stores = list(handle._stores.values())
        images = ImageCache(config.cpu_budget_bytes)  # this rank's shards, by content
        runner = None
        while True:
            try:
                command = pickle.loads(pipe.recv_bytes())
            except EOFError:  # rank 0 is gone
                return
            kind = command[0]
            what = kind
            if kind == "stop":
                return
            if kind == "step":
                runner.run_packed(*command[1:])
            elif kind == "put":
                _, slot, snapshot = command
                what = f"loading adapter {snapshot.name!r}"
                image = images.get(snapshot.sha256)
                if image is None:
                    image = reread(handle, snapshot, strict=config.lora_strict, pin=where.type == "cuda")
                    images.put(snapshot.sha256, image)
                handle.slots.put(slot, _Tenant(snapshot.name, 0), image)
                if where.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                pipe.send(("ok",))
            elif kind == "vacate":
                handle.slots.vacate(command[1], zero=command[2])
            elif kind == "reserve":
                handle.slots.reserve({stores[i]: r for i, r in command[1].items()})
            elif kind == "capture":
                runner._capture()
            elif kind == "runner":
                runner = ModelRunner(model, handle, **command[1])
            else:
                raise ValueError(f"unknown command {kind!r}")
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it
        try:
            pipe.send(("error", f"while {what}:\n{traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
