"""An adapter folder read once, as untrusted input: what is served is what was checked.

``read_snapshot`` resolves each file's path (inside the allowed folders, when there are any), opens it at that real
path without following a link, reads only a regular file of bounded size, and copies it into a private folder
while hashing it. Everything is checked on that copy, in full (config, keys, shapes, rank, every value), and
packed: the ``Snapshot``. A file changed or swapped on disk afterwards cannot reach it, and a later re-read
(``reread``, after the CPU tier dropped the image) must find the same bytes at the same real paths, or raises
``Changed``. ``read_pushed`` takes an adapter pushed from memory (tensors, or a safetensors body) through the same
checks; its snapshot has no files, so its image is never dropped. ``read_tokenizer`` reads an adapter's tokenizer
files the same way as the adapter's, and never runs code from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import stat
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.adapters.shared import SharedWeights, check_shared, open_shared
from lorakit.layers.handle import LoraHandle
from lorakit.layers.image import SlotImage
from lorakit.peft import AdapterError, AdapterInfo, check_values
from lorakit.peft.config import CONFIG_NAME, MAX_CONFIG_BYTES, WEIGHTS_NAME, parse_json
from lorakit.peft.gil import pause, yielding, yielding_here

__all__ = ["PUSHED", "Changed", "FileRecord", "Snapshot", "read_pushed", "read_snapshot", "read_tokenizer", "reread"]

PUSHED = Path("<pushed from memory>")  # the folder a pushed adapter's info names: it has none

TOKENIZER_FILE_BYTES = 64 << 20  # per tokenizer file; the largest vocabularies' tokenizer.json take ~35 MB
# Files transformers reads for a tokenizer, besides those its class names (vocab_files_names); nothing else is read.
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model", "tekken.json")
_TEMPLATES = "additional_chat_templates"  # transformers' folder of extra chat templates (*.jinja)


class Changed(AdapterError):
    """A file is no longer the one that was read (other bytes, a link now, gone): its adapter fails closed."""


@dataclass(frozen=True)
class FileRecord:
    """A file as it was read: its name in the folder, the real path it was read from, its size and sha256."""

    name: str
    real: Path
    size: int
    sha256: str


@dataclass(eq=False)
class Snapshot:
    """An adapter as ``read_snapshot`` read it: checked in full, identified by ``sha256`` (``digest`` of its config
    and weights files as read), packed into ``image`` for the CPU tier. Installing it takes the image (a snapshot
    installs once); ``files`` tell a re-read where the same bytes must be."""

    name: str
    info: AdapterInfo  # info.path: the folder's real path
    sha256: str
    files: tuple[FileRecord, ...]
    image: SlotImage | None = field(default=None, repr=False)
    reader: object = field(default=None, repr=False)  # what read it (an AdapterPool: its model's layout)


def read_snapshot(handle: LoraHandle, name: str, path: str | Path, roots: Sequence[str | Path] | None, *,
                  strict: bool, pin: bool, max_bytes: int) -> Snapshot:
    """Read the PEFT folder at ``path`` once and check it in full for ``handle``'s model; its packed image may take at
    most ``max_bytes``. Changes nothing; raises AdapterError."""
    where = f"adapter {name!r} at {path}"
    folder = _resolve(path, roots, where, "the folder")
    where = f"adapter {name!r} at {folder}"
    files = {file: _resolve(folder / file, roots, where, file)
             for file in (CONFIG_NAME, WEIGHTS_NAME) if os.path.lexists(folder / file)}
    info = handle.inspect_adapter(name, folder, strict=strict)  # the cheap refusals (config, header) before the copy
    _check_size(image_bytes(handle, info), max_bytes, where)
    with _private_copy(folder, where) as copy:
        if files.keys() != {CONFIG_NAME, WEIGHTS_NAME}:
            raise AdapterError(f"{where}: its files changed while they were read; try again")
        limits = {CONFIG_NAME: MAX_CONFIG_BYTES, WEIGHTS_NAME: os.stat(files[WEIGHTS_NAME]).st_size}
        records = tuple(_copy_in(real, copy / file, limits[file], where) for file, real in files.items())
        adapter = handle.read_adapter(name, copy, strict=strict)
        info = handle.inspect_adapter(name, copy, strict=strict)
    image = handle.pack(adapter, pin=pin)
    _check_size(image.nbytes, max_bytes, where)
    return Snapshot(name, dataclasses.replace(info, path=folder), digest(records), records, image)


def read_pushed(handle: LoraHandle, name: str, weights, config, *, strict: bool, pin: bool, max_bytes: int
                ) -> Snapshot:
    """An adapter pushed from memory, checked in full as a folder would be (config, keys, shapes, rank, every value):
    ``weights`` is a PEFT state dict (``get_peft_model_state_dict``'s keys; tensors on any device), the bytes of a
    safetensors file of one, or one in another process's CUDA memory (``SharedWeights``, opened only for the read);
    ``config`` its ``LoraConfig``, or the dict ``adapter_config.json`` holds (None: the one a safetensors file's
    bytes carry in their metadata, ``safetensors_config``; their header is read once). A state dict of
    plain LoRA on linear modules is checked where its tensors lie and packed straight from them; anything else is
    written to a private folder in memory and read as a folder is. Its sha256 is ``image_digest``'s: of the config and
    the packed weights, the same for the same adapter however it was pushed. Changes nothing; raises AdapterError."""
    where = f"adapter {name!r} pushed from memory"
    if isinstance(weights, SharedWeights):
        check_shared(weights, max_bytes, f"{where} through CUDA IPC")  # before any CUDA call
        with _side_stream(weights.device), open_shared(weights, max_bytes, f"{where} through CUDA IPC") as tensors:
            return read_pushed(handle, name, tensors, config, strict=strict, pin=pin, max_bytes=max_bytes)
    header = None
    if isinstance(weights, (bytes, bytearray, memoryview)):
        if len(weights) > max_bytes:
            _check_size(len(weights), max_bytes, where)
        header = safetensors_header(weights, where)  # read once: for its config and its tensors
        if config is None:
            config = safetensors_config(header[0], where)
    elif config is None:
        raise AdapterError(f"{where}: no config; pass its LoraConfig (or adapter_config.json's dict) with a state "
                           f"dict (only a safetensors file's bytes may carry theirs, under {CONFIG_KEY!r})")
    config_bytes = config_json(config, where)
    if isinstance(weights, Mapping):
        _check_tensors(weights, where, max_bytes)
        cuda = next((t.device for t in weights.values() if t.is_cuda), None)
        with _side_stream(cuda):
            snapshot = _from_tensors(handle, name, weights, config_bytes, strict, pin, max_bytes)
            if snapshot is not None:
                return snapshot
    if header is None:
        data = _safetensors(weights, where, max_bytes)
        if len(data) > max_bytes:
            _check_size(len(data), max_bytes, where)
    else:  # read where it lies, as tensors (plain LoRA); its size was checked before its header was read
        data = weights
        snapshot = _from_tensors(handle, name, safetensors_views(data, where, header), config_bytes, strict, pin,
                                 max_bytes, lambda: _values_fine(data, header))
        if snapshot is not None:
            return snapshot
    with _private_copy(PUSHED, where, in_memory=True) as copy:
        (copy / CONFIG_NAME).write_bytes(config_bytes)
        (copy / WEIGHTS_NAME).write_bytes(data)
        info = handle.inspect_adapter(name, copy, strict=strict)
        _check_size(image_bytes(handle, info), max_bytes, where)
        adapter = handle.read_adapter(name, copy, strict=strict)
    image = handle.pack(adapter, pin=pin)
    return Snapshot(name, dataclasses.replace(info, path=PUSHED), image_digest(config_bytes, image), (), image)


def _from_tensors(handle: LoraHandle, name: str, tensors, config_bytes: bytes, strict: bool, pin: bool,
                  max_bytes: int, fine: Callable[[], bool] | None = None) -> Snapshot | None:
    """A plain-LoRA state dict checked and packed where its tensors lie (None: it needs the folder reader); its
    values are checked while the packed image is hashed: by ``fine()`` where given (True: all of them are), else,
    or where it answers False, tensor by tensor (``check_values``, which names a bad one)."""
    found = handle.read_state_dict(name, tensors, json.loads(config_bytes), PUSHED, strict=strict, values=False)
    if found is None:
        return None
    info, adapter = found
    where = f"adapter {name!r} pushed from memory"
    _check_size(image_bytes(handle, info), max_bytes, where)
    image = handle.pack(adapter, pin=pin)
    digest = hash_image(config_bytes, image)
    try:
        if fine is None or not fine():
            check_values(adapter.modules, f"adapter {name!r} at {PUSHED}")
    finally:
        sha256 = digest()  # the hashing threads done with the image, whatever the check found
    return Snapshot(name, info, sha256, (), image)


_streams: dict = {}


@contextlib.contextmanager
def _side_stream(device):
    """A push's GPU work (checks, layout, the copy to the host) on a stream of its own, after what the caller's
    stream has queued (the pushed tensors' producers): never between the engine's kernels on its stream."""
    if device is None:
        yield
        return
    import torch

    device = torch.device("cuda", device) if isinstance(device, int) else device
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


_HASH_CHUNK = 1 << 20
_hashers: ThreadPoolExecutor | None = None
_hashers_lock = threading.Lock()


def image_digest(config: bytes, image: SlotImage) -> str:
    """A pushed adapter's identity: the sha256 of its config's sha256 and of the sha256 of each MiB of its packed
    image (the weights as the slots hold them), the chunks hashed on threads (an 8B model's rank-16 adapter is 84 MB:
    ~50 ms on one core)."""
    return hash_image(config, image)()


def hash_image(config: bytes, image: SlotImage) -> Callable[[], str]:
    """``image_digest``, started on the hashing threads: the returned call waits for it (call it before the image
    is written or freed)."""
    global _hashers
    data = image.buffer.numpy().data
    threads = min(16, os.cpu_count() or 1)
    with _hashers_lock:  # two first pushes at once make one pool
        if _hashers is None:
            _hashers = ThreadPoolExecutor(threads, thread_name_prefix="lorakit-hash")
    chunks = -(-len(data) // _HASH_CHUNK)
    per = -(-chunks // threads)  # one task per thread, each a run of chunks: few hand-overs of the GIL

    beside_engine = yielding_here()  # the hashing threads give the GIL back as their caller does

    def run(first: int) -> bytes:
        digests = []
        with yielding() if beside_engine else contextlib.nullcontext():
            for i in range(first, min(first + per, chunks)):
                pause()
                digests.append(hashlib.sha256(data[i * _HASH_CHUNK:(i + 1) * _HASH_CHUNK]).digest())
        return b"".join(digests)

    parts = [_hashers.submit(run, first) for first in range(0, chunks, per)]
    head = hashlib.sha256(config).digest()
    return lambda: hashlib.sha256(head + b"".join(part.result() for part in parts)).hexdigest()


SAFETENSORS_HEADER_BYTES = 100_000_000  # the safetensors library's own bound
CONFIG_KEY = "adapter_config"  # the safetensors metadata key a pushed adapter's config (JSON) travels under
# safetensors' dtype names, those torch has
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _values_fine(data, header: tuple[dict, int]) -> bool:
    """Whether every value of a safetensors file's bytes ``data`` is finite and within float32, read in one reduction
    over its data where its entries share one floating dtype (``check_values``'s test of each tensor, without 448
    reductions that each copy their tensor). False where they do not, or where a value is not: ``check_values``
    then reads tensor by tensor (only the adapter's: a weight strict=False ignores may hold anything)."""
    import torch

    entries, start = header
    dtypes = {entry["dtype"] for key, entry in entries.items() if key != "__metadata__"}
    dtype = getattr(torch, _SAFETENSORS_DTYPES[dtypes.pop()]) if len(dtypes) == 1 else None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or start % dtype.itemsize \
            or len(data) == start:
        return False
    with warnings.catch_warnings():  # read only
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        values = torch.frombuffer(data, dtype=dtype, offset=start)
    low, high = torch.aminmax(values)
    largest = torch.maximum(high, -low).item()  # NaN where a value is NaN
    return math.isfinite(largest) and largest <= torch.finfo(torch.float32).max


def safetensors_header(data, where: str) -> tuple[dict, int]:
    """A safetensors file's header (its JSON) and where its data begin, read from ``data`` (bytes, or a memoryview of
    them) and checked: AdapterError naming what is wrong."""
    fix = "not a readable safetensors file; re-save it with safetensors' save (PEFT's save_pretrained)"
    if len(data) < 8:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} has {len(data)} bytes: {fix}")
    size = int.from_bytes(data[:8], "little")
    if size > min(SAFETENSORS_HEADER_BYTES, len(data) - 8):
        raise AdapterError(f"{where}: {WEIGHTS_NAME}'s header claims {size} bytes, more than the "
                           f"{len(data) - 8} that follow: {fix} (a body cut short?)")
    header = parse_json(bytes(data[8:8 + size]), f"{where}: {WEIGHTS_NAME}'s header", fix)
    if not isinstance(header, dict):
        raise AdapterError(f"{where}: {WEIGHTS_NAME}'s header is not a JSON object: {fix}")
    return header, 8 + size


def safetensors_config(header: dict, where: str) -> dict:
    """The adapter config a pushed safetensors file carries in its header's metadata, under CONFIG_KEY (as
    ``lorakit.serve.push.push_body`` writes it); AdapterError naming what is missing."""
    fix = (f"send a safetensors file whose metadata holds the adapter's config as JSON under {CONFIG_KEY!r} "
           f"(lorakit.serve.push.push_body writes one)")
    metadata = header.get("__metadata__", {})
    text = metadata.get(CONFIG_KEY) if isinstance(metadata, dict) else None
    config = parse_json(text.encode(), f"{where}: the {CONFIG_KEY!r} metadata", fix) if isinstance(text, str) else None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: its safetensors metadata has no {CONFIG_KEY!r} object; {fix}")
    return config


def safetensors_views(data, where: str, header: tuple[dict, int] | None = None) -> dict:
    """The tensors of the safetensors file in ``data`` as CPU tensors viewing its bytes (no copy: they keep ``data``
    alive and must not be written), each entry checked as the safetensors library checks it: a known dtype, a shape
    of sizes >= 0, offsets that tile the data exactly. AdapterError (naming the entry) otherwise. ``header``:
    ``safetensors_header``'s answer for ``data``, when it was read already."""
    import torch

    header, start = header or safetensors_header(data, where)
    end = len(data) - start
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        pause()
        ok = (isinstance(entry, dict) and entry.get("dtype") in _SAFETENSORS_DTYPES
              and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list)
              and len(entry["data_offsets"]) == 2
              and all(type(n) is int and n >= 0 for n in (*entry["shape"], *entry["data_offsets"])))
        if not ok:
            raise AdapterError(f"{where}: {WEIGHTS_NAME}'s entry {key[:200]!r} is not a tensor the safetensors "
                               f"format describes (dtype, shape, data_offsets); re-save the adapter")
        entries.append((entry["data_offsets"][0], entry["data_offsets"][1], key, entry))
    entries.sort(key=lambda e: (e[0], e[1]))
    with warnings.catch_warnings():  # read only, and never written: they are copied into the image
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        whole = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
    at, tensors = 0, {}
    for begin, stop, key, entry in entries:
        pause()
        dtype = getattr(torch, _SAFETENSORS_DTYPES[entry["dtype"]])
        count = math.prod(entry["shape"])
        if begin != at or stop - begin != count * dtype.itemsize or stop > end:
            raise AdapterError(f"{where}: {WEIGHTS_NAME}'s entry {key[:200]!r} has data_offsets {[begin, stop]}, "
                               f"which do not follow the entry before it or match its dtype and shape within the "
                               f"{end} bytes of data: not a readable safetensors file (a body cut short?)")
        at = stop
        if count == 0:
            tensors[key] = torch.empty(entry["shape"], dtype=dtype)
        elif (start + begin) % dtype.itemsize:  # misaligned for its dtype: a copy
            tensors[key] = torch.frombuffer(bytearray(data[start + begin:start + stop]), dtype=dtype).view(
                entry["shape"])
        else:
            tensors[key] = whole[start + begin:start + stop].view(dtype).view(entry["shape"])
    if at != end:
        raise AdapterError(f"{where}: {WEIGHTS_NAME} has {end - at} bytes of data no entry names: not a readable "
                           f"safetensors file; re-save the adapter")
    return tensors


def _check_tensors(tensors, where: str, max_bytes: int) -> None:
    if not tensors:
        raise AdapterError(f"{where}: the weights must be a non-empty dict of tensors (a PEFT state dict, as "
                           f"get_peft_model_state_dict returns) or the bytes of a safetensors file, got an empty one")
    import torch

    total = 0
    for key, value in tensors.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise AdapterError(f"{where}: the weights must map names to tensors; {key!r} maps to "
                               f"{type(value).__name__}")
        total += value.numel() * value.element_size()
    _check_size(total, max_bytes, where)


def _safetensors(tensors, where: str, max_bytes: int) -> bytes:
    """A state dict as the bytes of a safetensors file (each tensor copied to the host once)."""
    from safetensors.torch import save

    if not isinstance(tensors, Mapping):
        raise AdapterError(f"{where}: the weights must be a non-empty dict of tensors (a PEFT state dict, as "
                           f"get_peft_model_state_dict returns) or the bytes of a safetensors file, got "
                           f"{type(tensors).__name__}")
    _check_tensors(tensors, where, max_bytes)
    host = {key: value.detach().to("cpu", copy=True).contiguous() for key, value in tensors.items()}
    return save(host)


def config_json(config, where: str) -> bytes:
    """A LoraConfig (its ``to_dict()``) or a dict, as adapter_config.json's bytes (sets as lists, enums as values)."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise AdapterError(f"{where}: the config must be a peft LoraConfig or a dict of its fields, got "
                           f"{type(config).__name__}")

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} is not JSON")

    try:
        return json.dumps(dict(config), default=plain).encode()
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{where}: the config cannot be written as JSON ({e})") from None


def reread(handle: LoraHandle, snapshot: Snapshot, *, strict: bool, pin: bool) -> SlotImage:
    """The snapshot's image read again from its files; ``Changed`` unless the same real paths (no link on the way)
    give the same sha256."""
    folder = snapshot.info.path
    with _private_copy(folder, f"adapter {snapshot.name!r} at {folder}") as copy:
        records = [_recopy(record, copy) for record in snapshot.files]
        now = digest(records)
        if now != snapshot.sha256:
            raise Changed(f"sha256 {now}, registered {snapshot.sha256}")
        adapter = handle.read_adapter(snapshot.name, copy, strict=strict)
    return handle.pack(adapter, pin=pin)


def digest(records: Iterable[FileRecord]) -> str:
    """One sha256 for the files: of the lines ``sha256sum`` prints for them (in the folder, ``sha256sum
    adapter_config.json adapter_model.safetensors | sha256sum`` gives the same)."""
    return hashlib.sha256("".join(f"{r.sha256}  {r.name}\n" for r in records).encode()).hexdigest()


def image_bytes(handle: LoraHandle, info: AdapterInfo) -> int:
    """The size of the packed image, from the header: A and B at each module's rank, in the model's dtype, at the
    shapes this model's slots hold (a tensor-parallel rank's: its shard of each sharded layer; every expert's of a
    stacked-experts parameter), and a DoRA module's float32 magnitudes."""
    itemsize = handle.dtype.itemsize
    total = 0
    for module, (rank, _) in info.modules.items():
        layer = handle.layers[module]
        total += rank * (layer.in_features + layer.out_features) * itemsize * getattr(layer, "num_experts", 1)
        total += 4 * layer.out_features if module in info.dora else 0
    return total


