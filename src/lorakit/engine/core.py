"""The engine core: the engine in a process of its own, and ``CoreClient``, the server's side of it.

``lorakit serve`` runs two processes (as vLLM's engine core and SGLang's scheduler process do)::

    server process (asyncio)                              core process (one loop)
    HTTP, validation, tokenizing, chat templates     Add / Abort / Call     scheduler, adapter pool,
    CoreClient: detokenizing, stop strings, streams  ------------------>    model runner, sampling
                                                     <------------------
                                                     Step (every output of a step, at once) / Reply / Ready

so the model's steps never wait for the GIL behind HTTP parsing or detokenizing, and the reverse. The two talk
over two ZeroMQ PUSH/PULL sockets (``ipc://`` in a folder only this user can enter), in msgspec's msgpack with a
typed schema on each side: a request's parameters are decoded into ``SamplingParams`` and checked again there.
The core sends one message per step, whatever the batch, and token ids only: the client turns them into text and
looks for stop strings (the core's engine runs with ``detokenize = False``; its stop tokens, eos and max_tokens
end requests as before). A stop string found by the client aborts the request in the core.

Several server processes (``lorakit serve --api-servers N``) can share one core: each pushes to the core's one
inbox and binds its own socket for the core's messages. A request id starts with its server's index ("s2-r17"), so
the core sends each step's outputs to the servers they belong to; a call's reply goes to its caller, and an adapter
registered or unregistered through one server is announced to the others (``Adapters``). The first server starts
the core (``launch``), the others ``attach`` to it.

A request's grammar (structured output) is compiled in the core, by the engine's grammar worker threads, while it
keeps stepping: the server asks for it first (a "grammar" call, answered once it compiled or with why it is refused)
and only then sends the request's Adds, which find it compiled (one compile for all of a request's prompts and
samples, each sequence a copy of its matcher); an Add whose grammar is still compiling waits outside the scheduler.
Decoding an Add checks a grammar's shape only, not the grammar again.

The core is built in the child from a picklable factory (``functools.partial`` of a module-level function that
returns an ``Engine``), and reports ``Ready`` (the facts the client answers lookups with) or ``Failed``. Adapter
folders are read on a worker thread of the core while it keeps stepping, then installed between steps.

Failure: a core that exits (killed, out of memory, a crash) is seen at once through its process sentinel: every
waiting request gets ``EngineDead``, calls fail, and ``on_death`` tells the server to exit (non-zero: a supervisor
restarts it); the other servers watch the core's pid and fail theirs within half a second. An engine that cannot
step any more (a ``FatalEngineError``: a tensor-parallel worker died) makes the core tell every server why
(``Failed``) and exit with status 1, the same death. A thread of the core sends every server a ``Beat`` every
``BEAT_SECONDS``, whatever the loop is doing (a long step, a graph capture), so ``health`` tells a core that stopped
running (SIGSTOP, a frozen host) from a busy one. A core whose parent is gone exits within a fraction of a second,
a SIGKILLed parent too (``lifeline``), and so do its tensor-parallel workers. The core ignores SIGINT and SIGTERM
(the whole process group gets Ctrl-C): the server lets the requests in flight finish, then stops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from lorakit.engine.client import EngineStats, engine_stats
from lorakit.engine.detokenize import IncrementalDetokenizer
from lorakit.engine.engine import _NO_TEXT, Engine, RequestOutput, TokenLogprob, check_prompt, drain, fit_params
from lorakit.engine.errors import EngineDead, FatalEngineError
from lorakit.engine.lifeline import die_with_parent, on_main_thread
from lorakit.engine.sampling import SamplingParams
from lorakit.engine.snapshot import read_tokenizer
from lorakit.engine.structured import Pending, StructuredOutput
from lorakit.layers.adapter import AdapterError

__all__ = ["CoreClient", "EngineDead", "run_core"]

logger = logging.getLogger("lorakit.core")

STATS_SECONDS = 0.25  # the core sends its stats at least this often while it steps (and once when it goes idle)
IDLE_POLL_MS = 100  # how long an idle core waits for a message before it looks at its adapter reads again
BEAT_SECONDS = 0.5  # the core's thread of beats sends one to every server this often
BEAT_QUEUE = 8  # beats queued for a server that does not read; later ones are dropped

# The wire: what the client sends ...

class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True):
    """A call answered by a ``Reply`` to server ``server``: "register" (name, path, roots), "unregister" (name),
    "shutdown" (seconds the running requests get to finish), "grammar" (a StructuredOutput's fields, adapter: its
    grammar compiled, or the reason it is refused)."""

    call_id: int
    method: str
    args: list[Any]
    server: int = 0


# ... and what the core sends.

class Out(msgspec.Struct, array_like=True):
    """A request's share of a step: new token ids (no text), and its finish reason if it ended."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    num_cached_tokens: int = 0


