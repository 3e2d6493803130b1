"""The engine: requests in, tokens out, many adapters in every batch.

``Engine`` owns the patched model, the adapter pool, the scheduler and the runner. ``add_request`` queues a
prompt for an adapter (or the base model); each ``step()`` schedules a batch, runs it, samples one token
per finishing position on the device, and returns what each request gained (``RequestOutput``).
``AsyncEngine`` runs the steps on a thread and streams outputs to asyncio code (the server); ``LLM`` is the
offline front door::

    llm = LLM("path/to/model", max_loras=8, adapters={"sql": "/adapters/sql"})
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=64, temperature=0.0), adapters=["sql", None])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import random
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lorakit.engine.config import EngineConfig
from lorakit.engine.detokenize import IncrementalDetokenizer
from lorakit.engine.errors import EngineDead, FatalEngineError
from lorakit.engine.pool import AdapterPool
from lorakit.engine.runner import Fill, ModelRunner, kv_shape
from lorakit.engine.sampling import SamplingBatch, SamplingParams, sample
from lorakit.engine.scheduler import BlockManager, Request, Scheduler, StepPlan
from lorakit.engine.snapshot import Snapshot, read_tokenizer
from lorakit.engine.structured import Constraint, Grammar, Grammars, Pending, StructuredOutput
from lorakit.layers.adapter import AdapterError, activation_start
from lorakit.layers.handle import LoraHandle
from lorakit.layers.patch import patch
from lorakit.ops import cdiv

logger = logging.getLogger("lorakit.engine")
# Request.lora_start of an activated LoRA's request whose prompt lacks the invocation: past every position, so the
# adapter never applies (its slot is held all the same).
NOT_INVOKED = sys.maxsize

__all__ = ["AsyncEngine", "CompletionOutput", "Engine", "LLM", "RequestOutput"]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top tokens' logprobs (empty unless asked for)


@dataclass
class RequestOutput:
    """What one request gained in one step: new text and tokens, and whether it finished."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why, when finish_reason is "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's next one, as one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.request_id, self.text + later.text, self.token_ids + later.token_ids, later.finished,
                             later.finish_reason, logprobs, later.num_prompt_tokens, later.num_output_tokens,
                             later.error, later.num_cached_tokens)


@dataclass
class CompletionOutput:
    """A finished request, as ``LLM.generate`` returns it."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


async def drain(queue: asyncio.Queue, abort: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
    """One request's outputs from ``queue`` until the finished one (an exception in the queue is raised); a consumer
    that leaves before then (a client gone) calls ``abort``. Outputs already waiting when one is taken are merged into
    it: a stream that fell behind (a busy event loop) catches up in one output, not one per token."""
    pending, finished = None, False
    try:
        while not finished:
            out, pending = (pending if pending is not None else await queue.get()), None
            if isinstance(out, BaseException):
                raise out
            while not out.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    pending = later
                    break
                out = out.merged(later)
            finished = out.finished
            yield out
    finally:
        if not finished and abort is not None:
            abort()


class _NoText:
    """The tokenizer of an engine given none: token ids only, no text (stop strings never match)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