def _check_size(nbytes: int, max_bytes: int, where: str) -> None:
    if nbytes > max_bytes:
        raise AdapterError(f"{where}: it takes {nbytes / 2**20:.1f} MiB, more than the whole CPU cache "
                           f"({max_bytes / 2**20:.1f} MiB); raise cpu_budget_bytes")


# Files.

def _resolve(path: str | Path, roots: Sequence[str | Path] | None, where: str, what: str) -> Path:
    """``path`` with every link resolved; AdapterError when ``roots`` are given and it lies outside all of them."""
    real = Path(os.path.realpath(path))
    if roots is not None and not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
        raise AdapterError(f"{where}: {what} resolves to {real}, outside the folders adapters may be loaded from")
    return real


@contextlib.contextmanager
def _private_copy(folder: Path, where: str, in_memory: bool = False) -> Iterator[Path]:
    """A folder only this process writes (mode 0700), removed afterwards, to copy ``folder``'s files into (``in_memory``:
    on /dev/shm where there is one, for files that exist only for the read). Errors raised inside name ``folder``
    instead of the copy; an OSError becomes an AdapterError."""
    base = "/dev/shm" if in_memory and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    try:
        with tempfile.TemporaryDirectory(prefix="lorakit-adapter-", dir=base) as copy:
            try:
                yield Path(copy)
            except AdapterError as e:
                raise type(e)(str(e).replace(copy, str(folder))) from e
    except OSError as e:
        raise AdapterError(f"{where}: its files could not be read ({e})") from e


