"""The engine core process: the engine loop (``lorakit.engine.loop``) in a process of its own, and its transport.

``_Core`` turns each message of ``frontend.wire`` (ZeroMQ PUSH/PULL over ``ipc://``) into work for the one loop, and
each step's outputs into one ``Step`` message per server (token ids: the servers make the text). Grammars compile and
adapter folders are read on worker threads while the loop steps; both are taken up between steps. The core reports
``Ready`` or ``Failed``, beats every ``BEAT_SECONDS`` from a thread of its own, exits 1 when the engine cannot step,
dies with its parent (``lifeline``) and ignores SIGINT/SIGTERM (the server stops it with a ``Shutdown`` call). Why two
processes, the messages, health and shutdown: docs/serve-internals.md#two-processes.
"""

from __future__ import annotations

import concurrent.futures
import atexit
import contextlib
import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from lorakit.adapters.pool import AdapterGone
from lorakit.engine.engine import Engine
from lorakit.engine.errors import FatalEngineError, Overloaded
from lorakit.engine.lifeline import die_with_parent, name_process
from lorakit.engine.loop import EngineLoop
from lorakit.engine.outputs import FinishReason, RequestOutput
from lorakit.engine.registry import CheckedAdapter
from lorakit.engine.stats import EngineStats
from lorakit.engine.structured import Pending, StructuredOutput
from lorakit.frontend.bodies import UNMAPPER, open_body
from lorakit.frontend.client import kv_tokens
from lorakit.frontend.wire import Abort, Adapters, AdapterFacts, Add, Beat, BodyFile, Call, CompileGrammar, Failed, \
    FromCore, Push, Ready, Register, Reply, Shutdown, Step, ToCore, Unregister
from lorakit.peft.gil import beside

__all__ = ["facts", "freeze_heap", "run_core"]

logger = logging.getLogger("lorakit.core")

STATS_SECONDS = 0.25  # the core sends its stats at least this often while it steps (and once when it goes idle)
BEAT_SECONDS = 0.5  # the core's thread of beats sends one to every server this often
BEAT_QUEUE = 8  # beats queued for a server that does not read; later ones are dropped


def facts(engine: Engine, name: str) -> AdapterFacts:
    ref, info = engine.pool.ref(name), engine.pool.info(name)
    return AdapterFacts(ref, str(info.path), sorted(info.added_tokens))


# The core process.

def _run(core: "_Core") -> None:
    """``core.run()``, under cProfile when $LORAKIT_PROFILE_CORE names a file for its stats (a debugging aid: where the
    engine core's host time goes under traffic; the profiler slows the host, so time nothing with it on)."""
    path = os.environ.get("LORAKIT_PROFILE_CORE")
    if not path:
        return core.run()
    import cProfile

    profiler = cProfile.Profile()
    try:
        profiler.runcall(core.run)
    finally:
        profiler.dump_stats(path)