class Step(msgspec.Struct, tag=True, array_like=True):
    outputs: list[Out]
    stats: EngineStats | None = None


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: tuple[str, str] | None = None  # (exception type name, message)


class AdapterFacts(msgspec.Struct, array_like=True):
    """What the client needs of a registered adapter (it reads the adapter's tokenizer itself)."""

    name: str
    version: int
    sha256: str
    path: str  # the folder's real path, as read
    added_tokens: list[int]


class Adapters(msgspec.Struct, tag=True, array_like=True):
    """To the other servers after a register or unregister: the adapter's new facts (``roots``: the folders its
    files had to lie in), or its name removed."""

    facts: AdapterFacts | None
    removed: str | None = None
    roots: list[str] | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    pid: int
    vocab_size: int
    max_seq_len: int
    eos_token_id: int | list[int] | None
    adapters: list[AdapterFacts]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not be built (instead of Ready), or it cannot step any more (then the core exits)."""

    message: str
    kind: str


class Beat(msgspec.Struct, tag=True, array_like=True):
    """The core runs (sent by a thread of its own every ``BEAT_SECONDS``)."""


ToCore = Add | Abort | Call
FromCore = Step | Reply | Adapters | Ready | Failed | Beat
_ERRORS = {"AdapterError": AdapterError, "ValueError": ValueError, "TypeError": TypeError}


def _facts(engine: Engine, name: str) -> AdapterFacts:
    info, (version, sha256) = engine.pool.info(name), engine.pool.versions[name]
    return AdapterFacts(name, version, sha256, str(info.path), sorted(info.added_tokens))


# The core process.

def run_core(factory: Callable[[], Engine], to_core: str, from_core: list[str], parent_pid: int,
             kernel: bool = True) -> None:
    """The core process's main: build the engine, report Ready (or Failed), then serve until told to stop; exits
    with status 1 (after a Failed to every server) when the engine cannot step any more. It ignores SIGINT and
    SIGTERM: Ctrl-C in a terminal and a supervisor's stop reach the whole process group, and the server, which gets
    them too, lets the requests in flight finish and then stops the core. It exits when the server ``parent_pid`` is
    gone (``kernel``: the kernel may kill it then, see ``lifeline``)."""
    die_with_parent(parent_pid, "the engine core", kernel=kernel)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [core pid %(process)d]: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.bind(to_core)  # every server process pushes to it
    outboxes = []
    for address in from_core:  # one per server process: a request's outputs go to the server that sent it
        outbox = context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)
        outbox.connect(address)
        outboxes.append(outbox)
    encode = msgspec.msgpack.Encoder().encode
    try:
        engine = factory()
    except Exception as e:  # noqa: BLE001 - the server reports it and stops
        logger.exception("the engine could not be built")
        outboxes[0].send(encode(Failed(str(e), type(e).__name__)))
        outboxes[0].close(linger=5000)
        raise SystemExit(1) from None
    engine.detokenize = False
    logger.info("engine core ready (pid %d)", os.getpid())
    ready = encode(Ready(os.getpid(), engine.vocab_size, engine.max_seq_len, engine.eos_token_id,
                         [_facts(engine, name) for name in sorted(engine.pool.adapters)]))
    for outbox in outboxes:
        outbox.send(ready)
    stop_beats = threading.Event()
    beats = threading.Thread(target=_beat, args=(context, from_core, stop_beats), name="lorakit-core-beat",
                             daemon=True)
    beats.start()
    status = 0
    try:
        _Core(engine, inbox, outboxes).run()
    except FatalEngineError as e:
        logger.exception("the engine cannot step any more; the engine core exits")
        failed = encode(Failed(f"the engine cannot run any more steps ({type(e).__name__}: {e})", type(e).__name__))
        for outbox in outboxes:
            outbox.send(failed)
        status = 1
    finally:
        stop_beats.set()
        beats.join()
        for outbox in outboxes:
            outbox.close(linger=5000)
        inbox.close(linger=0)
    if status:
        raise SystemExit(status)


def _beat(context: zmq.Context, addresses: list[str], stop: threading.Event) -> None:
    """The core's beats, on a thread of their own (and sockets of their own: a socket belongs to one thread): one to
    every server every BEAT_SECONDS until ``stop``, dropped for a server that does not read."""
    beat = msgspec.msgpack.Encoder().encode(Beat())
    sockets = []
    for address in addresses:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, BEAT_QUEUE)
        socket.connect(address)
        sockets.append(socket)
    try:
        while not stop.wait(BEAT_SECONDS):
            for socket in sockets:
                with contextlib.suppress(zmq.Again):
                    socket.send(beat, zmq.NOBLOCK)
    finally:
        for socket in sockets:
            socket.close(linger=0)


class _Core:
    """The core's loop: drain the inbox, install finished adapter reads, step, send the step's outputs."""

    def __init__(self, engine: Engine, inbox: zmq.Socket, outboxes: list[zmq.Socket]):
        self.engine, self.inbox, self.outboxes = engine, inbox, outboxes
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(ToCore).decode
        self.pending: list[Out] = []  # outputs that go with the next message (refused requests)
        self.reads: list[tuple[Call, concurrent.futures.Future]] = []
        self.compiling: list[tuple[Add | Call, Pending]] = []  # requests and calls waiting for their grammars
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorakit-adapter-read")
        self.steps, self.step_seconds = 0, 0.0
        self.stats_at = 0.0
        self.deadline: float | None = None  # when shutting down: when the running requests are aborted
        self.shutdown_call: int | None = None

    def run(self) -> None:
        """Until a shutdown call has been answered; raises a ``FatalEngineError`` from a step."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished() or self.pending
            if self.inbox.poll(0 if busy else (5 if self.reads or self.compiling else IDLE_POLL_MS)):
                while True:
                    try:
                        message = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = self.decode(message)
                    except msgspec.ValidationError:  # the client checked it: a bug, logged, and the core goes on
                        logger.exception("a message from the server could not be read")
                        continue
                    self.handle(message)
            self.install_reads()
            self.admit_compiled()
            if self.deadline is not None and (not engine.has_unfinished() or time.monotonic() >= self.deadline):
                for request_id in list(engine._requests):
                    engine.abort(request_id)
                self.step()  # sends the aborts
                self.send(Reply(self.shutdown_call.call_id), self.shutdown_call.server)
                return
            if engine.has_unfinished() or self.pending:
                self.step()
            elif self.stats_at and time.monotonic() - self.stats_at > STATS_SECONDS:
                self.send_step([], self.stats())  # idle now: the last numbers
                self.stats_at = 0.0

    def handle(self, message: ToCore) -> None:
        engine = self.engine
        if isinstance(message, Add):
            spec = message.params.structured_output
            if spec is None:
                self.add(message)
            else:  # waits outside the scheduler while a worker compiles its grammar (at once if it is cached)
                self.compile(message, spec, message.adapter)
        elif isinstance(message, Abort):
            ids = set(message.request_ids)
            self.compiling = [(m, p) for m, p in self.compiling if not (isinstance(m, Add) and m.request_id in ids)]
            for request_id in message.request_ids:
                engine.abort(request_id)
        elif message.method == "grammar":
            try:
                spec = msgspec.convert(message.args[0], StructuredOutput)
            except (msgspec.ValidationError, ValueError) as e:
                self.send(Reply(message.call_id, error=("ValueError", str(e))), message.server)
            else:
                self.compile(message, spec, message.args[1])
        elif message.method == "register":
            name, path, roots = message.args
            self.reads.append((message, self.reader.submit(engine.read_adapter, name, path, roots)))
        elif message.method == "unregister":
            def unregister():
                engine.unregister_adapter(*message.args)
                self.broadcast(Adapters(None, message.args[0]), but=message.server)
            self.answer(message, unregister)
        elif message.method == "shutdown":
            self.deadline, self.shutdown_call = time.monotonic() + float(message.args[0]), message
        else:
            self.send(Reply(message.call_id, error=("ValueError", f"unknown call {message.method!r}")), message.server)

    def add(self, message: Add, grammar=None) -> None:
        try:
            self.engine.add_request(message.prompt_ids, message.params, message.adapter, message.request_id, grammar)
        except (ValueError, TypeError) as e:  # AdapterError too: unloaded since the client looked
            self.pending.append(Out(message.request_id, [], "error", len(message.prompt_ids), 0, error=str(e)))

    def compile(self, message: Add | Call, spec: StructuredOutput, adapter: str | None) -> None:
        """Have ``spec`` compiled for ``adapter`` on a worker; ``message`` waits in ``compiling`` till it is."""
        try:
            pending = self.engine.grammar(spec, adapter)
        except ValueError as e:
            pending = Pending(0.0, str(e))
        self.compiling.append((message, pending))
        self.admit_compiled()

    def admit_compiled(self) -> None:
        """Queue the requests whose grammars are compiled, and answer the calls that asked for one; a grammar that
        is refused (or past its budget of seconds) is the request's error, or the call's."""
        if not any(pending.done() for _, pending in self.compiling):
            return
        waiting, self.compiling = self.compiling, []
        for message, pending in waiting:
            if not pending.done():
                self.compiling.append((message, pending))
                continue
            try:
                grammar, error = pending.result(), None
            except ValueError as e:  # GrammarError
                grammar, error = None, str(e)
            if isinstance(message, Call):
                self.send(Reply(message.call_id, error=None if error is None else ("ValueError", error)),
                          message.server)
            elif error is not None:
                self.pending.append(Out(message.request_id, [], "error", len(message.prompt_ids), 0, error=error))
            elif grammar.tokenizer is not self.engine.tokenizer_for(message.adapter):  # hot-swapped meanwhile
                self.compiling.append((message, self.engine.grammar(message.params.structured_output, message.adapter)))
            else:
                self.add(message, grammar)

    def install_reads(self) -> None:
        """Install the adapters whose reads finished, in the order they were asked for."""
        while self.reads and self.reads[0][1].done():
            call, read = self.reads.pop(0)

            def install():
                checked = read.result()
                self.engine.install_adapter(checked)
                facts = _facts(self.engine, checked.snapshot.name)
                self.broadcast(Adapters(facts, roots=call.args[2]), but=call.server)
                return facts
            self.answer(call, install)

    def answer(self, call: Call, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except FatalEngineError:
            raise
        except Exception as e:  # noqa: BLE001 - the caller gets it
            self.send(Reply(call.call_id, error=(type(e).__name__, str(e))), call.server)
        else:
            self.send(Reply(call.call_id, result), call.server)

    def step(self) -> None:
        engine, outputs = self.engine, [*self.pending]
        self.pending.clear()
        start = time.perf_counter()
        stepped = engine.has_unfinished()
        try:
            results = engine.step() if stepped else []
        except FatalEngineError:
            raise  # the core exits (run_core)
        except Exception as e:  # noqa: BLE001 - not a request's fault (``Engine.step`` isolates those): all end
            logger.exception("a step failed")
            results = []
            for request_id, request in list(engine._requests.items()):
                engine.abort(request_id)
                outputs.append(Out(request_id, [], "abort", len(request.prompt_ids), len(request.output_ids),
                                   error=f"the engine step failed ({type(e).__name__}: {e})"))
            engine._aborted.clear()
        if stepped:
            self.steps += 1
            self.step_seconds += time.perf_counter() - start
        outputs += [Out(o.request_id, o.token_ids, o.finish_reason, o.num_prompt_tokens, o.num_output_tokens,
                        o.logprobs, o.error, o.num_cached_tokens) for o in results]
        now = time.monotonic()
        stats = None
        if now - self.stats_at > STATS_SECONDS:
            stats, self.stats_at = self.stats(), now
        if outputs or stats is not None:
            self.send_step(outputs, stats)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine, steps=self.steps, step_seconds=self.step_seconds)

    def send(self, message: FromCore, server: int = 0) -> None:
        self.outboxes[server].send(self.encode(message))

    def broadcast(self, message: FromCore, but: int | None = None) -> None:
        data = self.encode(message)
        for server, outbox in enumerate(self.outboxes):
            if server != but:
                outbox.send(data)

    def send_step(self, outputs: list[Out], stats: EngineStats | None) -> None:
        """Each server its requests' outputs (a request id starts with its server's "s<index>-"), and the stats."""
        if len(self.outboxes) == 1:
            self.send(Step(outputs, stats))
            return
        by_server: list[list[Out]] = [[] for _ in self.outboxes]
        for out in outputs:
            by_server[_server_of(out.request_id)].append(out)
        for server, outs in enumerate(by_server):
            if outs or stats is not None:
                self.send(Step(outs, stats), server)


