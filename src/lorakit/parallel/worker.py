"""A tensor-parallel worker process: one rank's model, slot table and runner, running the calls rank 0 makes.

The worker holds no request and interprets no commands. Each message from rank 0 is one call, ``(target, method,
args, kwargs, answer)``: the worker runs ``getattr(<its target>, method)(*args, **kwargs)`` on its own objects,
the same method rank 0 ran on its own (``lorakit.parallel.executor``), and answers when rank 0 waits for it. Its
targets: ``rank`` (this object: ``quantize``, ``patch``, ``start_runner``), ``slots`` (its slot table: ``put``, ``vacate``,
``reserve``) and ``runner`` (its ``ModelRunner``: ``run_packed``, ``capture_graphs``). Objects every rank holds its
own of arrive by reference (``Receiver``): a slot store is this rank's store of the same index, and a slot's tenant
comes with its snapshot, from which ``slots.put`` reads the adapter's files again, checks them against the sha256
rank 0 read (``reread``) and packs this rank's shard of it.

A call that raises ends the worker: it reports the traceback on its pipe and exits (rank 0 raises
``TensorParallelError``). It also exits when rank 0's end of the pipe closes, on an empty message (rank 0's stop),
and with rank 0's process (``lifeline.die_with_parent``).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import pickle
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lorakit.engine.lifeline import die_with_parent, name_process
from lorakit.adapters.snapshot import Snapshot

JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits longer for a peer fails


def join(rank: int, world_size: int, init_file: str, device: str) -> torch.device:
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


def shard(factory: Callable[[], nn.Module], rank: int, world_size: int, device: torch.device) -> nn.Module:
    """This rank's shard of the factory's model, on ``device``."""
    from lorakit.parallel.tensor import shard_model

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


@dataclasses.dataclass(frozen=True)
class Tenant:
    """A slot's tenant as a worker gets it: the adapter version rank 0's pool put there, and what it was read from."""

    name: str
    number: int
    snapshot: Snapshot  # without its image: this rank packs its own shard


class Receiver(pickle.Unpickler):
    """Unpickles a call from rank 0 for ``rank``, resolving the references ``executor.Sender`` made."""

    def __init__(self, message: bytes, rank: Rank):
        super().__init__(io.BytesIO(message))
        self.rank = rank

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "store":
            return self.rank.stores[rest[0]]
        if kind == "tenant":
            return Tenant(*rest)
        if kind == "image":
            return None  # packed by this rank, from the tenant's snapshot (Slots.put)
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


class Slots:
    """This rank's slot table as rank 0's calls reach it: the same writes, the adapter packed here for this shard."""

    def __init__(self, rank: Rank, config):
        from lorakit.adapters.pool import ImageCache

        self.rank, self.config = rank, config
        self.table = rank.handle.slots
        self.images = ImageCache(config.cpu_budget_bytes)  # this rank's shards, by content

    def put(self, slot: int, tenant: Tenant, image: None) -> None:
        """Rank 0 put ``tenant`` into ``slot``: its files read again (the same sha256 as rank 0 read, or ``Changed``)
        and packed for this rank's shard, unless this rank's CPU tier still holds that content."""
        from lorakit.adapters.snapshot import reread

        snapshot, cuda = tenant.snapshot, self.rank.device.type == "cuda"
        image = self.images.get(snapshot.sha256)
        if image is None:
            image = reread(self.rank.handle, snapshot, strict=self.config.lora_strict, pin=cuda)
            self.images.put(snapshot.sha256, image)
        self.table.put(slot, tenant, image)
        if cuda:
            torch.cuda.current_stream().synchronize()

    def vacate(self, slot: int, *, zero: bool = False) -> None:
        self.table.vacate(slot, zero=zero)

    def reserve(self, ranks) -> None:
        self.table.reserve(ranks)


class Rank:
    """A worker's objects, the targets of rank 0's calls: ``slots`` and ``runner`` once ``patch`` and
    ``start_runner`` made them."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.handle = self.stores = self.slots = self.runner = None

    def target(self, name: str):
        return self if name == "rank" else getattr(self, name)

    def quantize(self, scheme: str) -> None:
        """Quantize this rank's shard as rank 0 quantizes its own, at the same time (their row layers all-reduce)."""
        import lorakit

        lorakit.quantize(self.model, scheme)

    def patch(self, config) -> None:
        """Patch this rank's shard as rank 0 patched its own (the same slot layout: ``config``, an EngineConfig)."""
        import lorakit

        self.handle = lorakit.patch(self.model, config.max_loras, max_rank=config.max_rank)
        self.stores = list(self.handle._stores.values())  # the order Sender's store indices refer to
        self.slots = Slots(self, config)

    def start_runner(self, settings: dict) -> None:
        """Build this rank's ModelRunner (its KV cache, its graphs captured) with rank 0's settings."""
        from lorakit.engine.runner import ModelRunner

        self.runner = ModelRunner(self.model, self.handle, **settings)


def run(rank: int, world_size: int, init_file: str, factory, device: str, pipe, lifeline: tuple[int, bool]) -> None:
    """A worker process: join, build the shard, then run rank 0's calls until it stops them or is gone
    (``lifeline``: rank 0's pid, and whether the kernel may kill this process with it: ``die_with_parent``)."""
    die_with_parent(lifeline[0], f"tensor-parallel rank {rank}", kernel=lifeline[1])
    name_process(f"lorakit tp-worker {rank}")
    what = "starting"
    try:
        where = join(rank, world_size, init_file, device)
        worker = Rank(shard(factory, rank, world_size, where), where)
        while True:
            try:
                message = pipe.recv_bytes()
            except EOFError:  # rank 0 is gone
                return
            if not message:  # rank 0 stopped the workers
                return
            target, method, args, kwargs, answer = Receiver(message, worker).load()
            what = f"running {target}.{method}" + "".join(f" (adapter {a.name!r})" for a in args
                                                          if isinstance(a, Tenant))
            getattr(worker.target(target), method)(*args, **kwargs)
            if answer:
                pipe.send(("ok",))
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
