"""A state dict handed from another process on the same host through CUDA IPC: no copy through the host.

The sender (``share``) copies every tensor into one CUDA buffer and describes it: the buffer's IPC handle (what
``torch.multiprocessing`` sends, from ``UntypedStorage._share_cuda_``) and each tensor's key, dtype, shape and place in
it. The description is plain data (JSON or msgpack), never a pickle, and the receiver (``open_shared``) checks every
field before it opens the handle: one buffer, one open, however many tensors. The sender reuses its buffer from push to
push and the receiver keeps the last few buffers it opened, so a training loop's pushes open and close no handle
(torch does both holding the GIL and the driver's lock: milliseconds in which the engine cannot step). Torch's own
reference count tells the sender when the receiver has let a buffer go.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

import msgspec
import torch

from lorakit.peft import AdapterError

__all__ = ["SharedTensor", "SharedWeights", "check_shared", "close_shared", "open_shared", "share"]

_ALIGN = 256  # bytes; each tensor's place in the buffer
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
# torch's reference-count files (at::NewProcessWideShmHandle) and their size in counters (CUDA_IPC_REF_COUNTER_FILE_SIZE)
_REF_COUNTER = re.compile(rb"/torch_\d+_\d+_\d+")
_REF_COUNTERS = 10000
MAX_TENSORS = 1 << 16
MAX_OPEN = 2  # senders' buffers kept open by a receiver (least recently used out)
REUSES = 256  # shares of one sender's buffer before it takes a new one


class SharedTensor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    key: str
    dtype: str  # "bfloat16", "float16", "float32" or "float64"
    shape: list[int]
    offset: int  # bytes into the buffer


class SharedWeights(msgspec.Struct, forbid_unknown_fields=True):
    """One CUDA buffer of another process (``UntypedStorage._share_cuda_``'s fields) and the tensors laid out in it."""

    device: int
    handle: bytes
    size: int  # the buffer's bytes
    storage_offset: int  # its place in the CUDA allocation the handle opens
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync_required: bool
    tensors: list[SharedTensor]


def share(weights: Mapping[str, torch.Tensor]) -> tuple[SharedWeights, torch.Tensor]:
    """``weights`` (floating-point tensors on one CUDA device) copied into one buffer on that device, and its
    description for ``open_shared`` in another process. The buffer (the second value) is this thread's for the device,
    written again by its next ``share``: share again once the receiver has answered (``push_adapter`` does)."""
    if not weights or not isinstance(weights, Mapping):
        raise ValueError("share needs a non-empty dict of tensors (a PEFT state dict)")
    devices = {t.device for t in weights.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"CUDA IPC shares tensors of one CUDA device; these are on {sorted(map(str, devices))}")
    device = next(iter(devices))
    places, size = [], 0
    for key, t in weights.items():
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"{key!r} is {t.dtype}; CUDA IPC pushes take {sorted(_DTYPES)} tensors")
        places.append(SharedTensor(key, name, list(t.shape), size))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    key = (device, threading.get_ident())
    buffer, uses = _buffers.get(key, (None, 0))
    # One buffer per device, reused (the receiver keeps it open), and replaced now and then: torch wraps each share of
    # it in a reference count of its own (a counter slot, an event), which only a new buffer lets go.
    if buffer is None or buffer.numel() < size or uses >= REUSES:
        buffer, uses = torch.empty(max(size, 1), dtype=torch.uint8, device=device), 0
    _buffers[key] = (buffer, uses + 1)
    torch._foreach_copy_([_view(buffer, p) for p in places], [t.detach() for t in weights.values()])
    torch.cuda.current_stream(device).synchronize()  # the copy done before the receiver reads
    (index, handle, nbytes, offset, ref_counter, ref_offset, event, sync) = buffer.untyped_storage()._share_cuda_()
    return SharedWeights(index, handle, nbytes, offset, ref_counter, ref_offset, event or b"", bool(sync),
                         places), buffer


_buffers: dict[tuple, tuple[torch.Tensor, int]] = {}  # the sender's, by (device, thread): (buffer, shares of it)