def _copy_in(real: Path, dest: Path, max_bytes: int, where: str = "") -> FileRecord:
    """Copy the regular file at ``real`` (no link followed there) to ``dest`` while hashing it. AdapterError when
    it is not a regular file or is larger than ``max_bytes`` (read no further); ``Changed`` when it is a link."""
    at = f"{where}: " if where else ""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO cannot hang the open
    except OSError as e:
        if os.path.islink(real):
            raise Changed(f"{at}{dest.name} is a link now") from e
        raise AdapterError(f"{at}{dest.name} cannot be read ({e.strerror})") from e
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AdapterError(f"{at}{dest.name} is not a regular file")
        if st.st_size > max_bytes:
            raise AdapterError(f"{at}{dest.name} has {st.st_size} bytes, more than the {max_bytes} lorakit reads")
        h, size = hashlib.sha256(), 0
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "xb") as out:
            while chunk := f.read(min(1 << 22, max_bytes + 1 - size)):
                size += len(chunk)
                if size > max_bytes:
                    raise AdapterError(f"{at}{dest.name} grew past {max_bytes} bytes while it was read")
                h.update(chunk)
                out.write(chunk)
    return FileRecord(dest.name, Path(real), size, h.hexdigest())


def _recopy(record: FileRecord, folder: Path) -> FileRecord:
    """Copy the file ``record`` was read from into ``folder`` again; ``Changed`` unless the same real path (no link
    on the way) holds a regular file of the same size (the caller compares the hashes)."""
    if not os.path.lexists(record.real):
        raise Changed(f"{record.name} is gone")
    if os.path.realpath(record.real) != str(record.real):
        raise Changed(f"{record.name} no longer resolves to {record.real}: a link is on the way")
    try:
        new = _copy_in(record.real, folder / record.name, record.size)
    except Changed:
        raise
    except AdapterError as e:  # not a regular file, or larger
        raise Changed(str(e)) from e
    if new.size != record.size:
        raise Changed(f"{record.name} has {new.size} bytes, {record.size} when it was registered")
    return new