def freeze_heap() -> None:
    """Collect once, then keep every object alive now out of the cyclic garbage collector's passes (``gc.freeze``):
    what a process has built by the time it serves (torch, transformers, the model, the app: about half a million
    objects) lives as long as it does, and each full collection walked all of it again, 0.2 s on the event loop or
    between two steps. Called by the engine core and each API server once they are ready. Unfrozen at exit, so that
    the interpreter's shutdown collects them as before (frozen, nanobind reports each of triton's objects as leaked:
    fifty lines after a clean Ctrl-C)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def run_core(factory: Callable[[], Engine], to_core: str, from_core: list[str], parent_pid: int,
             kernel: bool = True) -> None:
    """The core process's main: build the engine, report Ready (or Failed), then serve until told to stop; exits
    with status 1 (after a Failed to every server) when the engine cannot step any more. It ignores SIGINT and
    SIGTERM: Ctrl-C in a terminal and a supervisor's stop reach the whole process group, and the server, which gets
    them too, lets the requests in flight finish and then stops the core. It exits when the server ``parent_pid`` is
    gone (``kernel``: the kernel may kill it then, see ``lifeline``)."""
    die_with_parent(parent_pid, "the engine core", kernel=kernel)
    name_process("lorakit engine-core")
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
    freeze_heap()
    logger.info("engine core ready (pid %d)", os.getpid())
    ready = encode(Ready(os.getpid(), engine.vocab_size, engine.max_seq_len, engine.eos_token_id, kv_tokens(engine),
                         engine.config.max_num_seqs,
                         [facts(engine, name) for name in sorted(engine.pool.adapters)]))
    for outbox in outboxes:
        outbox.send(ready)
    stop_beats = threading.Event()
    beats = threading.Thread(target=_beat, args=(context, from_core, stop_beats), name="lorakit-core-beat",
                             daemon=True)
    beats.start()
    status = 0
    try:
        _run(_Core(engine, inbox, outboxes))
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
    """The transport around the engine loop: the inbox socket's messages become the loop's work, each step's
    outputs one ``Step`` message per server."""

    def __init__(self, engine: Engine, inbox: zmq.Socket | None, outboxes: list[zmq.Socket]):
        self.engine, self.inbox, self.outboxes = engine, inbox, outboxes
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(ToCore).decode
        self.loop = EngineLoop(engine, self, self.send_step, self.idle)
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorakit-adapter-read")
        self.stats_at = 0.0
        self.compiling: set[str] = set()  # requests waiting for their grammars (an abort takes one out)
        self.handlers: dict[type, Callable] = {Add: self.add_request, Abort: self.abort, Register: self.register,
                                               Push: self.push, Unregister: self.unregister, CompileGrammar: self.compile_grammar,
                                               Shutdown: self.shutdown}

    def run(self) -> None:
        """Until a shutdown call has been answered; raises a ``FatalEngineError`` from a step."""
        self.loop.run()

    def take(self, timeout: float | None) -> list[Callable[[], None]]:
        """The loop's inbox: the messages that came (waiting up to ``timeout`` s for one), each as a command."""
        if not self.inbox.poll(-1 if timeout is None else int(timeout * 1000)):
            return []
        commands = []
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)  # a pushed adapter's bytes stay where zmq put them
            except zmq.Again:
                return commands
            body = self.inbox.recv(copy=False) if frame.more else None  # a Push's bytes (wire.to_frames)
            try:
                message = self.decode(frame.buffer)
            except msgspec.ValidationError:  # the client checked it: a bug, logged, and the core goes on
                logger.exception("a message from the server could not be read")
                continue
            if body is not None:
                message.weights = body.buffer
            commands.append(lambda message=message: self.handle(message))

    def handle(self, message: ToCore) -> None:
        self.handlers[type(message)](message)

    def add_request(self, message: Add) -> None:
        spec = message.params.structured_output
        if spec is None:
            self.add(message)
        else:  # waits outside the scheduler while a worker compiles its grammar (at once if it is cached)
            self.compile(message, spec)

    def abort(self, message: Abort) -> None:
        for request_id in message.request_ids:
            self.engine.abort(request_id)
            self.compiling.discard(request_id)

    def compile_grammar(self, call: CompileGrammar) -> None:
        self.compile(call, call.spec, call.adapter, call.client)

    def register(self, call: Register) -> None:
        """The folder read on the reader thread while the loop steps (giving the GIL back to it:
        ``lorakit.peft.gil``), installed between steps."""
        read = self.reader.submit(beside, self.engine.registry.read, call.name, call.path, call.roots)
        self.loop.after(read, lambda read: self.answer(call, lambda: self.install(call, read.result())))

    def push(self, call: Push) -> None:
        """Weights pushed from memory, checked on the reader thread while the loop steps (as ``register``), installed
        between steps."""
        read = self.reader.submit(beside, self.read_pushed, call)
        self.loop.after(read, lambda read: self.answer(call, lambda: self.install(call, read.result())))

    def read_pushed(self, call: Push) -> CheckedAdapter:
        """``call``'s weights read (packed into an image of their own), then let go here, on the reader's thread:
        freeing the frame zmq received them in (84 MB) takes ~10 ms, which the loop's thread would spend between two
        steps. Weights the server holds in a memfd (``BodyFile``) are mapped here and unmapped by ``UNMAPPER``."""
        weights, call.weights = call.weights, None
        mapped = open_body(weights) if isinstance(weights, BodyFile) else None
        try:
            if mapped is not None:
                weights = memoryview(mapped)
            return self.engine.registry.read_pushed(call.name, weights, call.config)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)  # the views its frames hold go too
            raise
        finally:
            del weights
            if mapped is not None:
                UNMAPPER.release(mapped)

    def unregister(self, call: Unregister) -> None:
        def unregister():
            self.engine.unregister_adapter(call.name)
            self.broadcast(Adapters(None, call.name), but=call.server)
        self.answer(call, unregister)

    def shutdown(self, call: Shutdown) -> None:
        self.loop.drain(call.seconds, lambda: self.send(Reply(call.call_id), call.server))

    def add(self, message: Add, grammar=None) -> None:
        try:
            self.engine.add_request(message.prompt_ids, message.params, message.adapter, message.request_id, grammar)
        except (ValueError, TypeError) as e:  # AdapterError too: unloaded or replaced since the server resolved it
            self.loop.put(RequestOutput.ended(message.request_id, FinishReason.ERROR, error=str(e),
                                              num_prompt_tokens=len(message.prompt_ids),
                                              adapter_gone=isinstance(e, AdapterGone)))

    def compile(self, message: Add | CompileGrammar, spec: StructuredOutput, adapter=None, client: str | None = None
                ) -> None:
        """Have ``spec`` compiled on a worker; ``message`` waits for it outside the scheduler."""
        if isinstance(message, Add):
            adapter = message.adapter
            self.compiling.add(message.request_id)
        try:
            pending = self.engine.grammar(spec, adapter, client)
        except ValueError as e:  # AdapterError too
            pending = Pending(0.0, str(e))
        if pending.done():  # cached, or refused before any work
            self.compiled(message, pending)
        else:
            self.loop.after(pending, lambda pending, message=message: self.compiled(message, pending))

    def compiled(self, message: Add | CompileGrammar, pending: Pending) -> None:
        """A grammar compiled (or refused, or past its budget of seconds): the request queued (or its error), or the
        call answered."""
        try:
            grammar, error = pending.result(), None
        except ValueError as e:  # GrammarError, Overloaded
            grammar, error = None, (type(e).__name__ if isinstance(e, Overloaded) else "ValueError", str(e))
        if isinstance(message, CompileGrammar):
            self.send(Reply(message.call_id, error=error), message.server)
        elif message.request_id not in self.compiling:  # aborted while it compiled
            return
        elif error is not None:
            self.loop.put(RequestOutput.ended(message.request_id, FinishReason.ERROR,
                                              num_prompt_tokens=len(message.prompt_ids), error=error[1]))
        else:
            self.add(message, grammar)
        if isinstance(message, Add):
            self.compiling.discard(message.request_id)

    def install(self, call: Register | Push, checked) -> AdapterFacts:
        self.engine.registry.install(checked, getattr(call, "version", None))
        found = facts(self.engine, checked.snapshot.name)
        self.broadcast(Adapters(found, roots=getattr(call, "roots", None)), but=call.server)
        return found

    def answer(self, call: Call, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except FatalEngineError:
            raise
        except Exception as e:  # noqa: BLE001 - the caller gets it
            self.send(Reply(call.call_id, error=(type(e).__name__, str(e))), call.server)
        else:
            self.send(Reply(call.call_id, result), call.server)

    def stats(self) -> EngineStats:
        return self.loop.stats()

    def idle(self) -> None:
        """The loop has nothing to do: the last numbers, once."""
        if self.stats_at:
            self.send_step([], force=True)
            self.stats_at = 0.0

    def send(self, message: FromCore, server: int = 0) -> None:
        self.outboxes[server].send(self.encode(message))

    def broadcast(self, message: FromCore, but: int | None = None) -> None:
        data = self.encode(message)
        for server, outbox in enumerate(self.outboxes):
            if server != but:
                outbox.send(data)

    def send_step(self, outputs: list[RequestOutput], force: bool = False) -> None:
        """Each server its requests' outputs (a request id starts with its server's "s<index>-"), and the stats
        every STATS_SECONDS."""
        now = time.monotonic()
        stats = None
        if force or now - self.stats_at > STATS_SECONDS:
            stats, self.stats_at = self.stats(), now
        if not outputs and stats is None:
            return
        if len(self.outboxes) == 1:
            self.send(Step(outputs, stats))
            return
        by_server: list[list[RequestOutput]] = [[] for _ in self.outboxes]
        for out in outputs:
            by_server[_server_of(out.request_id)].append(out)
        for server, outs in enumerate(by_server):
            if outs or stats is not None:
                self.send(Step(outs, stats), server)


def _server_of(request_id: str) -> int:
    return int(request_id[1: request_id.index("-")])
