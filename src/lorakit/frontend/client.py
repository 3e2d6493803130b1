"""How a server talks to an engine: ``EngineClient``, one interface with two homes for the engine.

``InProcessClient`` runs it on a thread of this process (``AsyncEngine``: tests, embedding code,
``create_app(engine)``); ``CoreClient`` (``frontend.core_client``) in a process of its own (``lorakit serve``). Both give the same answers.
Lookups are answered at once from the caller's thread; whatever changes the engine goes to its thread or process.
An engine that cannot step any more fails every request with ``EngineDead``, turns ``health`` and ``crashed``, and
calls ``on_death`` once; one request's failure to be delivered is its own (``RequestStream``). More:
docs/serve-internals.md#two-processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lorakit.engine.engine import Engine
from lorakit.engine.outputs import RequestOutput
from lorakit.adapters.pool import AdapterRef
from lorakit.adapters.shared import SharedWeights
from lorakit.frontend.async_engine import AsyncEngine
from lorakit.frontend.streams import RequestStream
from lorakit.engine.sampling import SamplingParams
from lorakit.engine.stats import EngineStats
from lorakit.engine.structured import StructuredOutput
from lorakit.peft.gil import beside

__all__ = ["Adapter", "EngineClient", "InProcessClient", "kv_tokens"]


@dataclass(frozen=True, eq=False)
class Adapter:
    """A request's adapter as the server resolved its ``model`` once, at the edge: the version (``ref``, what the
    engine gets) and what this process needs of it."""

    ref: AdapterRef
    path: str
    added: frozenset[int]  # the token ids it adds to the vocabulary
    tokenizer: object = None  # its folder's tokenizer; None: the base model's

    @property
    def name(self) -> str:
        return self.ref.name

    @classmethod
    def of(cls, facts, tokenizer) -> Adapter:
        """From the core's ``AdapterFacts`` and the tokenizer read here (False: its folder has none)."""
        return cls(facts.ref, facts.path, frozenset(facts.added_tokens), tokenizer or None)


class EngineClient(Protocol):
    """What a server needs of an engine (see the module docstring)."""

    vocab_size: int
    max_seq_len: int
    eos_token_id: int | list[int] | None
    kv_tokens: int  # the KV cache's room, in tokens (num_blocks x block_size): what the engine can hold at once
    max_num_seqs: int  # the most requests the engine runs at once; the rest wait in its queue
    servers: int  # the API server processes that share this engine (each bounds its own requests in flight)

    @property
    def adapters(self) -> dict[str, int]: ...  # registered names -> version numbers

    @property
    def versions(self) -> dict[str, tuple[int, str]]: ...  # registered names -> (version number, sha256)

    def resolve(self, name: str) -> Adapter: ...  # the registered adapter's current version (AdapterError: none)

    def resolve_version(self, name: str, version: int) -> Adapter: ...  # that version while it lives, else AdapterError

    def tokenizer_for(self, adapter: Adapter | None): ...

    def prompt_ids(self, prompt: str | Sequence[int], adapter: Adapter | None) -> list[int]: ...

    crashed: bool  # the engine died on its own (not stopped)
    on_death: Callable[[], None] | None  # called once when it does (from any thread)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def compile_grammar(self, spec: StructuredOutput, adapter: Adapter | None, client: str | None = None
                              ) -> None: ...  # ValueError: refused (Overloaded: no room now)

    def health(self, timeout: float) -> str | None: ...  # why it cannot serve now (None: it can)

    def end_requests(self, reason: str) -> None: ...  # every request in flight ends now: "abort", error ``reason``

    async def submit(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None
                     ) -> RequestStream: ...  # the request sent: its stream (read it, or ``listen``)

    def generate(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None
                 ) -> AsyncIterator[RequestOutput]: ...

    async def register_adapter(self, name: str, path: str | Path, roots: Sequence[Path] | None) -> int: ...

    async def push_adapter(self, name: str, weights: bytes | memoryview | SharedWeights, config: dict | None,
                           version: int | None = None) -> AdapterRef: ...

    async def unregister_adapter(self, name: str) -> None: ...

    def stats(self) -> EngineStats: ...


