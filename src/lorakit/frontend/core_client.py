"""``CoreClient``: a server process's side of the engine core process (``lorakit.frontend.core``).

It starts the core (``launch``) or joins one another server started (``attach``), keeps a mirror of the core's
registered adapters (their versions, added tokens and tokenizers: the lookups a server makes on its event loop are
answered here, never by a round trip), sends requests and calls, and streams each request's outputs from the core's
``Step`` messages through its ``OutputProcessor`` (text, stop strings; ``frontend.streams``). It watches the core:
a core that exits is seen at once through its process sentinel (or, for a server that did not start it, its pid),
and every waiting request gets ``EngineDead``; ``health`` reads the core's beats.

One task reads the core's messages (``_read``), and no request can end it: a failure while one request's output is
delivered ends that request alone (``RequestStream.put``). Should the reader end anyway (a bug), this server is as
good as dead and says so as for a dead core: it logs why, fails every request in flight, answers 503, and
``on_death`` makes it exit non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from lorakit.engine.checks import check_prompt
from lorakit.engine.engine import Engine
from lorakit.engine.lengths import fit_params
from lorakit.engine.errors import EngineDead
from lorakit.engine.lifeline import on_main_thread
from lorakit.engine.outputs import FinishReason, OutputProcessor, RequestOutput, Unread
from lorakit.adapters.pool import AdapterRef, resolve
from lorakit.adapters.shared import SharedWeights
from lorakit.engine.sampling import SamplingParams
from lorakit.adapters.snapshot import read_tokenizer
from lorakit.peft import AdapterError
from lorakit.engine.structured import StructuredOutput
from lorakit.engine.stats import EngineStats
from lorakit.frontend.bodies import describe
from lorakit.frontend.client import Adapter
from lorakit.frontend.core import run_core
from lorakit.frontend.streams import RequestStream
from lorakit.frontend.wire import ERRORS, Abort, AdapterFacts, Adapters, Add, Beat, BodyFileError, Call, \
    CompileGrammar, Failed, FromCore, Push, Register, Reply, Shutdown, Step, ToCore, Unregister, to_frames

__all__ = ["CoreClient"]

logger = logging.getLogger("lorakit.core")

CATCH_UP_STEPS = 64  # the most queued messages of the core read in one pass (``CoreClient._read``)
# A pass over the streams longer than PACE_ABOVE seconds is followed by a pause of as long again (its share of the
# event loop is then READ_SHARE), in which the loop's other work runs: new requests (their HTTP, chat templates and
# tokenizing), slow clients' writes. Steps that come meanwhile wait, and the next pass merges them (one event per
# stream for all of them). Why 0.5: docs/serve-internals.md. A pass is timed by this thread's CPU time (waiting for
# the GIL another thread holds is not the pass's work) and counted at most PACE_MAX: a pass held up by a garbage
# collection is not followed by a pause as long, which doubled the stall
# (bench/results/bench_push_stalls_core_http_h200_1965bbf.txt).
READ_SHARE = 0.5
PACE_ABOVE = 0.001
PACE_MAX = 0.02


HISTORY = 16  # versions of a name a server remembers for NAME@N; the core decides which still live


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
        self.on_death: Callable[[], None] | None = None  # called once when this server cannot serve any more
        self.dead: str | None = None  # why the core is gone, once it is
        self.crashed = False  # it exited on its own (not stopped), or this server stopped reading it
        self._core_ends = False  # the core exits on its own (gone, or it said it cannot step): not stopped from here
        self.vocab_size, self.max_seq_len, self.eos_token_id = 0, 0, None
        self.kv_tokens, self.max_num_seqs = 0, 0  # from the core's Ready
        self._adapters: dict[str, Adapter] = {}
        self._history: dict[tuple[str, int], Adapter] = {}  # versions seen, for NAME@N (the last HISTORY of a name)
        self._queues: dict[str, RequestStream] = {}  # the requests in flight
        self._calls: dict[int, asyncio.Future] = {}
        self._ids, self._call_ids = itertools.count(), itertools.count()
        self._stats = EngineStats()
        self._heard = 0.0  # time.monotonic() of the core's last message
        self._folder: str | None = None
        self._body_files = True  # large pushed bodies handed to the core where they lie (until it cannot map one)
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
            raise ERRORS.get(message.kind, RuntimeError)(message.message)
        self.vocab_size, self.max_seq_len, self.eos_token_id = message.vocab_size, message.max_seq_len, \
            message.eos_token_id
        self.kv_tokens, self.max_num_seqs = message.kv_tokens, message.max_num_seqs
        self._stats = EngineStats(pid=message.pid)
        self._heard = time.monotonic()
        for facts in message.adapters:
            self._learn(Adapter.of(facts, read_tokenizer(facts.ref.name, facts.path)))

    def start(self) -> None:
        """Start reading the core's messages on the running event loop (``launch`` first if it was not)."""
        if self.addresses is None:
            self.launch()
        loop = asyncio.get_running_loop()
        self._from_core = zmq.asyncio.Socket.from_socket(self._from_core)
        self._reader = loop.create_task(self._read())
        self._reader.add_done_callback(self._read_ended)
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
                self._died(f"the engine core (pid {self.core_pid}) exited", core_ends=True)
                return
        self._died("the server process that started the engine core is gone", core_ends=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the core: running requests get ``timeout`` seconds, then end (abort); waits for the process."""
        if self.process is None:  # another server's core: it stops it
            self._stop_reading()
            self._fail_all(EngineDead("the server shut down before this request finished"))
            self._cleanup()
            return
        for process in self.companions:  # the other API servers: their requests in flight finish first
            process.terminate()
        for process in self.companions:
            process.join(40)
        if self.process.is_alive() and not self._core_ends:
            self.dead = self.dead or "the server is shutting down"
            try:
                asyncio.get_running_loop().remove_reader(self.process.sentinel)
            except RuntimeError:
                pass
            self._send(Shutdown(next(self._call_ids), timeout, self.index))
            self.process.join(timeout + 10)
        elif self.crashed:  # it said it cannot step any more, and is exiting
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._stop_reading()
        self._fail_all(EngineDead("the server shut down before this request finished"))
        self._cleanup()

    def _stop_reading(self) -> None:
        reader, self._reader = self._reader, None  # None first: ``_read_ended`` then knows it was stopped on purpose
        if reader is not None:
            reader.cancel()

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
        self._died(f"the engine core (pid {self.process.pid}) exited with code {self.process.exitcode}",
                   core_ends=True)

    def _read_ended(self, reader: asyncio.Task) -> None:
        """The reader of the core's messages ended: unless ``stop`` ended it, this server cannot serve any more."""
        if reader is not self._reader:
            return
        error = None if reader.cancelled() else reader.exception()
        how = "cancelled" if reader.cancelled() else "returned" if error is None else type(error).__name__
        logger.error("the reader of the engine core's messages ended (%s); this API server cannot serve any more",
                     how, exc_info=error)
        self._died("this API server stopped reading the engine core's messages (a bug: its log has the traceback)")

    def _died(self, reason: str, core_ends: bool = False) -> None:
        """This server cannot serve any more: the core is gone or going (``core_ends``: it exited, or said it cannot
        step with ``Failed``), or this server stopped reading it. Everything waiting fails with ``reason``, so does
        everything asked from now on, and the server is told, once."""
        if self.crashed:
            return
        self.dead, self.crashed, self._core_ends = reason, True, core_ends
        logger.error("%s; failing %d requests in flight", reason, len(self._queues))
        if not core_ends and self._queues:  # the core runs on: it drops them
            self._send_quietly(Abort(list(self._queues)))
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
        queues, self._queues = self._queues, {}
        if not queues:
            return
        if self.dead is None:
            self._send(Abort(list(queues)))
        for request_id, outs in queues.items():
            outs.put(RequestOutput.ended(request_id, FinishReason.ABORT, error=reason))

    def _fail_all(self, error: Exception) -> None:
        queues, self._queues = self._queues, {}
        for outs in queues.values():
            outs.fail(error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    # Lookups (answered here, from the core's facts).

    @property
    def adapters(self) -> dict[str, int]:
        return {name: a.ref.version for name, a in self._adapters.items()}

    @property
    def versions(self) -> dict[str, tuple[int, str]]:
        return {name: (a.ref.version, a.ref.sha256) for name, a in self._adapters.items()}

    def resolve(self, name: str) -> Adapter:
        return resolve(self._adapters, name)

    def _learn(self, adapter: Adapter) -> None:
        """``adapter`` is its name's current version now."""
        name, version = adapter.name, adapter.ref.version
        self._adapters[name] = self._history[name, version] = adapter
        for key in [k for k in self._history if k[0] == name and k[1] <= version - HISTORY]:
            del self._history[key]

    def resolve_version(self, name: str, version: int) -> Adapter:
        """A version this server saw registered or pushed, if the core may still have it (it checks when the request
        arrives: one whose version has ended since fails, saying so)."""
        found = self._history.get((name, version))
        if found is None:
            now = self._adapters.get(name)
            raise AdapterError(f"adapter {name!r} has no version {version} alive"
                               f"{f'; its current version is {now.ref.version}' if now is not None else ''}")
        return found

    def tokenizer_for(self, adapter: Adapter | None):
        return (adapter.tokenizer if adapter is not None else None) or self.tokenizer

    def prompt_ids(self, prompt: str | Sequence[int], adapter: Adapter | None) -> list[int]:
        added = frozenset() if adapter is None else adapter.added
        return check_prompt(prompt, self.tokenizer_for(adapter), self.vocab_size, added, self.max_seq_len,
                            None if adapter is None else adapter.name)

    def stats(self) -> EngineStats:
        return self._stats

    # Requests and calls.

    async def submit(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None) -> RequestStream:
        """Send the request to the core: its stream, which gets its outputs with their text as they come (closing
        it before the end aborts it in the core)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        request_id = f"s{self.index}-r{next(self._ids)}"
        params = fit_params(params, len(prompt), self.max_seq_len)
        processor = OutputProcessor(request_id, prompt, params, self.tokenizer_for(adapter))

        def abort():
            if self._queues.pop(request_id, None) is not None:
                self._send(Abort([request_id]))
        outs = self._queues[request_id] = RequestStream(processor, abort)
        self._send(Add(request_id, prompt, params, None if adapter is None else adapter.ref))
        return outs

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, with their text; leaving early aborts it in the core."""
        outs = await self.submit(prompt, params, adapter)
        try:
            async for out in outs:
                yield out
        finally:  # closed (and aborted, if unfinished) as soon as this generator is
            outs.close()

    async def compile_grammar(self, spec: StructuredOutput, adapter: Adapter | None, client: str | None = None
                              ) -> None:
        """Have the core compile ``spec``'s grammar for ``adapter`` (on a worker there, while it steps): returns
        once it is compiled, and the requests that use it then find it so, in ``client``'s turn; ValueError naming why
        it is refused (Overloaded: no room now)."""
        await self._call(CompileGrammar, spec=spec, adapter=None if adapter is None else adapter.ref, client=client)

    async def register_adapter(self, name: str, path: str | Path, roots: Sequence[Path] | None) -> int:
        """Read the adapter's tokenizer here, then have the core read, check and install the adapter."""
        tokenizer = await asyncio.to_thread(read_tokenizer, name, path, roots)
        found = await self._call(Register, name=name, path=str(path), roots=[str(r) for r in roots or []] or None)
        facts = msgspec.convert(found, AdapterFacts)
        self._learn(Adapter.of(facts, tokenizer))
        return facts.ref.version

    async def push_adapter(self, name: str, weights: bytes | memoryview | SharedWeights, config: dict | None,
                           version: int | None = None) -> AdapterRef:
        """Have the core check and install weights pushed from memory (a safetensors file's bytes) as ``name``'s new
        version; it carries no tokenizer. Bytes in a memfd (``BodyGate``'s of a large body) are mapped by the core, not
        sent (``lorakit.frontend.bodies``)."""
        where = describe(weights) if self._body_files else None
        try:
            found = await self._call(Push, name=name, weights=where or weights, config=config, version=version)
        except BodyFileError as e:  # e.g. /proc hidden from the core: the bytes, now and from now on
            logger.warning("the engine core cannot map pushed bodies (%s); sending their bytes instead", str(e))
            self._body_files = False
            found = await self._call(Push, name=name, weights=weights, config=config, version=version)
        facts = msgspec.convert(found, AdapterFacts)
        self._learn(Adapter.of(facts, False))
        return facts.ref

    async def unregister_adapter(self, name: str) -> None:
        await self._call(Unregister, name=name)
        self._adapters.pop(name, None)

    async def _call(self, kind: type[Call], **fields) -> Any:
        """Send the call ``kind(**fields)``; its reply's result (its error raised as the type the core raised)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(kind(call_id=call_id, server=self.index, **fields))
        return await future

    def _send(self, message: ToCore) -> None:
        try:
            self._to_core.send_multipart(to_frames(message, self._encode), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDead("the engine core is not reading its messages") from None

    def _send_quietly(self, message: ToCore) -> None:
        try:
            self._send(message)
        except (EngineDead, zmq.ZMQError) as e:
            logger.error("could not tell the engine core (%s)", e)

    # The core's messages.

    async def _read(self) -> None:
        """The core's messages in order. Steps that queued up while this process was busy are read together and
        each request's outputs in them merged into one before they are delivered: a server that falls behind
        catches up with one output (one detokenizing pass, one event) per request, not one per step it missed. A
        long pass is followed by a pause of as long again (READ_SHARE), so that streams never take the whole event
        loop from the requests that arrive (a pass's CPU time, at most PACE_MAX, paces it)."""
        sock, outputs = self._from_core, Unread()
        rest = 1 / READ_SHARE - 1
        while True:
            batch = [await sock.recv()]
            started = time.thread_time()
            while len(batch) < CATCH_UP_STEPS:
                ready = sock.recv(zmq.NOBLOCK)  # done at once: a message, or zmq.Again
                if ready.exception() is not None:
                    break
                batch.append(ready.result())
            self._heard = time.monotonic()
            for data in batch:
                message = self._decode(data)
                if isinstance(message, Step):
                    for out in message.outputs:
                        outputs.add(out.request_id, out)
                    if message.stats is not None:
                        self._stats = message.stats
                else:
                    self._deliver(outputs)
                    await self._handle(message)
            self._deliver(outputs)
            if rest > 0:
                spent = time.thread_time() - started
                if spent > PACE_ABOVE:
                    await asyncio.sleep(min(spent, PACE_MAX) * rest)

    async def _handle(self, message: FromCore) -> None:
        """One of the core's messages other than a Step."""
        if isinstance(message, Adapters):  # another server registered or removed one
            if message.removed is not None:
                self._adapters.pop(message.removed, None)
            else:
                facts = message.facts
                roots = [Path(r) for r in message.roots] if message.roots else None
                try:
                    tokenizer = await asyncio.to_thread(read_tokenizer, facts.ref.name, facts.path, roots)
                except Exception as e:  # noqa: BLE001 - the core read it: a file changed since; the reader goes on
                    logger.error("adapter %r: its tokenizer could not be read here (%s: %s)", facts.ref.name,
                                 type(e).__name__, e)
                    return
                self._learn(Adapter.of(facts, tokenizer))
        elif isinstance(message, Failed):  # its engine cannot step any more: it exits
            self._died(f"the engine core (pid {self.core_pid}) failed: {message.message}", core_ends=True)
        elif isinstance(message, Reply):
            future = self._calls.pop(message.call_id, None)
            if future is None or future.done():
                return
            if message.error is None:
                future.set_result(message.result)
            else:
                kind, text = message.error
                future.set_exception(ERRORS.get(kind, RuntimeError)(text))

    def _deliver(self, outputs: Unread) -> None:
        """Each request's new tokens to its stream (their text is made there), ``outputs`` emptied; none for a
        request aborted here."""
        queues = self._queues
        for request_id, out in outputs.take():
            outs = queues.get(request_id)
            if outs is None:
                continue
            if out.finished:
                del queues[request_id]
            outs.put(out)
