"""Processes that die with their parent: every process lorakit starts (the engine core, tensor-parallel workers, a
server a benchmark or test starts) ends within a fraction of a second of the process that started it, however that
one ended (a SIGKILL too, which runs no ``finally``).

Two mechanisms, both on: the kernel's parent-death signal where there is one (Linux ``prctl(PR_SET_PDEATHSIG,
SIGKILL)``, through ctypes), and a daemon thread that looks at ``os.getppid()`` every ``POLL_SECONDS`` (a process
whose parent is gone is given another parent) and ends the process with ``os._exit``. The kernel's signal is sent
when the *thread* that started the child ends, not its process: a parent asks for it only when it starts the child
from its main thread (``kernel=on_main_thread()``), so a child started from a short-lived thread is not killed with
that thread; the polling thread still ends it when the parent process goes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["POLL_SECONDS", "die_with_parent", "name_process", "on_main_thread", "parent_death_signal"]

logger = logging.getLogger("lorakit.lifeline")

POLL_SECONDS = 0.2  # how often the polling thread looks at the parent
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Callable | None:
    """libc's prctl, where this is Linux and it can be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def on_main_thread() -> bool:
    """Whether the calling thread is the main thread: where a parent may ask the kernel to kill its children with it
    (see the module docstring)."""
    return threading.current_thread() is threading.main_thread()


def die_with_parent(parent_pid: int, what: str, kernel: bool = True) -> None:
    """Make this process end when process ``parent_pid`` (its parent) is gone: the kernel's SIGKILL on the parent's
    death (``kernel``, where there is one), and a daemon thread that polls and calls ``os._exit(1)``. Call it first
    thing in the child; if the parent is gone already, this process exits here. ``what`` names this process in the
    log line."""
    prctl = _prctl() if kernel else None
    if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("%s: prctl(PR_SET_PDEATHSIG) failed (errno %d); polling for the parent only", what,
                       ctypes.get_errno())
    if os.getppid() != parent_pid:  # gone before the signal was asked for
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(POLL_SECONDS)
            if os.getppid() != parent_pid:
                logger.error("%s: its parent (pid %d) is gone; exiting", what, parent_pid)
                os._exit(1)

    threading.Thread(target=watch, name="lorakit-lifeline", daemon=True).start()


def parent_death_signal() -> Callable[[], None] | None:
    """For ``subprocess.Popen(..., preexec_fn=parent_death_signal())``: the child gets SIGKILL when the calling thread
    ends (the whole process, when called on its main thread); None where the kernel has no such signal. A child that
    is Python and knows its parent's pid should rather call ``die_with_parent``, which also polls."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: no Python objects beyond these
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)
    return preexec


def name_process(title: str) -> None:
    """Show this process as ``title`` in ps, top and /proc (its command line and its thread name), not as the
    ``python3 -B -c from multiprocessing.spawn ...`` that spawned processes run as."""
    import setproctitle

    setproctitle.setproctitle(title)