def check_shared(shared: SharedWeights, max_bytes: int, where: str) -> None:
    """Every field in range before anything is opened: AdapterError naming the first that is not."""
    def bad(what: str):
        return AdapterError(f"{where}: the CUDA IPC description is malformed ({what}); send one from "
                            f"lorakit.serve.push.push_adapter")

    if not torch.cuda.is_available() or not 0 <= shared.device < torch.cuda.device_count():
        raise AdapterError(f"{where}: it names CUDA device {shared.device}, which this process does not have; CUDA "
                           f"IPC works between processes on one host, push the safetensors body instead")
    if not 0 < shared.size <= max_bytes:
        raise AdapterError(f"{where}: its buffer has {shared.size} bytes, more than the {max_bytes} a push may have")
    if not (0 < len(shared.handle) <= 1024 and 0 <= shared.storage_offset and len(shared.event) <= 1024):
        raise bad("handle, event or offset")
    if not (_REF_COUNTER.fullmatch(shared.ref_counter) and 0 <= shared.ref_counter_offset < _REF_COUNTERS):
        raise bad("reference counter")
    if not 0 < len(shared.tensors) <= MAX_TENSORS:
        raise bad(f"{len(shared.tensors)} tensors")
    for t in shared.tensors:
        if t.dtype not in _DTYPES or any(d < 0 for d in t.shape) or len(t.shape) > 4 or t.offset % _ALIGN:
            raise bad(f"tensor {t.key!r}: dtype {t.dtype!r}, shape {t.shape}, offset {t.offset}")
        n = _nbytes(t)
        if not 0 <= t.offset <= shared.size - n:
            raise bad(f"tensor {t.key!r} of {n} bytes at {t.offset} lies outside the {shared.size}-byte buffer")
    if len({t.key for t in shared.tensors}) != len(shared.tensors):
        raise bad("a key named twice")


_opened: OrderedDict[tuple, torch.UntypedStorage] = OrderedDict()  # the receiver's, by (device, handle, offset)
_opened_lock = threading.Lock()
atexit.register(lambda: close_shared())  # while CUDA still runs: closing syncs a stream


@contextlib.contextmanager
def open_shared(shared: SharedWeights, max_bytes: int, where: str) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors ``shared`` describes, as views of the sender's buffer (checked first: ``check_shared``), for the
    time of the ``with`` (on the current stream): use them there, keep no view after (the sender reuses its buffer).
    A buffer opened before is used again: this share's reference is given back at the end instead of when the
    buffer is closed, and the sender's copy is awaited through the event it sent."""
    check_shared(shared, max_bytes, where)
    device = torch.device("cuda", shared.device)
    key = (shared.device, shared.handle, shared.storage_offset)
    with _opened_lock:
        storage = _opened.get(key)
        if storage is not None and storage.nbytes() >= shared.size:
            _opened.move_to_end(key)
            reused = True
        else:
            reused = False
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    shared.device, shared.handle, shared.size, shared.storage_offset, shared.ref_counter,
                    shared.ref_counter_offset, shared.event, shared.event_sync_required)
            except RuntimeError as e:
                raise AdapterError(f"{where}: its CUDA IPC handle cannot be opened ({str(e).splitlines()[0][:200]}); "
                                   f"the sender must run on this host and keep its buffer until the push is "
                                   f"answered") from None
            _opened[key] = storage
            while len(_opened) > MAX_OPEN:
                _opened.popitem(last=False)  # closed once nothing reads it (torch gives its reference back then)
    try:
        if reused and shared.event_sync_required:
            torch.cuda.Event.from_ipc_handle(device, shared.event).wait(torch.cuda.current_stream(device))
        buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        yield {t.key: _view(buffer, t) for t in shared.tensors}
    finally:
        if reused:  # this share's reference: the reads done first (the sender may then write the buffer again)
            torch.cuda.current_stream(device).synchronize()
            torch.UntypedStorage._release_ipc_counter(shared.ref_counter, shared.ref_counter_offset, device=device)


def close_shared() -> None:
    """Let every sender's buffer this process keeps open go (a sender that has ended leaves its memory mapped here
    until then)."""
    with _opened_lock:
        _opened.clear()


def _nbytes(t: SharedTensor) -> int:
    return math.prod(t.shape) * _DTYPES[t.dtype].itemsize


def _view(buffer: torch.Tensor, t: SharedTensor) -> torch.Tensor:
    return buffer[t.offset: t.offset + _nbytes(t)].view(_DTYPES[t.dtype]).view(t.shape)