_NO_TEXT = _NoText()


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter folder read and checked in full by ``Engine.read_adapter``, ready for ``install_adapter``."""

    snapshot: Snapshot
    tokenizer: object  # the folder's tokenizer, False when it has none


PLACEHOLDER = 0  # an output token sampled by the step still on the device: filled in there, then on the host


@dataclass
class _Flight:
    """A step whose device work is queued: its sampled tokens (on the device, for the next step's inputs) and their
    copies to the host, complete once ``done`` (a CUDA event; None on the CPU) has fired. ``rows``: each sampling
    request's row, and the index in its output_ids that the row's token takes."""

    requests: list[Request]
    tokens: torch.Tensor | None
    host: tuple
    done: object
    rows: dict[Request, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Sampled:
    """What a step sampled, as host lists: one row per request that samples."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


@dataclass
class _State:
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None = field(default=None)
    constraint: Constraint | None = None  # structured output: the tokens allowed next
    sync: bool = False  # its next step needs its last token on the host (grammar, penalties, logit bias)


class Engine:
    """See the module docstring. ``model`` is a transformers causal LM (patched here unless it already is, with
    the config's ``max_loras`` and ``max_rank``). ``config``: an ``EngineConfig``, or its fields as keywords
    (``Engine(model, tok, max_loras=4)``; both: the keywords replace the config's fields). ``adapters``: {name:
    folder} to register at start. ``engine.config`` is the config with the values resolved from the model
    (``max_seq_len``, ``num_blocks``).

    ``model`` may also be a picklable function that builds the model (e.g. ``functools.partial`` of a module-level
    loader); with ``tensor_parallel_size`` N > 1 it must be: each of the N processes builds the full model with it,
    keeps its shard and moves it to ``device`` ("cuda": rank r on GPU r; "cpu": gloo processes; default: CUDA when
    there is one). See ``lorakit.parallel.executor``; ``close()`` stops the other processes.
    """

    def __init__(self, model: nn.Module | Callable[[], nn.Module], tokenizer=None, config: EngineConfig | None = None,
                 *, adapters: dict[str, str | Path] | None = None, device: str | None = None, **options):
        config = EngineConfig(**options) if config is None else dataclasses.replace(config, **options)
        self._workers = None
        if config.tensor_parallel_size > 1:
            model = self._start_workers(model, config, device)
        elif not isinstance(model, nn.Module):
            if not callable(model):
                raise TypeError(f"model must be a torch.nn.Module or a function that builds one, got "
                                f"{type(model).__name__}")
            model = model()
            model = model.to(device) if device is not None else model
        try:
            self._build(model, tokenizer, config, adapters)
        except BaseException:
            self.close()  # the other ranks, if any
            raise

    def _build(self, model: nn.Module, tokenizer, config: EngineConfig, adapters) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.handle = _patched(model, config)
        if self._workers is not None:  # the pool's slot writes are made on every rank
            self._workers.mirror_slots(self.handle)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = text_config.vocab_size
        self.config = config = _resolve(config, model, text_config, self.handle.device)
        manager = self.handle.slots.manager
        self.pool = manager if isinstance(manager, AdapterPool) else AdapterPool(
            self.handle, cpu_budget_bytes=config.cpu_budget_bytes, strict=config.lora_strict)
        self._tokenizers: dict[Snapshot, object] = {}  # an adapter version -> its folder's tokenizer, or False
        for name, path in (adapters or {}).items():
            self.register_adapter(name, path)
        self.pool.reserve(self.pool.adapters)  # slot buffers at these adapters' ranks before the graphs are captured
        self.blocks = BlockManager(config.num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        self.scheduler = Scheduler(self.pool, self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, patience=config.patience,
                                   max_prefill_tokens=config.max_prefill_tokens)
        settings = dict(num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                        max_seq_len=config.max_seq_len, cuda_graphs=config.cuda_graphs, compile=config.compile,
                        graph_sizes=config.graph_sizes, graph_token_sizes=config.graph_token_sizes,
                        max_num_batched_tokens=config.max_num_batched_tokens)
        mirror = None
        if self._workers is not None:  # every rank builds its runner (and captures its graphs) at once
            mirror = self._workers.mirror_runner(settings)
        self.runner = ModelRunner(model, self.handle, **settings, mirror=mirror)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.grammars = Grammars(self.eos_token_id, config.max_grammar_bytes, config.max_grammar_seconds)
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._flight: _Flight | None = None  # the step queued on the device, not yet resolved (async scheduling)
        self._ids = itertools.count()
        # False: outputs carry token ids only (no text, stop strings not looked for): the engine core process, whose
        # client detokenizes in the server process.
        self.detokenize = True
        logger.info("%d KV blocks of %d tokens (%.2f GiB), max %d sequences of %d tokens", config.num_blocks,
                    config.block_size, self.runner.kv_bytes / 2**30, config.max_num_seqs, config.max_seq_len)

    def _start_workers(self, factory, config: EngineConfig, device: str | None) -> nn.Module:
        n = config.tensor_parallel_size
        if isinstance(factory, nn.Module) or not callable(factory):
            raise ValueError(f"tensor_parallel_size={n} needs a picklable function that builds the model, not a "
                             f"{type(factory).__name__}: each of the {n} processes builds the full model with it and "
                             f"keeps its shard (e.g. functools.partial(lorakit.parallel.load_sharded, path))")
        # The engine's one import of lorakit.parallel (the package above it), made only when it starts workers.
        from lorakit.parallel.executor import Executor, model_device

        workers = Executor(factory, n, model_device(device))
        self._workers = workers
        self._finalize = weakref.finalize(self, workers.close)
        workers.call("rank", "patch", config)  # every worker patches its shard as rank 0 is about to
        return workers.model

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do at tensor_parallel_size 1). The engine cannot
        step afterwards."""
        if self._workers is not None:
            self._finalize()

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    # Requests.

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None, grammar: Grammar | None = None) -> str:
        """Queue a request; returns its id. Bad requests raise ValueError (or AdapterError) and change nothing.

        ``grammar``: the request's structured output compiled already (``self.grammar(...)``, off this thread); a
        request with structured output and no grammar (or one compiled for another tokenizer) is compiled here
        first, this thread waiting (within the grammar budget)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if adapter is not None and adapter not in self.pool.adapters:
            raise AdapterError(f"unknown adapter {adapter!r}; registered: {sorted(self.pool.adapters) or 'none'}")
        prompt_ids = self.prompt_ids(prompt, adapter)
        constraint = self._check_logits_params(params, adapter, grammar)
        limited = fit_params(params, len(prompt_ids), self.max_seq_len)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, prompt_ids, adapter, limited.max_tokens, self.scheduler.next_seq(),
                          params=limited, seed=seed, lora_start=self._lora_start(prompt_ids, adapter))
        tokenizer = self.tokenizer_for(adapter) if self.detokenize else None
        detok = IncrementalDetokenizer(tokenizer or _NO_TEXT, prompt_ids, limited, self.eos_token_id)
        request.state = _State(detok, [] if params.logprobs is not None else None, constraint,
                               sync=constraint is not None or params.penalized or bool(params.logit_bias))
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _lora_start(self, prompt_ids: list[int], adapter: str | None) -> int:
        """The first position an activated LoRA applies to: where its invocation last starts in the prompt, or
        ``NOT_INVOKED`` (never: PEFT runs the base model throughout) when the prompt lacks it; 0 for other adapters."""
        invocation = self.pool.info(adapter).invocation_tokens if adapter is not None else None
        if invocation is None:
            return 0
        start = activation_start(prompt_ids, invocation)
        return NOT_INVOKED if start is None else start

    def _check_logits_params(self, params: SamplingParams, adapter: str | None, grammar: Grammar | None
                             ) -> Constraint | None:
        """Checks logit_bias ids against the request's vocabulary; the request's structured-output constraint, a
        copy of ``grammar``'s matcher (compiled here first when it is None or for another tokenizer)."""
        added = self.pool.info(adapter).added_tokens if adapter is not None else frozenset()
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size and t not in added]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.structured_output is None:
            return None
        if grammar is None or grammar.tokenizer is not self.tokenizer_for(adapter):
            grammar = self.grammar(params.structured_output, adapter).wait()
        return grammar.constraint()

    def grammar(self, spec: StructuredOutput, adapter: str | None = None) -> Pending:
        """``spec`` compiled for ``adapter``'s tokenizer, on a worker thread (see ``Grammars.compile``): returns at
        once, safe from any thread; ValueError if the engine has no tokenizer."""
        tokenizer = self.tokenizer_for(adapter)
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; give the engine one")
        return self.grammars.compile(spec, tokenizer, self.vocab_size)

    def tokenizer_for(self, adapter: str | None):
        """The tokenizer of an adapter whose folder carries one (it may add tokens), else the engine's: a lookup,
        safe from any thread (``read_adapter`` reads an adapter's tokenizer when it is registered)."""
        if adapter is None:
            return self.tokenizer
        snapshot = self.pool.snapshot(adapter)
        if snapshot is None:
            return self.tokenizer
        tokenizer = self._tokenizers.get(snapshot)
        if tokenizer is None:  # registered on the pool directly: read it now
            tokenizer = self._tokenizers[snapshot] = read_tokenizer(adapter, snapshot.info.path)
        return tokenizer or self.tokenizer

    def prompt_ids(self, prompt: str | Sequence[int], adapter: str | None = None) -> list[int]:
        """The prompt's token ids (text: by the adapter's tokenizer where its folder has one), checked by
        ``check_prompt``."""
        added = self.pool.info(adapter).added_tokens if adapter is not None else frozenset()
        return check_prompt(prompt, self.tokenizer_for(adapter), self.vocab_size, added, self.max_seq_len, adapter)

    def abort(self, request_id: str) -> None:
        """Stop a request; its last output (finish_reason 'abort') comes with the next step."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return
        self.scheduler.abort(request)
        self._aborted.append(RequestOutput(request.request_id, "", [], True, "abort",
                                           num_prompt_tokens=len(request.prompt_ids),
                                           num_output_tokens=len(request.output_ids)))

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted)  # a step in flight with no request left is not work

    # Steps.

    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, sample, and return what each request gained. A request whose part of the
        step fails ends alone (finish_reason "error"); the step runs again without it (see ``_isolate``). A
        ``FatalEngineError`` (a tensor-parallel worker gone, say) is raised as it is: the engine cannot step any more.

        With ``async_scheduling`` the step is queued on the device and this call returns what the step before it
        gained: the host schedules and queues step N + 1 while the device runs step N, whose sampled tokens reach
        step N + 1's inputs on the device (``PLACEHOLDER`` in the host's lists until then). A request that finished
        at step N may have run in step N + 1 too; that token is dropped. Requests with structured output, penalties
        or a logit bias need their previous token on the host before the next step: while any runs, steps are
        synchronous."""
        outputs, self._aborted = self._aborted, []
        overlap = self.config.async_scheduling and not any(r.state.sync for r in self._requests.values())
        if not overlap:
            outputs += self._resolve()
        plan = self.scheduler.schedule()
        for request, reason in self.scheduler.failed:  # its adapter could not be loaded: only it ends
            outputs.append(self._fail(request, reason))
        self.scheduler.failed.clear()
        if not plan.items:
            return outputs + self._resolve()
        if overlap:
            try:
                flight = self._launch(plan)
            except Exception as e:  # noqa: BLE001 - only the requests that cause it fail
                plan, result = self._isolate(plan, e, outputs)
                outputs += self._resolve()
                return outputs + self._commit(plan, result)
            self.scheduler.postprocess(plan, {r: PLACEHOLDER for r in flight.requests}, {}, pending=True)
            flight.rows = {r: (row, len(r.output_ids) - 1) for row, r in enumerate(flight.requests)}
            outputs += self._resolve()
            self._flight = flight
            return outputs
        try:
            result = self._compute(plan)
        except Exception as e:  # noqa: BLE001 - only the requests that cause it fail
            plan, result = self._isolate(plan, e, outputs)
        return outputs + self._commit(plan, result)

    def _launch(self, plan: StepPlan) -> _Flight:
        """The step's device work, queued: the forward (its placeholder inputs filled from the step in flight), the
        structured-output masks, sampling, and the copy of the sampled tokens to the host. No host sync; it changes
        no request's state (its KV writes are of the plan's own positions), so it can run again."""
        logits = self.runner.execute(plan, self._fill(plan))
        requests = [item.request for item in plan.items if item.sample]
        if not requests:  # only prompt chunks that do not end a prompt
            return _Flight([], None, (), None)
        constraints = [r.state.constraint for r in requests]
        constrained = any(c is not None for c in constraints)
        mask = self.grammars.masks(constraints, logits.shape[-1], logits.is_cuda) if constrained else None  # the
        # forward is still running on the device while the host fills the masks
        batch = SamplingBatch.build([r.params for r in requests], [r.seed for r in requests],
                                    [len(r.output_ids) for r in requests], logits.device,
                                    histories=[(r.prompt_ids, r.output_ids) for r in requests],
                                    vocab_size=logits.shape[-1], token_mask=mask)
        result = sample(logits.float(), batch)
        cuda = logits.is_cuda
        host = tuple(None if t is None else t.to("cpu", non_blocking=cuda)
                     for t in (result.token_ids, result.logprobs, result.top_ids, result.top_logprobs))
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return _Flight(requests, result.token_ids, host, done)

    def _fill(self, plan: StepPlan):
        """Where the plan's inputs hold PLACEHOLDERs of the step in flight: their token positions in the step and the
        flight's rows that sample them (None when there are none)."""
        flight = self._flight
        if flight is None or not flight.rows:
            return None
        index, rows, offset = [], [], 0
        for item in plan.items:
            found = flight.rows.get(item.request)
            if found is not None:
                position = len(item.request.prompt_ids) + found[1]  # the placeholder's position in the sequence
                if item.start <= position < item.start + len(item.tokens):
                    index.append(offset + position - item.start)
                    rows.append(found[0])
            offset += len(item.tokens)
        if not index:
            return None
        device = flight.tokens.device
        both = torch.tensor([index, rows], dtype=torch.int64, pin_memory=device.type == "cuda")
        both = both.to(device, non_blocking=True)
        return Fill(both[0], both[1], flight.tokens, (index, rows))

    def _collect(self, flight: _Flight) -> _Sampled | None:
        """The flight's sampled tokens on the host: the one host sync of a step."""
        if not flight.requests:
            return None
        if flight.done is not None:
            flight.done.synchronize()
        lists = (t.tolist() if t is not None else None for t in flight.host)
        return _Sampled(flight.requests, *lists)

    def _compute(self, plan: StepPlan) -> _Sampled | None:
        """The step's device work and its host sync (``_launch``, then ``_collect``)."""
        return self._collect(self._launch(plan))

    def _resolve(self) -> list[RequestOutput]:
        """The step in flight, finished: each request's token in place of its placeholder, then its grammar, text,
        logprobs and finish, as ``_commit`` does for a synchronous step. Requests that ended meanwhile (aborted,
        failed) are skipped."""
        flight, self._flight = self._flight, None
        result = None if flight is None else self._collect(flight)
        if result is None:
            return []
        outputs = []
        for row, request in enumerate(result.requests):
            if self._requests.get(request.request_id) is not request:
                continue
            token, index = result.token_ids[row], flight.rows[request][1]
            request.output_ids[index] = token
            request.num_pending -= 1
            try:
                out = self._advance(request, token, row, result, index + 1)
            except Exception as e:  # noqa: BLE001 - this request alone ends
                logger.exception("request %s failed after its step", request.request_id)
                out = self._fail(request, f"{type(e).__name__}: {e}")
            if out.finished:  # running, or preempted by the step after it: wherever it is, it ends
                request.finish_reason = out.finish_reason
                self.scheduler.abort(request)
                self._requests.pop(request.request_id, None)
            outputs.append(out)
        return outputs

    def _isolate(self, plan: StepPlan, error: Exception, outputs: list[RequestOutput]):
        """The step failed: run each request's part alone to find those that fail, end them (finish_reason "error"),
        and run the step again without them, so everyone else continues as if they had never come. When no request
        fails alone, the failure is not a request's: it is raised. A ``FatalEngineError`` is raised at once, from the
        step or from any of the runs alone: it is no request's."""
        if isinstance(error, FatalEngineError):
            raise error
        logger.warning("a step of %d requests failed (%s: %s); looking for the request that causes it",
                       len(plan.items), type(error).__name__, error)
        culprits = {}
        for item in plan.items:
            try:
                self._compute(StepPlan([item], []))
            except FatalEngineError:
                raise
            except Exception as e:  # noqa: BLE001 - the request's own failure, reported to it
                culprits[item.request] = e
        if not culprits:
            raise error
        for request, e in culprits.items():
            self.scheduler.abort(request)
            outputs.append(self._fail(request, f"this request failed inside an engine step ({type(e).__name__}: "
                                               f"{e}); the other requests continued"))
        plan = StepPlan([item for item in plan.items if item.request not in culprits], plan.preempted)
        return plan, self._compute(plan) if plan.items else None

    def _commit(self, plan: StepPlan, result: _Sampled | None) -> list[RequestOutput]:
        """Each request's new token: its grammar, text, logprobs and finish; the scheduler's bookkeeping."""
        outputs, sampled, finished = [], {}, {}
        for row, request in enumerate(result.requests if result is not None else []):
            token = result.token_ids[row]
            sampled[request] = token
            try:
                out = self._advance(request, token, row, result)
            except Exception as e:  # noqa: BLE001 - this request alone ends
                logger.exception("request %s failed after its step", request.request_id)
                out = self._fail(request, f"{type(e).__name__}: {e}")
            if out.finished:
                finished[request] = out.finish_reason
                self._requests.pop(request.request_id, None)
            outputs.append(out)
        self.scheduler.postprocess(plan, sampled, finished)
        return outputs

    def _advance(self, request: Request, token: int, row: int, result: _Sampled, count: int | None = None
                 ) -> RequestOutput:
        """One request's new token (its ``count``-th; default: the one after its output_ids) through its grammar,
        detokenizer and logprobs."""
        state = request.state
        if state.constraint is not None:
            state.constraint.advance(token)
            if state.constraint.error is not None:  # this request alone ends
                return self._fail(request, state.constraint.error)
        delta, reason = state.detok.append(token)
        logprobs = None
        if state.logprobs is not None:
            k = request.params.logprobs
            top = {} if not k else dict(zip(result.top_ids[row][:k], result.top_logprobs[row][:k]))
            logprobs = [TokenLogprob(token, result.logprobs[row], top)]
            state.logprobs += logprobs
        return RequestOutput(request.request_id, delta, [token], reason is not None, reason, logprobs,
                             len(request.prompt_ids), count or len(request.output_ids) + 1,
                             num_cached_tokens=request.num_cached or 0)

    def _fail(self, request: Request, reason: str) -> RequestOutput:
        """The last output of a request that ends with an error (it alone)."""
        logger.warning("request %s failed: %s", request.request_id, reason)
        self._requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, "", [], True, "error", error=reason,
                             num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids))

    # Adapters at run time (the server's load/unload endpoints).

    def register_adapter(self, name: str, path: str | Path) -> int:
        """Register (or hot-swap) an adapter, with the tokenizer its folder carries if any: ``install_adapter(
        read_adapter(name, path))``. Returns its version number."""
        return self.install_adapter(self.read_adapter(name, path))

    def read_adapter(self, name: str, path: str | Path, roots: Sequence[str | Path] | None = None) -> CheckedAdapter:
        """Read an adapter folder once and check it in full: the pool's snapshot of its config and weights
        (``AdapterPool.read``), and its tokenizer (``read_tokenizer``), every file inside ``roots`` when given. Changes
        nothing and touches only what never changes, so any thread may call it (the server reads off the engine
        thread). Raises AdapterError (ValueError for a bad name)."""
        snapshot = self.pool.read(name, path, roots)
        return CheckedAdapter(snapshot, read_tokenizer(name, snapshot.info.path, roots))

    def install_adapter(self, checked: CheckedAdapter) -> int:
        """Make a checked adapter the current version of its name (cheap: reads nothing); its version number."""
        snapshot = checked.snapshot
        self._tokenizers[snapshot] = checked.tokenizer  # first: the new version is never found without it
        try:
            version = self.pool.install(snapshot)
        except BaseException:
            self._tokenizers.pop(snapshot, None)
            raise
        self._forget_tokenizers(snapshot.name)
        return version

    def _forget_tokenizers(self, name: str) -> None:
        """Drop the tokenizers of ``name``'s versions but the current one (running requests keep theirs: their
        detokenizer holds it)."""
        current = self.pool.snapshot(name)
        for snapshot in [s for s in list(self._tokenizers) if s.name == name and s is not current]:
            self._tokenizers.pop(snapshot, None)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter: running requests finish on it; waiting ones end now with an error their client sees
        (finish_reason "error", not an empty "abort")."""
        self.pool.unregister(name)
        self._forget_tokenizers(name)
        self.scheduler.prefix_stats.pop(name, None)
        for request in [r for r in self.scheduler.waiting if r.adapter == name]:
            self.scheduler.abort(request)
            self._aborted.append(self._fail(request, f"adapter {name!r} was unloaded before this request could run "
                                                     f"on it; send it again with a model that is loaded"))


def check_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int, added: frozenset[int], max_seq_len: int,
                 adapter: str | None = None) -> list[int]:
    """A prompt's token ids (text: by ``tokenizer``), checked: not empty, in the vocabulary (``vocab_size`` plus the
    ``added`` tokens of ``adapter``), leaving room under ``max_seq_len``; ValueError naming the problem."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt must be a string or a list of int token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size and t not in added]
    if bad:
        whose = f" and the {len(added)} tokens adapter {adapter!r} adds" if added else ""
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}){whose}; "
                         f"a token another adapter adds is not in this request's vocabulary")
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; at most {max_seq_len - 1} fit "
                         f"(max_seq_len={max_seq_len}); shorten it")
    return ids


