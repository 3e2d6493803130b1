"""The engine: requests in, tokens out, many adapters in every batch.

``Engine`` holds the patched model, the adapter pool, the scheduler and the runner. ``add_request`` queues a
prompt for an adapter (or the base model); each ``step()`` schedules a batch, runs it, samples one token
per finishing position on the device, and returns what each request gained (``RequestOutput``).
``lorakit.engine.loop`` drives the steps wherever the engine lives (a thread, the engine core process). The model
is prepared by ``engine.build``; ``engine.llm.LLM`` is the offline front door.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lorakit.engine.checks import check_logit_bias, check_prompt, lora_start
from lorakit.engine.build import build_runner, eos_token_id, load_model, patch_model, start_workers
from lorakit.engine.config import EngineConfig
from lorakit.engine.errors import FatalEngineError
from lorakit.engine.lengths import fit_params
from lorakit.engine.outputs import FinishReason, RequestOutput, TokenLogprob, stop_token_ids, token_finish
from lorakit.adapters.pool import AdapterPool, AdapterRef
from lorakit.engine.prompt_logprobs import score_prompts
from lorakit.engine.runner import Fill
from lorakit.engine.sampling import SamplingBatch, SamplingParams, sample
from lorakit.engine.scheduler import BlockManager, Request, Scheduler, StepPlan
from lorakit.engine.registry import AdapterRegistry
from lorakit.engine.stats import EngineStats, collect
from lorakit.engine.structured import Constraint, Grammar, Grammars, Pending, StructuredOutput

logger = logging.getLogger("lorakit.engine")

__all__ = ["Engine"]


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
    stop_ids: frozenset[int]  # the tokens that end it (its stop_token_ids, the model's eos)
    logprobs: list[TokenLogprob] | None = field(default=None)
    constraint: Constraint | None = None  # structured output: the tokens allowed next
    sync: bool = False  # its next step needs its last token on the host (grammar, penalties, logit bias)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs: one per prompt token


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
        self._workers = None  # the tensor-parallel executor, with tensor_parallel_size > 1
        if config.tensor_parallel_size > 1:
            self._workers, config = start_workers(model, config, device)
            self._finalize = weakref.finalize(self, self._workers.close)
            model = self._workers.model
        else:
            model, config = load_model(model, config, device)
        try:
            self._build(model, tokenizer, config, adapters)
        except BaseException:
            self.close()  # the other ranks, if any
            raise

    def _build(self, model: nn.Module, tokenizer, config: EngineConfig, adapters) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.handle, config, self.vocab_size = patch_model(model, config, self._workers)
        self.config = config
        manager = self.handle.slots.manager
        self.pool = manager if isinstance(manager, AdapterPool) else AdapterPool(
            self.handle, cpu_budget_bytes=config.cpu_budget_bytes, strict=config.lora_strict,
            max_versions=config.max_versions_per_adapter)
        self.registry = AdapterRegistry(self.pool, tokenizer)
        for name, path in (adapters or {}).items():
            self.registry.register(name, path)
        self.pool.reserve(self.pool.adapters)  # slot buffers at these adapters' ranks before the graphs are captured
        self.blocks = BlockManager(config.num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        self.scheduler = Scheduler(self.pool, self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, patience=config.patience,
                                   max_prefill_tokens=config.max_prefill_tokens)
        self.runner = build_runner(model, self.handle, config, self._workers)
        self.eos_token_id = eos_token_id(model, tokenizer)
        self.grammars = Grammars(self.eos_token_id, config.max_grammar_bytes, config.max_grammar_seconds,
                                 config.max_grammar_queue)
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._flight: _Flight | None = None  # the step queued on the device, not yet resolved (async scheduling)
        self._ids = itertools.count()
        logger.info("%d KV blocks of %d tokens (%.2f GiB), max %d sequences of %d tokens", config.num_blocks,
                    config.block_size, self.runner.kv_bytes / 2**30, config.max_num_seqs, config.max_seq_len)

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
                    adapter: AdapterRef | str | None = None, request_id: str | None = None,
                    grammar: Grammar | None = None) -> str:
        """Queue a request; returns its id. Bad requests raise ValueError (or AdapterError) and change nothing.

        ``adapter``: the version a server resolved the request's model to (``AdapterRef``: it must still live), or a
        registered name (its current version), or None for the base model; the request runs on that version to its
        last token, whatever replaces it meanwhile. ``grammar``: the
        request's structured output compiled already (``self.grammar(...)``, off this thread); a request with
        structured output and no grammar (or one compiled for another tokenizer) is compiled here first, this thread
        waiting (within the grammar budget)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The one lookup of its adapter: the version it runs on to its end, held by this claim (the scheduler
        # gives it back when the request leaves).
        ref, snapshot = (None, None) if adapter is None else self.pool.claim(adapter)
        try:
            request = self._request(request_id, prompt, params, grammar, ref, snapshot)
        except BaseException:
            if ref is not None:
                self.pool.unclaim(ref)
            raise
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _request(self, request_id: str, prompt, params: SamplingParams, grammar: Grammar | None,
                 ref: AdapterRef | None, snapshot) -> Request:
        """The checked request for ``add_request`` (ValueError or AdapterError for a bad one)."""
        name = None if ref is None else ref.name
        info = None if snapshot is None else snapshot.info
        tokenizer = self.registry.tokenizer_of(snapshot)
        added = frozenset() if info is None else info.added_tokens
        prompt_ids = check_prompt(prompt, tokenizer, self.vocab_size, added, self.max_seq_len, name)
        constraint = self._check_logits_params(params, added, tokenizer, grammar, name)
        limited = fit_params(params, len(prompt_ids), self.max_seq_len)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, prompt_ids, ref, limited.max_tokens, self.scheduler.next_seq(),
                          params=limited, seed=seed, lora_start=lora_start(prompt_ids, info), claimed=ref is not None)
        prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(prompt_ids)
        request.state = _State(stop_token_ids(limited, self.eos_token_id),
                               [] if params.logprobs is not None else None, constraint,
                               sync=constraint is not None or params.penalized or bool(params.logit_bias)
                               or prompt_logprobs is not None, prompt_logprobs=prompt_logprobs)
        return request

    def _check_logits_params(self, params: SamplingParams, added: frozenset[int], tokenizer, grammar: Grammar | None,
                             adapter: str | None) -> Constraint | None:
        """Checks logit_bias ids against the request's vocabulary; the request's structured-output constraint, a
        copy of ``grammar``'s matcher (compiled here first when it is None or for another tokenizer)."""
        check_logit_bias(params, self.vocab_size, added)
        if params.structured_output is None:
            return None
        if grammar is None or grammar.tokenizer is not tokenizer:
            grammar = self.grammar(params.structured_output, adapter).wait()
        return grammar.constraint()

    def grammar(self, spec: StructuredOutput, adapter: AdapterRef | str | None = None, client: str | None = None
                ) -> Pending:
        """``spec`` compiled for ``adapter``'s tokenizer, on a worker thread (see ``Grammars.compile``): returns at
        once, safe from any thread, in ``client``'s turn; ValueError if the engine has no tokenizer."""
        tokenizer = self.registry.tokenizer_for(adapter)
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; give the engine one")
        return self.grammars.compile(spec, tokenizer, self.vocab_size, client)

    def prompt_ids(self, prompt: str | Sequence[int], adapter: AdapterRef | str | None = None) -> list[int]:
        """The prompt's token ids (text: by the adapter's tokenizer where its folder has one), checked by
        ``check_prompt``."""
        snapshot = None if adapter is None else self.pool.resolve(adapter)
        added = frozenset() if snapshot is None else snapshot.info.added_tokens
        return check_prompt(prompt, self.registry.tokenizer_of(snapshot), self.vocab_size, added, self.max_seq_len,
                            None if snapshot is None else snapshot.name)

    def abort(self, request_id: str) -> None:
        """Stop a request; its last output (finish_reason 'abort') comes with the next step."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return
        self.scheduler.abort(request)
        self._aborted.append(RequestOutput.ended(request.request_id, FinishReason.ABORT,
                                                 num_prompt_tokens=len(request.prompt_ids),
                                                 num_output_tokens=len(request.output_ids)))

    def abort_all(self) -> None:
        """Abort every request (a shutdown's end); their last outputs come with the next step."""
        for request_id in list(self._requests):
            self.abort(request_id)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """End every request now with ``reason`` (a step failed and no request was found to cause it): their last
        outputs, finish_reason "abort" (the server's fault, not theirs), returned here rather than by a step."""
        outputs = [RequestOutput.ended(r.request_id, FinishReason.ABORT, num_prompt_tokens=len(r.prompt_ids),
                                       num_output_tokens=len(r.output_ids), error=reason)
                   for r in self._requests.values()]
        for request in list(self._requests.values()):
            self.scheduler.abort(request)
        self._requests.clear()
        self._aborted.clear()
        self._flight = None
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted)  # a step in flight with no request left is not work

    def admitted(self, request_id: str) -> tuple[list[int], SamplingParams]:
        """An unfinished request's prompt token ids and its params as admitted (max_tokens cut to fit the context):
        what its output processor needs. KeyError once it has ended."""
        request = self._requests[str(request_id)]
        return request.prompt_ids, request.params

    def stats(self) -> EngineStats:
        """The engine's gauges and counters now (its step counters are the loop's: 0 here); safe from any thread."""
        return collect(self.pool, self.scheduler, self.blocks, self.runner, self.config.max_loras)

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
        if any(item.all_logits for item in plan.items):
            logits = score_prompts(plan, logits)
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
        """The step in flight, finished: each request's token in place of its placeholder, then through
        ``_advance``, as ``_commit`` does for a synchronous step. Requests that ended meanwhile (aborted, failed) are
        skipped."""
        flight, self._flight = self._flight, None
        result = None if flight is None else self._collect(flight)
        if result is None:
            return []
        rows = []
        for row, request in enumerate(result.requests):
            if self._requests.get(request.request_id) is request:
                index = flight.rows[request][1]
                self.scheduler.resolve(request, index, result.token_ids[row])
                rows.append((row, request, index + 1))
        return self._advance_all(rows, result)

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
        """A synchronous step's tokens appended (the scheduler's bookkeeping), then each through ``_advance``."""
        sampled = {} if result is None else dict(zip(result.requests, result.token_ids))
        self.scheduler.postprocess(plan, sampled)
        return self._advance_all([(row, r, len(r.output_ids)) for row, r in enumerate(sampled)], result)

    def _advance_all(self, rows: list[tuple[int, Request, int]], result: _Sampled) -> list[RequestOutput]:
        """Each (row, request, count) of a step: the request's ``count``-th output token, in its output_ids already,
        through ``_advance``; a request that finishes is retired (one request's failure here ends it alone)."""
        outputs = []
        for row, request, count in rows:
            try:
                out = self._advance(request, row, result, count)
            except Exception as e:  # noqa: BLE001 - this request alone ends
                logger.exception("request %s failed after its step", request.request_id)
                out = self._fail(request, f"{type(e).__name__}: {e}")
            if out.finished:
                self.scheduler.finish(request, out.finish_reason)
                self._requests.pop(request.request_id, None)
            outputs.append(out)
        return outputs

    def _advance(self, request: Request, row: int, result: _Sampled, count: int) -> RequestOutput:
        """A request's ``count``-th output token (row ``row`` of the step's result) through its grammar, its finish
        by token and its logprobs."""
        token, state = result.token_ids[row], request.state
        if state.constraint is not None:
            state.constraint.advance(token)
            if state.constraint.error is not None:  # this request alone ends
                return self._fail(request, state.constraint.error)
        reason = token_finish(request.params, state.stop_ids, count, token)
        logprobs = None
        if state.logprobs is not None:
            k = request.params.logprobs
            top = {} if not k else dict(zip(result.top_ids[row][:k], result.top_logprobs[row][:k]))
            logprobs = [TokenLogprob(token, result.logprobs[row], top)]
            state.logprobs += logprobs
        prompt_logprobs = list(state.prompt_logprobs) if count == 1 and state.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, "", [token], reason is not None, reason, logprobs,
                             len(request.prompt_ids), count, num_cached_tokens=request.num_cached or 0,
                             prompt_logprobs=prompt_logprobs)

    def _fail(self, request: Request, reason: str) -> RequestOutput:
        """The last output of a request that ends with an error (it alone)."""
        logger.warning("request %s failed: %s", request.request_id, reason)
        self._requests.pop(request.request_id, None)
        return RequestOutput.ended(request.request_id, FinishReason.ERROR, error=reason,
                                   num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids))

    # Adapters at run time (the server's load/unload endpoints; reading and installing: ``self.registry``).

    def register_adapter(self, name: str, path: str | Path) -> int:
        """Register (or hot-swap) an adapter, with the tokenizer its folder carries if any; its version number."""
        return self.registry.register(name, path)

    def push_adapter(self, name: str, weights, config, version: int | None = None) -> int:
        """A new version of ``name`` from memory, no files: ``weights`` a PEFT state dict (as
        ``get_peft_model_state_dict`` returns it; tensors on any device) or a safetensors file's bytes, ``config`` its
        ``LoraConfig`` or config dict. Checked in full first: a push that fails leaves the previous version serving
        (AdapterError naming what is wrong). Requests admitted before it finish on the version they started with.
        Returns the new version's number: the last one plus one, or ``version`` when given (above every number the
        name has had, else ValueError)."""
        return self.registry.push(name, weights, config, version)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter: running requests finish on it; waiting ones end now with an error their client sees
        (finish_reason "error", not an empty "abort")."""
        self.registry.unregister(name)
        self.scheduler.prefix_stats.pop(name, None)
        for request in [r for r in self.scheduler.waiting if r.adapter_name == name]:
            self.scheduler.abort(request)
            self._aborted.append(self._fail(request, f"adapter {name!r} was unloaded before this request could run "
                                                     f"on it; send it again with a model that is loaded"))
