"""Chat templates are untrusted input (a model's or an adapter's tokenizer files): each render runs transformers' own
``apply_chat_template`` in a worker process, within a time budget (past it the worker is killed, and the next render
starts a fresh one), a memory budget (the worker's address space) and an output budget; a template that passed the
time or memory budget once is refused at once after that (no worker killed again and again). A process, not a thread:
Jinja cannot be interrupted, and one C call of a template (``{{ 9**9**9 }}``, folded as it compiles) holds the GIL
for as long as it runs. The caller's event loop only waits, on the thread of a ``ChatTemplates``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ChatTemplates", "TemplateBudget", "TemplateError"]

logger = logging.getLogger("lorakit.serve")

START_SECONDS = 60.0  # a fresh worker's imports (about 1 s), and a tokenizer's unpickling: not the template's time
CACHED_TOKENIZERS = 4  # tokenizers a worker keeps (the model's and adapters' own), least recently used dropped
_HEADER = struct.Struct(">IB")  # a frame: its payload's length, its kind, the payload
# Kinds: to the worker, a tokenizer (TOKENIZER) or a render (RENDER); back, its answer.
TOKENIZER, RENDER, READY, MISSING, TEXT, FAILED, TOO_LONG, NO_MEMORY = b"TRYMOFLX"
TIMED_OUT, DIED = b"td"  # what _ask makes of no answer
SPENT_TEMPLATES = 1024  # templates remembered as past a budget (refused at once), least recent forgotten


class TemplateError(ValueError):
    """A render that failed or passed a budget; the message names the template (``whose``) and what happened."""


@dataclass(frozen=True)
class TemplateBudget:
    """seconds: the longest one render may run; memory_bytes: what one render may allocate beyond what the worker
    holds before it (its imports and tokenizers)."""

    seconds: float = 1.0
    memory_bytes: int = 2 << 30

    def __post_init__(self):
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not 0 < self.seconds < 1e6:
            raise ValueError(f"TemplateBudget.seconds must be a number of seconds > 0, got {self.seconds!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 1 << 24:
            raise ValueError(f"TemplateBudget.memory_bytes must be an int >= 16 MiB, got {self.memory_bytes!r}")


class ChatTemplates:
    """Renders chat templates in one worker process, one render at a time, from the thread this object owns (await
    ``render``); ``close`` ends the worker."""

    def __init__(self, budget: TemplateBudget = TemplateBudget()):
        self.budget = budget
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="lorakit-template")
        self._worker: subprocess.Popen | None = None
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its key in the worker
        self._next_key = itertools.count()
        self._spent: OrderedDict[str, str] = OrderedDict()  # sha256 of a template past a budget -> which

    async def render(self, tokenizer, messages: list[dict], tools: list[dict] | None, max_chars: int, whose: str
                     ) -> str:
        """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)`` as
        transformers renders it, within the budgets; TemplateError naming ``whose`` ("the model's chat template")
        when it fails, runs past ``budget.seconds``, allocates past ``budget.memory_bytes`` or renders more than
        ``max_chars`` characters. A template that passed a budget before is refused here, at once."""
        template = tokenizer.chat_template
        digest = hashlib.sha256(repr(template).encode("utf-8", "surrogatepass")).hexdigest()
        if digest in self._spent:
            raise TemplateError(f"{whose} {self._spent[digest]} at an earlier request, and is not run again; fix the "
                                f"template (an adapter's: then load it again)")
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self._render, tokenizer, template, digest, messages, tools, max_chars, whose)

    def close(self) -> None:
        """The worker killed at once (a render in progress fails); a later ``render`` would start a fresh one."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._kill()

    def _render(self, tokenizer, template, digest: str, messages, tools, max_chars: int, whose: str) -> str:
        key = self._keys.setdefault(tokenizer, next(self._next_key))
        job = pickle.dumps((key, template, messages, tools, max_chars))
        kind, payload = self._ask(RENDER, job, self.budget.seconds)
        if kind == MISSING:  # a fresh worker, or one that dropped it: sent once, then asked again
            sent = self._ask(TOKENIZER, struct.pack(">Q", key) + pickle.dumps(tokenizer), START_SECONDS)
            if sent[0] != READY:  # not the template's doing: a bug
                raise RuntimeError(f"the chat template worker could not take the tokenizer of {whose} "
                                   f"({sent[1].decode('utf-8', 'replace')[:500] or chr(sent[0])})")
            kind, payload = self._ask(RENDER, job, self.budget.seconds)
        if kind == TEXT:
            return payload.decode("utf-8", "surrogatepass")
        if kind == TOO_LONG:
            raise TemplateError(f"{whose} rendered more than {max_chars} characters (twice --max-prompt-chars) for "
                                f"these messages; fix the template or shorten the messages")
        if kind == FAILED:
            raise TemplateError(f"{whose} {payload.decode('utf-8', 'replace')[:500]}")
        why = {TIMED_OUT: f"ran past its time budget of {self.budget.seconds:g} s (a loop that does not end, or too "
                          f"much work)",
               NO_MEMORY: f"needed more than {self.budget.memory_bytes >> 20} MiB of memory to render",
               }.get(kind, f"ended its worker process (exit code {payload.decode()})")
        logger.warning("%s %s; its worker was replaced, and the template is not run again", whose, why)
        self._spent[digest] = why  # (read on the event loop: one dict operation at a time, under the GIL)
        while len(self._spent) > SPENT_TEMPLATES:
            self._spent.popitem(last=False)
        raise TemplateError(f"{whose} {why}; fix the template")

    def _ask(self, kind: int, payload: bytes, seconds: float) -> tuple[int, bytes]:
        """Sends a frame to the worker (started first if there is none) and reads its answer within ``seconds``;
        past them, or when the worker died, it is replaced and the answer is (TIMED_OUT, b"") or (DIED, its exit
        code)."""
        worker = self._worker or self._start()
        deadline = time.monotonic() + seconds
        try:
            _write(worker.stdin.fileno(), kind, payload)
            answer = _read(worker.stdout.fileno(), deadline)
        except OSError:  # the worker died (a broken pipe): killed by the kernel, say
            answer = None
        if answer is None or answer[0] == NO_MEMORY:  # (a worker out of memory ends itself)
            try:  # a worker that closed its end before the deadline is ending: its exit code
                code = worker.wait(max(min(deadline - time.monotonic(), 1.0), 0.0))
            except subprocess.TimeoutExpired:
                code = None
            self._replace()
            if answer is None:
                answer = (TIMED_OUT, b"") if code is None else (DIED, str(code).encode())
        return answer

    def _start(self) -> subprocess.Popen:
        package_parent = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_parent,
                                                                          os.environ.get("PYTHONPATH"))))}
        # No preexec_fn (lifeline.parent_death_signal): it makes Python fork the whole server (tens of milliseconds a
        # GB, the GIL held) where it otherwise vforks; the worker asks for its signal itself (``_die_with_parent``).
        self._worker = subprocess.Popen([sys.executable, "-m", "lorakit.frontend.chat_templates",
                                         str(self.budget.memory_bytes), str(os.getpid())], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        ready = _read(self._worker.stdout.fileno(), time.monotonic() + START_SECONDS)
        if ready is None or ready[0] != READY:
            self._kill()
            raise RuntimeError("the chat template worker did not start (its error is in the log above)")
        return self._worker

    def _replace(self) -> None:
        """The worker killed, and a fresh one started as soon as this thread is free (not at the next render)."""
        self._kill()
        try:
            self._thread.submit(lambda: self._worker or self._start())
        except RuntimeError:  # closed
            pass

    def _kill(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
            worker.wait()
            worker.stdin.close()
            worker.stdout.close()


def _write(fd: int, kind: int, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload), kind) + payload)
    while data:
        data = data[os.write(fd, data):]


