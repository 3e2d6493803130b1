"""Large request bodies in memory the engine core maps too: a pushed adapter handed over by where it lies, not sent.

``BodyGate`` gathers a large body in a map (``gather_map``). On Linux that is a map of a memfd, and a push through the
engine core sends the core only where it lies (``BodyFile``: the server's pid, the memfd's descriptor, the size); the
core opens ``/proc/PID/fd/FD`` and maps the same pages read-only (``open_body``). Sent through zmq instead, 84 MB held
every step the core sent behind them for 50-60 ms (``bench/results/push_stall_round6.md``). Where the core cannot
open it (``BodyFileError``), the server sends the bytes after all.

A map of 84 MB takes 10-20 ms of a CPU to unmap (70 ms on a busy machine), and whoever drops its last reference does
it; ``UNMAPPER``'s thread does it here, once nothing views the map, never an event loop or the core's loop between two
steps.
"""

from __future__ import annotations

import mmap
import os
import queue
import stat
import threading

from lorakit.frontend.wire import BodyFile, BodyFileError

__all__ = ["UNMAPPER", "BodyMap", "Unmapper", "describe", "gather_map", "open_body"]


class BodyMap(mmap.mmap):
    """A writable map of a memfd, whose descriptor (``fd``) stays open until the map is closed: the core opens the
    memfd through it."""

    fd = -1

    def close(self) -> None:
        super().close()  # BufferError while a view lives: the descriptor stays open with the map
        self._close_fd()

    def __del__(self) -> None:  # dropped without close: the map is unmapped by mmap itself, the descriptor here
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def gather_map(size: int) -> mmap.mmap:
    """A writable map of ``size`` bytes to gather a body in: a ``BodyMap`` where the system has memfds (the core can
    map it, see ``describe``), else anonymous and private (its pages allotted only as they are written)."""
    if not hasattr(os, "memfd_create"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    fd = os.memfd_create("lorakit-body", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        body = BodyMap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    body.fd = fd
    return body


def describe(body) -> BodyFile | None:
    """Where the core can map ``body`` (a view of a ``BodyMap`` from its start, as ``BodyGate`` hands one on), or None
    (send the bytes)."""
    if isinstance(body, memoryview) and isinstance(body.obj, BodyMap) and body.obj.fd >= 0 and body.nbytes:
        return BodyFile(os.getpid(), body.obj.fd, body.nbytes)
    return None


def open_body(body: BodyFile) -> mmap.mmap:
    """The pages ``body`` describes, mapped read-only in this process (close the map once read, with ``UNMAPPER``);
    ``BodyFileError`` naming why when they cannot be had."""
    where = f"the pushed body in server {body.pid}'s descriptor {body.fd}"
    try:
        fd = os.open(f"/proc/{body.pid}/fd/{body.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise BodyFileError(f"{where} cannot be opened ({e.strerror})") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or not 0 < body.size <= found.st_size:
            raise BodyFileError(f"{where} is not a file of {body.size} bytes")
        try:
            return mmap.mmap(fd, body.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as e:
            raise BodyFileError(f"{where} cannot be mapped ({e.strerror})") from None
    finally:
        os.close(fd)


class Unmapper:
    """Closes the maps large bodies lie in, on a thread of its own, once nothing views them (a zero-copy send in
    flight, an exception's frames); ``mmap.close`` unmaps without the GIL and refuses while a view lives."""

    RETRY = 0.05  # seconds between tries at a map something still views

    def __init__(self):
        self._queue: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, buffer: mmap.mmap) -> None:
        """``buffer`` closed on this thread, once its last view is released."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also in a child made by fork
                self._thread = threading.Thread(target=self._run, name="lorakit-unmap", daemon=True)
                self._thread.start()
        self._queue.put(buffer)

    def _run(self) -> None:
        waiting: list[mmap.mmap] = []
        while True:
            try:
                waiting.append(self._queue.get(timeout=self.RETRY if waiting else None))
            except queue.Empty:
                pass
            viewed = []
            for buffer in waiting:
                try:
                    buffer.close()
                except BufferError:  # a view of it is still alive: later
                    viewed.append(buffer)
            waiting = viewed


UNMAPPER = Unmapper()