# Tokenizers.

def read_tokenizer(name: str, folder: str | Path, roots: Sequence[str | Path] | None = None):
    """The tokenizer an adapter folder carries (``False`` when it has none: the engine's serves it), read from a
    private copy of its tokenizer files (inside ``roots`` when given). Never runs or imports code from the folder:
    a tokenizer_config.json with ``auto_map`` (custom code) or a ``tokenizer_class`` that is not one of
    transformers' tokenizer classes is refused (AdapterError)."""
    folder = Path(folder)
    where = f"adapter {name!r} at {folder}"
    if not any(os.path.lexists(folder / f) for f in ("tokenizer.json", "tokenizer_config.json")):
        return False
    fix = "fix or remove the tokenizer files in the folder"
    with _private_copy(folder, where) as copy:
        def take(file: str) -> None:
            if os.path.lexists(folder / file) and not (copy / file).exists():
                _copy_in(_resolve(folder / file, roots, where, file), copy / file, TOKENIZER_FILE_BYTES, where)

        take("tokenizer_config.json")
        config = {}
        if (copy / "tokenizer_config.json").exists():
            config = parse_json((copy / "tokenizer_config.json").read_bytes(), f"{where}: tokenizer_config.json", fix)
        if not isinstance(config, dict):
            raise AdapterError(f"{where}: tokenizer_config.json must hold a JSON object; {fix}")
        if config.get("auto_map"):
            raise AdapterError(f"{where}: tokenizer_config.json has auto_map {str(config['auto_map'])[:200]}: a "
                               f"tokenizer in custom code, and lorakit never runs code from an adapter folder; "
                               f"remove auto_map")
        cls = _tokenizer_class(config.get("tokenizer_class"), where)
        for file in {*_TOKENIZER_FILES, *(getattr(cls, "vocab_files_names", None) or {}).values()}:
            if isinstance(file, str) and "/" not in file:
                take(file)
        if (folder / _TEMPLATES).is_dir():
            for template in sorted((folder / _TEMPLATES).glob("*.jinja"))[:64]:
                take(f"{_TEMPLATES}/{template.name}")
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(copy, trust_remote_code=False,
                                                                   local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read it refuses the adapter, naming why
            raise AdapterError(f"{where}: its tokenizer cannot be read ({type(e).__name__}: {str(e)[:500]}); "
                               f"{fix}") from e
    tokenizer.name_or_path = str(folder)
    return tokenizer


def _tokenizer_class(name, where: str):
    """The transformers tokenizer class ``name`` names (None for none); AdapterError when transformers has no
    tokenizer class of that name (it would fall back to another, or to custom code)."""
    if name is None:
        return None
    from transformers import PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    cls = None
    if isinstance(name, str) and len(name) <= 100 and name.isidentifier():
        cls = tokenizer_class_from_name(name)
        if cls is None and not name.endswith("Fast"):
            cls = tokenizer_class_from_name(name + "Fast")
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase)
            and cls.__module__.startswith("transformers.")):
        raise AdapterError(f"{where}: tokenizer_config.json names tokenizer_class {str(name)[:100]!r}, which is not "
                           f"a tokenizer class of transformers; name one it has (e.g. PreTrainedTokenizerFast), or "
                           f"remove the tokenizer files to use the base model's tokenizer")
    return cls