class InProcessClient:
    """The engine on a thread of this process (``AsyncEngine``). Lookups read the engine directly (the pool's maps
    are copied, never locked); an adapter's files are read and checked on a worker thread (``AdapterRegistry.read``
    changes nothing) and only installed on the engine thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.vocab_size, self.max_seq_len, self.eos_token_id = engine.vocab_size, engine.max_seq_len, engine.eos_token_id
        self.kv_tokens = kv_tokens(engine)
        self.max_num_seqs, self.servers = engine.config.max_num_seqs, 1
        self.async_engine: AsyncEngine | None = None
        self.crashed = False
        self.on_death: Callable[[], None] | None = None
        self._reading: asyncio.Lock | None = None  # one adapter read at a time: each holds a whole adapter in memory

    @property
    def adapters(self) -> dict[str, int]:
        return self.engine.pool.adapters

    @property
    def versions(self) -> dict[str, tuple[int, str]]:
        return self.engine.pool.versions

    def resolve(self, name: str) -> Adapter:
        return self._adapter(self.engine.pool.ref(name))

    def resolve_version(self, name: str, version: int) -> Adapter:
        return self._adapter(self.engine.pool.live(name, version))

    def _adapter(self, ref: AdapterRef) -> Adapter:
        info = self.engine.pool.resolve(ref).info
        tokenizer = self.engine.registry.tokenizer_for(ref)
        return Adapter(ref, str(info.path), info.added_tokens, None if tokenizer is self.engine.tokenizer else tokenizer)

    def tokenizer_for(self, adapter: Adapter | None):
        return (adapter.tokenizer if adapter is not None else None) or self.engine.tokenizer

    def prompt_ids(self, prompt: str | Sequence[int], adapter: Adapter | None) -> list[int]:
        return self.engine.prompt_ids(prompt, None if adapter is None else adapter.ref)

    def start(self) -> None:
        self.async_engine = AsyncEngine(self.engine, on_death=self._died)

    def _died(self) -> None:
        self.crashed = True
        if self.on_death is not None:
            self.on_death()

    def stop(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()

    async def compile_grammar(self, spec: StructuredOutput, adapter: Adapter | None, client: str | None = None
                              ) -> None:
        # on the engine's grammar workers, not its thread
        await self.engine.grammar(spec, None if adapter is None else adapter.ref, client).wait_async()

    def health(self, timeout: float) -> str | None:
        """Why the engine cannot serve now (it failed for good), or None. ``timeout`` is for an engine in another
        process; this one's thread shares the server's process."""
        return self.async_engine.dead if self.async_engine is not None else None

    def end_requests(self, reason: str) -> None:
        if self.async_engine is not None:
            self.async_engine.end_requests(reason)

    async def submit(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None) -> RequestStream:
        return await self.async_engine.submit(prompt, params, None if adapter is None else adapter.ref)

    def generate(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None
                 ) -> AsyncIterator[RequestOutput]:
        return self.async_engine.generate(prompt, params, None if adapter is None else adapter.ref)

    async def register_adapter(self, name: str, path: str | Path, roots: Sequence[Path] | None) -> int:
        self._reading = self._reading or asyncio.Lock()
        async with self._reading:
            checked = await asyncio.to_thread(beside, self.engine.registry.read, name, path, roots)
        return await self.async_engine.call(self.engine.registry.install, checked)

    async def push_adapter(self, name: str, weights: bytes | memoryview | SharedWeights, config: dict | None,
                           version: int | None = None) -> AdapterRef:
        self._reading = self._reading or asyncio.Lock()
        async with self._reading:
            checked = await asyncio.to_thread(beside, self.engine.registry.read_pushed, name, weights, config)
        version = await self.async_engine.call(self.engine.registry.install, checked, version)
        return AdapterRef(name, version, checked.snapshot.sha256)  # this push's, whatever was pushed since

    async def unregister_adapter(self, name: str) -> None:
        await self.async_engine.call(self.engine.unregister_adapter, name)

    def stats(self) -> EngineStats:
        return self.engine.stats() if self.async_engine is None else self.async_engine.stats()


def kv_tokens(engine: Engine) -> int:
    """The tokens an engine's KV cache holds at once: every block full."""
    return engine.config.num_blocks * engine.config.block_size