def _server_of(request_id: str) -> int:
    return int(request_id[1: request_id.index("-")])


# The server's side.

@dataclass
class _Stream:
    queue: asyncio.Queue
    detok: IncrementalDetokenizer


@dataclass
class _Adapter:
    facts: AdapterFacts
    added: frozenset[int]
    tokenizer: object  # its folder's tokenizer, False when it has none


class CoreClient:
    """The engine in a child process (see the module docstring), behind the ``EngineClient`` interface.

    ``factory``: a picklable callable that builds the ``Engine`` in the child. ``tokenizer``: the base model's, for
    this process's tokenizing and detokenizing. ``launch()`` starts the core and waits until it is ready (before the
    server listens); ``start()``, on the event loop, starts reading its outputs. ``health`` says whether the core is
    alive and heard from (any message, its beats included)."""

    def __init__(self, factory: Callable[[], Engine] | None, tokenizer=None, servers: int = 1):
        self.factory, self.tokenizer, self.servers = factory, tokenizer, servers
        self.index = 0  # this server's among ``servers`` (``attach`` sets it)
        self.addresses: tuple[str, list[str]] | None = None  # (to the core, from the core to each server)
        self.core_pid: int | None = None
        self.process: multiprocessing.process.BaseProcess | None = None  # the core, when this process started it
        self.companions: list = []  # the other API server processes of this core (stopped before it)
        self.on_death: Callable[[], None] | None = None  # called once if the core exits on its own
        self.dead: str | None = None  # why the core is gone, once it is
        self.crashed = False  # it exited on its own (not stopped)
        self.vocab_size, self.max_seq_len, self.eos_token_id = 0, 0, None
        self._adapters: dict[str, _Adapter] = {}
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids, self._call_ids = itertools.count(), itertools.count()
        self._stats = EngineStats()
        self._heard = 0.0  # time.monotonic() of the core's last message
        self._folder: str | None = None
        self._context = zmq.Context()
        self._to_core = self._from_core = None
        self._reader: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromCore).decode

    @property
    def pid(self) -> int | None:
        return self.core_pid

    # Starting and stopping.

    def launch(self, timeout: float | None = None) -> None:
        """Start the core process and wait for its Ready (its model loaded, its graphs captured). A core that
        fails to build its engine raises here: the exception type it raised (ValueError, ...) with its message."""
        self._folder = tempfile.mkdtemp(prefix="lorakit-core-")  # mode 0700: only this user reaches the sockets
        self.addresses = (f"ipc://{self._folder}/to-core",
                          [f"ipc://{self._folder}/from-core-{i}" for i in range(self.servers)])
        self._connect()
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        self.process = spawn.Process(target=run_core, args=(self.factory, *self.addresses, os.getpid(),
                                                            on_main_thread()), name="lorakit-core", daemon=True)
        self.process.start()
        self.core_pid = self.process.pid
        logger.info("engine core started (pid %d); waiting for it to load the model", self.process.pid)
        self._wait_ready(timeout, self.process)

    def attach(self, addresses: tuple[str, list[str]], index: int, core_pid: int, timeout: float | None = None):
        """Be server ``index`` of a core another process launched (``addresses``: that client's), once it is
        ready."""
        self.addresses, self.index, self.core_pid, self.servers = addresses, index, core_pid, len(addresses[1])
        self._connect()
        self._wait_ready(timeout, None)

    def _connect(self) -> None:
        to_core, from_core = self.addresses
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of requests
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.connect(to_core)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.bind(from_core[self.index])

    def _wait_ready(self, timeout: float | None, process) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        while not self._from_core.poll(200):
            if process is not None and not process.is_alive():
                self._cleanup()
                raise EngineDead(f"the engine core (pid {process.pid}) exited with code {process.exitcode} while "
                                 f"starting; its log says why")
            if end is not None and time.monotonic() > end:
                if process is not None:
                    process.kill()
                self._cleanup()
                raise EngineDead(f"the engine core did not start within {timeout} s")
        message = self._decode(self._from_core.recv())
        while isinstance(message, Beat):  # the beats start after Ready, on sockets of their own: one may overtake it
            message = self._decode(self._from_core.recv())
        if isinstance(message, Failed):
            if process is not None:
                process.join(10)
            self._cleanup()
            raise _ERRORS.get(message.kind, RuntimeError)(message.message)
        self.vocab_size, self.max_seq_len, self.eos_token_id = message.vocab_size, message.max_seq_len, \
            message.eos_token_id
        self._stats = EngineStats(pid=message.pid)
        self._heard = time.monotonic()
        for facts in message.adapters:
            self._adapters[facts.name] = _Adapter(facts, frozenset(facts.added_tokens),
                                                  read_tokenizer(facts.name, facts.path))

    def start(self) -> None:
        """Start reading the core's messages on the running event loop (``launch`` first if it was not)."""
        if self.addresses is None:
            self.launch()
        loop = asyncio.get_running_loop()
        self._from_core = zmq.asyncio.Socket.from_socket(self._from_core)
        self._reader = loop.create_task(self._read())
        if self.process is not None:
            loop.add_reader(self.process.sentinel, self._exited)
        else:  # another server started the core (and reaps it when it dies): watch both
            self._watch = loop.create_task(self._watch_core(os.getppid()))

    async def _watch_core(self, parent: int) -> None:
        while True:
            await asyncio.sleep(0.5)
            if os.getppid() != parent:
                break
            try:
                os.kill(self.core_pid, 0)
            except ProcessLookupError:
                self._died(f"the engine core (pid {self.core_pid}) exited")
                return
        self._died("the server process that started the engine core is gone")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the core: running requests get ``timeout`` seconds, then end (abort); waits for the process."""
        if self.process is None:  # another server's core: it stops it
            if self._reader is not None:
                self._reader.cancel()
            self._fail_all(EngineDead("the server shut down before this request finished"))
            self._cleanup()
            return
        for process in self.companions:  # the other API servers: their requests in flight finish first
            process.terminate()
        for process in self.companions:
            process.join(40)
        if self.process.is_alive() and self.dead is None:
            self.dead = "the server is shutting down"
            try:
                asyncio.get_running_loop().remove_reader(self.process.sentinel)
            except RuntimeError:
                pass
            self._send(Call(next(self._call_ids), "shutdown", [timeout], self.index))
            self.process.join(timeout + 10)
        elif self.crashed:  # it said it cannot step any more, and is exiting
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(EngineDead("the server shut down before this request finished"))
        self._cleanup()

    def _cleanup(self) -> None:
        for socket in (self._to_core, self._from_core):
            if socket is not None:
                socket.close(linger=0)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _exited(self) -> None:
        """The core process ended on its own: everything waiting fails, and the server is told."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.process.sentinel)
        self.process.join(1)
        self._died(f"the engine core (pid {self.process.pid}) exited with code {self.process.exitcode}")

    def _died(self, reason: str) -> None:
        """The core is gone, or going (it said so: ``Failed``): everything waiting fails with ``reason``, so does
        everything asked from now on, and the server is told, once."""
        if self.crashed:
            return
        self.dead, self.crashed = reason, True
        logger.error("%s; failing %d requests in flight", reason, len(self._streams))
        self._fail_all(EngineDead(f"{reason}; the server restarts, send the request again"))
        if self.on_death is not None:
            self.on_death()

    def health(self, timeout: float) -> str | None:
        """Why the core cannot serve now: it is gone, or nothing came from it for more than ``timeout`` seconds (its
        beats come every BEAT_SECONDS from a thread of their own, so a long step does not count: a stopped, frozen or
        starved process does). None: it can."""
        if self.dead is not None:
            return self.dead
        silent = time.monotonic() - self._heard
        if silent > timeout:
            return (f"the engine core (pid {self.core_pid}) has sent nothing for {silent:.1f} s, more than the "
                    f"{timeout:g} s health timeout: it is stopped, frozen or starved of CPU")
        return None

    def end_requests(self, reason: str) -> None:
        """End every request in flight now: each stream gets a last output, finish_reason "abort" with ``reason`` as
        its error (whatever the core is doing), and the core is told to drop them."""
        streams, self._streams = self._streams, {}
        if not streams:
            return
        if self.dead is None:
            self._send(Abort(list(streams)))
        for request_id, stream in streams.items():
            stream.queue.put_nowait(RequestOutput(request_id, "", [], True, "abort", error=reason))

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    # Lookups (answered here, from the core's facts).

    @property
    def adapters(self) -> dict[str, int]:
        return {name: a.facts.version for name, a in self._adapters.items()}

    @property
    def versions(self) -> dict[str, tuple[int, str]]:
        return {name: (a.facts.version, a.facts.sha256) for name, a in self._adapters.items()}

    def tokenizer_for(self, adapter: str | None):
        found = self._adapters.get(adapter) if adapter is not None else None
        return (found.tokenizer if found is not None else None) or self.tokenizer

    def prompt_ids(self, prompt: str | Sequence[int], adapter: str | None) -> list[int]:
        added = frozenset()
        if adapter is not None:
            found = self._adapters.get(adapter)
            if found is None:
                raise AdapterError(f"unknown adapter {adapter!r}; registered: {sorted(self._adapters) or 'none'}")
            added = found.added
        return check_prompt(prompt, self.tokenizer_for(adapter), self.vocab_size, added, self.max_seq_len, adapter)

    def stats(self) -> EngineStats:
        return self._stats

    # Requests and calls.

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: str | None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, with their text; leaving early aborts it in the core."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        request_id = f"s{self.index}-r{next(self._ids)}"
        params = fit_params(params, len(prompt), self.max_seq_len)
        detok = IncrementalDetokenizer(self.tokenizer_for(adapter) or _NO_TEXT, prompt, params, self.eos_token_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(queue, detok)
        self._send(Add(request_id, prompt, params, adapter))

        def abort():
            if self._streams.pop(request_id, None) is not None:
                self._send(Abort([request_id]))
        async with contextlib.aclosing(drain(queue, abort)) as outs:  # closed (and aborted) as soon as this is
            async for out in outs:
                yield out

    async def compile_grammar(self, spec: StructuredOutput, adapter: str | None) -> None:
        """Have the core compile ``spec``'s grammar for ``adapter`` (on a worker there, while it steps): returns
        once it is compiled, and the requests that use it then find it so; ValueError naming why it is refused."""
        await self._call("grammar", {"json": spec.json, "regex": spec.regex, "choice": spec.choice, "lark": spec.lark},
                         adapter)

    async def register_adapter(self, name: str, path: str | Path, roots: Sequence[Path] | None) -> int:
        """Read the adapter's tokenizer here, then have the core read, check and install the adapter."""
        tokenizer = await asyncio.to_thread(read_tokenizer, name, path, roots)
        facts = msgspec.convert(await self._call("register", name, str(path), [str(r) for r in roots or []] or None),
                                AdapterFacts)
        self._adapters[name] = _Adapter(facts, frozenset(facts.added_tokens), tokenizer)
        return facts.version

    async def unregister_adapter(self, name: str) -> None:
        await self._call("unregister", name)
        self._adapters.pop(name, None)

    async def _call(self, method: str, *args) -> Any:
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(Call(call_id, method, list(args), self.index))
        return await future

    def _send(self, message: ToCore) -> None:
        try:
            self._to_core.send(self._encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDead("the engine core is not reading its messages") from None

    # The core's messages.

    async def _read(self) -> None:
        while True:
            message = self._decode(await self._from_core.recv())
            self._heard = time.monotonic()
            if isinstance(message, Step):
                for out in message.outputs:
                    self._deliver(out)
                if message.stats is not None:
                    self._stats = message.stats
            elif isinstance(message, Adapters):  # another server registered or removed one
                if message.removed is not None:
                    self._adapters.pop(message.removed, None)
                else:
                    facts = message.facts
                    roots = [Path(r) for r in message.roots] if message.roots else None
                    try:
                        tokenizer = await asyncio.to_thread(read_tokenizer, facts.name, facts.path, roots)
                    except AdapterError as e:  # read by the core already: only a file changed since
                        logger.error("adapter %r: its tokenizer could not be read here (%s)", facts.name, e)
                        continue
                    self._adapters[facts.name] = _Adapter(facts, frozenset(facts.added_tokens), tokenizer)
            elif isinstance(message, Failed):  # its engine cannot step any more: it exits
                self._died(f"the engine core (pid {self.core_pid}) failed: {message.message}")
            elif isinstance(message, Reply):
                future = self._calls.pop(message.call_id, None)
                if future is None or future.done():
                    continue
                if message.error is None:
                    future.set_result(message.result)
                else:
                    kind, text = message.error
                    future.set_exception(_ERRORS.get(kind, RuntimeError)(text))

    def _deliver(self, out: Out) -> None:
        """Turn a request's new tokens into text here, and end it at a stop string (aborting it in the core)."""
        stream = self._streams.get(out.request_id)
        if stream is None:  # aborted here already
            return
        text, reason, taken = "", None, 0
        for token in out.token_ids:
            delta, reason = stream.detok.append(token)
            text, taken = text + delta, taken + 1
            if reason is not None:
                break
        if reason is not None and out.finish_reason is None:  # a stop string: the core does not know yet
            self._send(Abort([out.request_id]))
        reason = reason or out.finish_reason
        logprobs = out.logprobs[:taken] if out.logprobs is not None else None
        output = RequestOutput(out.request_id, text, out.token_ids[:taken], reason is not None, reason, logprobs,
                               out.num_prompt_tokens, out.num_output_tokens - len(out.token_ids) + taken, out.error,
                               out.num_cached_tokens)
        if output.finished:
            del self._streams[out.request_id]
        stream.queue.put_nowait(output)

