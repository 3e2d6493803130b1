"""What every handler is given: ``ServerState``, the server's config, metrics, limit on requests in flight, and its
one door to the engine.

Only the engine thread changes the engine. From the event loop, ServerState only looks things up (the registered
adapters, a tokenizer, a prompt's token ids, the context length); whatever changes the engine (a request, a load, an
unload) goes to the engine thread through ``AsyncEngine``. A load reads and checks the adapter's files on a worker
thread first (``Engine.read_adapter`` changes nothing), so the engine thread only installs what was checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.engine import AsyncEngine, Engine, RequestOutput, SamplingParams
from lorakit.layers.adapter import AdapterError
from lorakit.serve.metrics import Metrics
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody, sampling_params
from lorakit.serve.streaming import ConcurrencyLimit, interleave

__all__ = ["Result", "ServeConfig", "ServerState"]


@dataclass
class ServeConfig:
    """model_name: what clients call the base model. max_tokens_limit: the largest max_tokens accepted.
    max_concurrent: requests in flight at once (more get 429)."""

    model_name: str = "base"
    allow_runtime_lora: bool = False
    lora_roots: list[Path] = field(default_factory=list)
    api_key: str | None = None
    max_tokens_limit: int = 4096
    max_concurrent: int = 256


class Result:
    """One job's outputs, added up."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.finished:
            self.finish_reason = out.finish_reason


class ServerState:
    """See the module docstring. ``start`` (at the app's startup) runs the engine thread; ``stop`` lets the requests
    in flight finish, and fails the rest."""

    def __init__(self, engine: Engine, config: ServeConfig):
        self._engine, self.config = engine, config
        self.async_engine: AsyncEngine | None = None
        self.metrics = Metrics(engine, lambda: self.async_engine)
        self.in_flight = ConcurrencyLimit(config.max_concurrent)
        self._reading = asyncio.Lock()  # one adapter read at a time: each holds a whole adapter in memory

    def start(self) -> None:
        self.async_engine = AsyncEngine(self._engine)

    def stop(self) -> None:
        self.async_engine.shutdown()

    # Lookups, on the event loop.

    @property
    def adapters(self) -> dict[str, int]:
        """Registered adapters and their versions."""
        return self._engine.pool.adapters

    @property
    def adapter_versions(self) -> dict[str, tuple[int, str]]:
        """Registered adapters and their versions: (number, sha256 of the files as read)."""
        return self._engine.pool.versions

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self._engine.eos_token_id

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name nobody serves."""
        if model == self.config.model_name:
            return None
        adapters = self.adapters
        if model not in adapters:
            raise ApiError(404, f"the model {model!r} does not exist; available: "
                                f"{[self.config.model_name, *sorted(adapters)]}", "model")
        return model

    def prompt_ids(self, prompt: str | list[int], adapter: str | None) -> list[int]:
        """Tokenized and checked once, before any response starts (so a stream can still get a 400)."""
        try:
            return self._engine.prompt_ids(prompt, adapter)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None

    def sampling_params(self, body: CompletionBody | ChatBody, prompts: list[list[int]],
                        default_max_tokens: int | None) -> SamplingParams:
        return sampling_params(body, prompt_len=max(map(len, prompts)), max_seq_len=self._engine.max_seq_len,
                               max_tokens_limit=self.config.max_tokens_limit, default_max_tokens=default_max_tokens)

    def tokenizer(self, adapter: str | None):
        """The tokenizer of ``adapter``'s requests (its own where its folder has one); None if the engine has none."""
        return self._engine.tokenizer_for(adapter)

    def text(self, ids: list[int], adapter: str | None, skip_special_tokens: bool = False) -> str:
        """The text of token ids, as ``adapter``'s tokenizer reads them ("" without a tokenizer, as the engine's
        outputs are then)."""
        tokenizer = self.tokenizer(adapter)
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # On the engine thread.

    async def register_adapter(self, name: str, path: Path) -> int:
        """Reads and checks the adapter's files on a worker thread (every file inside the --lora-root folders;
        AdapterError for a bad one) while the engine keeps stepping, then installs them on the engine thread; its
        version."""
        async with self._reading:
            checked = await asyncio.to_thread(self._engine.read_adapter, name, path, self.config.lora_roots or None)
        return await self.async_engine.call(self._engine.install_adapter, checked)

    async def unregister_adapter(self, name: str) -> None:
        await self.async_engine.call(self._engine.unregister_adapter, name)

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: str | None
                       ) -> AsyncIterator[RequestOutput]:
        """One request's outputs, counted in the metrics; a request the engine refuses, or one that fails (its
        adapter could not be loaded, its grammar failed), is a 400."""
        with self.metrics.request(adapter or self.config.model_name) as measured:
            try:
                async for out in self.async_engine.generate(prompt, params, adapter):
                    measured.update(out)
                    if out.finish_reason == "error":
                        raise ApiError(400, out.error or "the request failed", "model")
                    yield out
            except (ValueError, AdapterError) as e:
                raise ApiError(400, str(e), "prompt") from None

    def stream(self, jobs: Sequence[tuple[list[int], SamplingParams, str | None]]
               ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every job (prompt ids, params, adapter) as they come, each with its job's index; the first
        error ends them all (raised here), and leaving early aborts every job."""
        return interleave([self.generate(*job) for job in jobs])

    async def results(self, jobs: Sequence[tuple[list[int], SamplingParams, str | None]]) -> list[Result]:
        """Every job's outputs added up, in the order of ``jobs``."""
        results = [Result() for _ in jobs]
        async for i, out in self.stream(jobs):
            results[i].add(out)
        return results