def fit_params(params: SamplingParams, prompt_len: int, max_seq_len: int) -> SamplingParams:
    """``params`` with max_tokens (and min_tokens) cut to what fits in the context after the prompt."""
    max_tokens = min(params.max_tokens, max_seq_len - prompt_len)
    if max_tokens == params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))


def _patched(model: nn.Module, config: EngineConfig) -> LoraHandle:
    """The model's handle: patched now with the config's layout, or already patched with the same one."""
    handle = getattr(model, "_lorakit_handle", None)
    if handle is None:
        return patch(model, config.max_loras, max_rank=config.max_rank)
    if not isinstance(handle, LoraHandle):
        raise TypeError("the model's lorakit handle is not a LoraHandle")
    have = (handle.config.max_loras, handle.config.max_rank)
    if have != (config.max_loras, config.max_rank):
        raise ValueError(f"the model is already patched with max_loras={have[0]}, max_rank={have[1]}, but the engine "
                         f"config asks for max_loras={config.max_loras}, max_rank={config.max_rank}; give the engine "
                         f"the values the model was patched with, or an unpatched model")
    return handle


def _resolve(config: EngineConfig, model: nn.Module, text_config, device: torch.device) -> EngineConfig:
    """The config with max_seq_len and num_blocks resolved from the model and the device, checked against them."""
    limit = getattr(text_config, "max_position_embeddings", None) or 4096
    max_seq_len = min(limit, 4096) if config.max_seq_len is None else config.max_seq_len
    if max_seq_len > limit:
        raise ValueError(f"max_seq_len must be in [2, {limit}] (the model's max_position_embeddings), "
                         f"got {max_seq_len}")
    block_size = config.block_size
    blocks_per_seq = cdiv(max_seq_len, block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        layers, kv_heads, head_dim = kv_shape(model)
        per_block = 2 * layers * block_size * kv_heads * head_dim * next(model.parameters()).element_size()
        if device.type == "cuda":
            budget = int(0.5 * torch.cuda.mem_get_info(device)[0])
        else:
            budget = 2 << 30  # CPU memory: a serving default that fits a laptop
        num_blocks = max(min(config.max_num_seqs * blocks_per_seq, budget // per_block), blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_seq_len={max_seq_len} "
                         f"({blocks_per_seq} blocks of {block_size}); raise num_blocks or lower max_seq_len")
    return dataclasses.replace(config, max_seq_len=max_seq_len, num_blocks=num_blocks)


class AsyncEngine:
    """Runs an Engine on a background thread and streams each request's outputs to asyncio code.

    Only the engine thread touches the engine. Callers post commands (add a request, abort one, register an
    adapter) to an inbox the thread drains between steps, and await their results as futures, so the event
    loop never blocks on a step. Each step's outputs reach each event loop in one wake-up.

    A ``FatalEngineError`` from a step (a tensor-parallel worker gone) ends the thread: every waiting stream and
    call gets ``EngineDead``, so does everything asked afterwards, ``dead`` says why, and ``on_death`` is called
    once, from the engine thread.
    """

    def __init__(self, engine: Engine, on_death: Callable[[], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self.dead: str | None = None  # why the engine cannot step any more, once it cannot
        self._cond = threading.Condition()
        self._inbox: list[tuple[Callable, tuple, concurrent.futures.Future | None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.steps = 0            # engine steps run
        self.step_seconds = 0.0   # wall time spent inside them (the rest of the thread's time is idle)
        self._thread = threading.Thread(target=self._run, name="lorakit-engine", daemon=True)
        self._thread.start()

    def _post(self, fn: Callable, *args, wait: bool = True) -> concurrent.futures.Future | None:
        future = concurrent.futures.Future() if wait else None
        with self._cond:
            if self.dead is not None and wait:
                raise EngineDead(self.dead)
            if self._stopping and wait:
                raise RuntimeError("the engine is shutting down")
            self._inbox.append((fn, args, future))
            self._cond.notify()
        return future

    async def generate(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; leaving early (a client gone) aborts it. A bad request
        raises here, before anything is yielded. Its grammar, if any, is compiled on a worker thread while this
        coroutine waits (``Engine.grammar``): never on the engine thread."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        grammar = None
        if params is not None and params.structured_output is not None:  # compiled first, off the engine thread
            grammar = await self.engine.grammar(params.structured_output, adapter).wait_async()

        def add():
            rid = self.engine.add_request(prompt, params, adapter, request_id, grammar)
            self._streams[rid] = (loop, queue)
            return rid

        request_id = await asyncio.wrap_future(self._post(add))
        async with contextlib.aclosing(drain(queue, lambda: self.abort(request_id))) as outs:  # closed (and aborted
            async for out in outs:  # if unfinished) as soon as this generator is
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread; does not wait)."""
        def abort():
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
        self._post(abort, wait=False)

    async def call(self, fn: Callable, *args):
        """Run fn(*args) on the engine thread between steps (e.g. engine.register_adapter); its result."""
        return await asyncio.wrap_future(self._post(fn, *args))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``timeout`` seconds), then stop; the rest get an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            stuck = self._thread.is_alive()
            pending, self._inbox = self._inbox, []
        for *_, future in pending:
            if future is not None:
                future.set_exception(RuntimeError("the engine is shutting down"))
        if not stuck:
            for request_id in list(self.engine._requests):
                self.engine.abort(request_id)
        self._fail_all(RuntimeError("the engine shut down before this request finished"))

    def end_requests(self, reason: str) -> None:
        """End every request in flight now (from any thread): each stream gets a last output, finish_reason "abort"
        with ``reason`` as its error, and the engine drops them between steps."""
        streams, self._streams = self._streams, {}
        for request_id, (loop, queue) in streams.items():
            loop.call_soon_threadsafe(queue.put_nowait, RequestOutput(request_id, "", [], True, "abort", error=reason))

        def abort():
            for request_id in streams:
                self.engine.abort(request_id)
        if streams:
            self._post(abort, wait=False)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for loop, queue in streams.values():
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def _die(self, error: FatalEngineError) -> None:
        """The engine cannot step any more: everything waiting fails with ``EngineDead``, and so will everything
        asked from now on."""
        logger.error("the engine cannot step any more (%s: %s); failing %d requests in flight", type(error).__name__,
                     error, len(self._streams))
        with self._cond:
            self.dead = f"the engine failed and cannot run any more steps ({type(error).__name__}: {error})"
            pending, self._inbox = self._inbox, []
        dead = EngineDead(f"{self.dead}; the server restarts, send the request again")
        for *_, future in pending:
            if future is not None:
                future.set_exception(dead)
        self._fail_all(dead)
        if self.on_death is not None:
            self.on_death()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not engine.has_unfinished():
                    if self._stopping:
                        return
                    self._cond.wait()
                if self._stopping and not engine.has_unfinished() and all(f is None for *_, f in self._inbox):
                    return
                commands, self._inbox = self._inbox, []
            for fn, args, future in commands:
                try:
                    result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    if future is not None:
                        future.set_exception(e)
                else:
                    if future is not None:
                        future.set_result(result)
            if not engine.has_unfinished():
                continue
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except FatalEngineError as e:
                self._die(e)
                return
            except Exception as e:  # noqa: BLE001 - every waiting stream gets it
                logger.exception("a step failed")
                for request_id in list(engine._requests):
                    engine.abort(request_id)
                engine._aborted.clear()
                self._fail_all(e)
                continue
            self.steps += 1
            self.step_seconds += time.perf_counter() - start
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    batches.setdefault(stream[0], []).append((stream[1], out))
                    if out.finished:
                        del self._streams[out.request_id]
            for loop, items in batches.items():
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class LLM:
    """Offline generation with adapters: a model (a path or a loaded transformers model) and a tokenizer."""

    def __init__(self, model: str | Path | nn.Module, tokenizer=None, config: EngineConfig | None = None, *,
                 adapters: dict[str, str | Path] | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, **options):
        """``config`` / ``options``: the engine's settings, as ``Engine`` takes them."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, (str, Path)):
            import transformers

            dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(model)
            model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
        self.engine = Engine(model, tokenizer, config, adapters=adapters, **options)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | None | Sequence[str | None] = None) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order. ``adapters``: one name (or None) per prompt, or one for all."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * n
        names = adapters if isinstance(adapters, Sequence) and not isinstance(adapters, str) else [adapters] * n
        if len(params) != n or len(names) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(names)} adapters")
        engine = self.engine
        ids = []
        try:
            for prompt, p, name in zip(prompts, params, names):
                ids.append(engine.add_request(prompt, p, name))
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            engine.step()
            raise
        results = {request_id: CompletionOutput(request_id, name, engine._requests[request_id].prompt_ids, "", [],
                                                None) for request_id, name in zip(ids, names)}
        while any(r.finish_reason is None for r in results.values()):
            for out in engine.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.text += out.text
                result.token_ids += out.token_ids
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
        return [results[request_id] for request_id in ids]