def _read(fd: int, deadline: float | None = None) -> tuple[int, bytes] | None:
    """One frame (kind, payload) from ``fd``; None at its end, or at ``deadline`` (time.monotonic)."""
    data, need = bytearray(), _HEADER.size  # (extended in place: a tokenizer's frame is megabytes)
    while len(data) < need:
        if deadline is not None and not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
            return None
        chunk = os.read(fd, min(need - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
        if need == _HEADER.size and len(data) == need:
            need += _HEADER.unpack(data)[0]
    return data[4], bytes(memoryview(data)[_HEADER.size:])  # one copy


# The worker.

def _die_with_parent(parent: int) -> None:
    """The kernel's SIGKILL for this process when the parent's thread that started it ends (this object's thread,
    which lives as long as the server): ``lorakit.engine.lifeline``'s signal, asked for here without importing the
    engine (and torch). Where there is no such signal, stdin's end at the parent's death ends the loop in ``main``."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # gone before the signal was asked for
        os._exit(1)


@contextlib.contextmanager
def _memory_limit(extra: int):
    """Inside, this process may map at most ``extra`` bytes beyond what it maps on entry (a MemoryError past them).
    Set per render, not once at the start: what taking a tokenizer imports is not the template's (transformers 5.17
    imports torch as it unpickles one, gigabytes of address space with a CUDA build)."""
    import resource

    size = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra if soft == resource.RLIM_INFINITY else min(size + extra, soft)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _answer(job: bytes, tokenizers: OrderedDict, memory_bytes: int) -> tuple[int, bytes]:
    """A render's answer: TEXT, or why there is none (FAILED: what follows the template's name in the message)."""
    import jinja2

    key, template, messages, tools, max_chars = pickle.loads(job)
    tokenizer = tokenizers.get(key)
    if tokenizer is None:
        return MISSING, b""
    tokenizers.move_to_end(key)
    tokenizer.chat_template = template
    try:
        with _memory_limit(memory_bytes):
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except MemoryError:
        return NO_MEMORY, b""
    except jinja2.TemplateSyntaxError as e:
        return FAILED, f"cannot be compiled: {e}".encode("utf-8", "replace")
    except jinja2.TemplateError as e:  # the template's own checks (raise_exception), e.g. roles' order
        return FAILED, f"refused these messages: {e}".encode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - whatever else it raised (a TypeError, a RecursionError) is its failure
        return FAILED, f"failed on these messages ({type(e).__name__}: {e})".encode("utf-8", "replace")
    if len(text) > max_chars:
        return TOO_LONG, b""
    return TEXT, text.encode("utf-8", "surrogatepass")


def main() -> None:
    """Frames in on stdin, answers on stdout, until stdin ends (the parent gone)."""
    _die_with_parent(int(sys.argv[2]))
    import setproctitle

    setproctitle.setproctitle("lorakit chat-templates")  # as lifeline.name_process names lorakit's other processes
    out = os.dup(1)
    os.dup2(2, 1)  # whatever else writes to stdout (an import, a template's print) goes to the log, not the answers
    import transformers  # noqa: F401 - imported outside the memory limit: the budget is the template's
    import transformers.utils.chat_template_utils  # noqa: F401

    memory_bytes = int(sys.argv[1])
    inp = sys.stdin.fileno()
    tokenizers: OrderedDict = OrderedDict()
    _write(out, READY, b"")
    while (frame := _read(inp)) is not None:
        kind, payload = frame
        if kind == TOKENIZER:
            try:
                tokenizers[struct.unpack(">Q", payload[:8])[0]] = pickle.loads(payload[8:])
            except Exception as e:  # noqa: BLE001 - told to the parent, which raises it
                _write(out, FAILED, f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
                continue
            while len(tokenizers) > CACHED_TOKENIZERS:
                tokenizers.popitem(last=False)
            _write(out, READY, b"")
        else:
            answer = _answer(payload, tokenizers, memory_bytes)
            _write(out, *answer)
            if answer[0] == NO_MEMORY:
                return  # a fresh worker for the next render


if __name__ == "__main__":
    main()
