"""The engine: requests in, tokens out, many adapters in every batch.

``Engine`` owns the patched model, the adapter pool, the scheduler and the runner. ``add_request`` queues a
prompt for an adapter (or the base model); each ``step()`` schedules a batch, runs it, samples one token
per finishing position on the device, and returns what each request gained (``RequestOutput``).
``lorakit.engine.loop`` drives the steps wherever the engine lives (a thread, the engine core process); ``LLM``
is the offline front door::

    llm = LLM("path/to/model", max_loras=8, adapters={"sql": "/adapters/sql"})
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=64, temperature=0.0), adapters=["sql", None])
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lorakit.engine.config import EngineConfig
from lorakit.engine.errors import FatalEngineError
from lorakit.engine.outputs import CompletionOutput, FinishReason, OutputProcessor, RequestOutput, TokenLogprob, \
    stop_token_ids, token_finish
from lorakit.adapters.pool import AdapterPool, AdapterRef
from lorakit.engine.runner import Fill, ModelRunner, kv_shape
from lorakit.engine.sampling import SamplingBatch, SamplingParams, sample
from lorakit.engine.scheduler import BlockManager, Request, Scheduler, StepPlan
from lorakit.adapters.snapshot import Snapshot, read_tokenizer
from lorakit.engine.structured import Constraint, Grammar, Grammars, Pending, StructuredOutput
from lorakit.layers.adapter import activation_start
from lorakit.layers.handle import LoraHandle
from lorakit.layers.patch import patch, slot_bytes
from lorakit.layers.quant import QuantizedLinear, quantize, weight_bytes
from lorakit.ops import cdiv

logger = logging.getLogger("lorakit.engine")
# Request.lora_start of an activated LoRA's request whose prompt lacks the invocation: past every position, so the
# adapter never applies (its slot is held all the same).
NOT_INVOKED = sys.maxsize

__all__ = ["CheckedAdapter", "CompletionOutput", "Engine", "LLM", "RequestOutput", "check_prompt", "fit_params"]


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
        self._workers = None
        if config.tensor_parallel_size > 1:
            model, config = self._start_workers(model, config, device)
        else:
            if not isinstance(model, nn.Module):
                if not callable(model):
                    raise TypeError(f"model must be a torch.nn.Module or a function that builds one, got "
                                    f"{type(model).__name__}")
                model = model()
                model = model.to(device) if device is not None else model
            _quantized(model, config)
            config = _slot_count(model, config)
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
                        max_num_batched_tokens=config.max_num_batched_tokens, base_twins=config.base_twins,
                        fuse_siblings=config.fuse_siblings)
        mirror = None
        if self._workers is not None:  # every rank builds its runner (and captures its graphs) at once
            mirror = self._workers.mirror_runner(settings)
        self.runner = ModelRunner(model, self.handle, **settings, mirror=mirror)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.grammars = Grammars(self.eos_token_id, config.max_grammar_bytes, config.max_grammar_seconds,
                                 config.max_grammar_queue)
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._flight: _Flight | None = None  # the step queued on the device, not yet resolved (async scheduling)
        self._ids = itertools.count()
        logger.info("%d KV blocks of %d tokens (%.2f GiB), max %d sequences of %d tokens", config.num_blocks,
                    config.block_size, self.runner.kv_bytes / 2**30, config.max_num_seqs, config.max_seq_len)

    def _start_workers(self, factory, config: EngineConfig, device: str | None) -> tuple[nn.Module, EngineConfig]:
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
        if config.quantization is not None:  # every rank its shard, at once: row shards all-reduce their fp8 scales
            workers.call("rank", "quantize", config.quantization)
            _quantized(workers.model, config)
        config = _slot_count(workers.model, config)  # from rank 0's shard: every rank's slots hold a shard alike
        workers.call("rank", "patch", config)  # every worker patches its shard as rank 0 is about to
        return workers.model, config

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

        ``adapter``: the version a server resolved the request's model to (``AdapterRef``: it must still be the
        current one), or a registered name (its current version), or None for the base model. ``grammar``: the
        request's structured output compiled already (``self.grammar(...)``, off this thread); a request with
        structured output and no grammar (or one compiled for another tokenizer) is compiled here first, this thread
        waiting (within the grammar budget)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        snapshot = None if adapter is None else self.pool.resolve(adapter)  # the request's one lookup of its adapter
        name = None if snapshot is None else snapshot.name
        info = None if snapshot is None else snapshot.info
        tokenizer = self._tokenizer_of(snapshot)
        added = frozenset() if info is None else info.added_tokens
        prompt_ids = check_prompt(prompt, tokenizer, self.vocab_size, added, self.max_seq_len, name)
        constraint = self._check_logits_params(params, added, tokenizer, grammar, name)
        limited = fit_params(params, len(prompt_ids), self.max_seq_len)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        request = Request(request_id, prompt_ids, name, limited.max_tokens, self.scheduler.next_seq(),
                          params=limited, seed=seed, lora_start=_lora_start(prompt_ids, info),
                          digest=None if snapshot is None else snapshot.sha256)
        prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(prompt_ids)
        request.state = _State(stop_token_ids(limited, self.eos_token_id),
                               [] if params.logprobs is not None else None, constraint,
                               sync=constraint is not None or params.penalized or bool(params.logit_bias)
                               or prompt_logprobs is not None, prompt_logprobs=prompt_logprobs)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _check_logits_params(self, params: SamplingParams, added: frozenset[int], tokenizer, grammar: Grammar | None,
                             adapter: str | None) -> Constraint | None:
        """Checks logit_bias ids against the request's vocabulary; the request's structured-output constraint, a
        copy of ``grammar``'s matcher (compiled here first when it is None or for another tokenizer)."""
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size and t not in added]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.structured_output is None:
            return None
        if grammar is None or grammar.tokenizer is not tokenizer:
            grammar = self.grammar(params.structured_output, adapter).wait()
        return grammar.constraint()

    def grammar(self, spec: StructuredOutput, adapter: AdapterRef | str | None = None, client: str | None = None
                ) -> Pending:
        """``spec`` compiled for ``adapter``'s tokenizer, on a worker thread (see ``Grammars.compile``): returns at
        once, safe from any thread, in ``client``'s turn; ValueError if the engine has no tokenizer."""
        tokenizer = self.tokenizer_for(adapter)
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; give the engine one")
        return self.grammars.compile(spec, tokenizer, self.vocab_size, client)

    def tokenizer_for(self, adapter: AdapterRef | str | None):
        """The tokenizer of an adapter whose folder carries one (it may add tokens), else the engine's: a lookup,
        safe from any thread (``read_adapter`` reads an adapter's tokenizer when it is registered)."""
        return self._tokenizer_of(None if adapter is None else self.pool.resolve(adapter))

    def _tokenizer_of(self, snapshot: Snapshot | None):
        if snapshot is None:
            return self.tokenizer
        tokenizer = self._tokenizers.get(snapshot)
        if tokenizer is None:  # registered on the pool directly: read it now
            tokenizer = self._tokenizers[snapshot] = read_tokenizer(snapshot.name, snapshot.info.path)
        return tokenizer or self.tokenizer

    def prompt_ids(self, prompt: str | Sequence[int], adapter: AdapterRef | str | None = None) -> list[int]:
        """The prompt's token ids (text: by the adapter's tokenizer where its folder has one), checked by
        ``check_prompt``."""
        snapshot = None if adapter is None else self.pool.resolve(adapter)
        added = frozenset() if snapshot is None else snapshot.info.added_tokens
        return check_prompt(prompt, self._tokenizer_of(snapshot), self.vocab_size, added, self.max_seq_len,
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
            logits = self._prompt_logprobs(plan, logits)
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

    def _prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
        """A step with items that keep every position's logits (``all_logits``: prompts that asked for their
        logprobs): each such position's logprob of the next prompt token, its rank and the top ``prompt_logprobs``,
        written into the request's state (by position: a step that runs again writes the same); returns the rows
        that sample. Synchronous (such requests run synchronous steps)."""
        sample_rows, row = [], 0
        for item in plan.items:
            n = len(item.tokens) if item.all_logits else int(item.sample)
            if item.all_logits:
                request, first = item.request, row
                prompt = request.prompt_ids
                positions = [p for p in range(item.start, item.start + n) if p + 1 < len(prompt)]
                if positions:
                    rows = torch.arange(first + positions[0] - item.start, first + positions[-1] - item.start + 1,
                                        device=logits.device)
                    lp = logits.index_select(0, rows).float().log_softmax(dim=-1)
                    targets = torch.tensor([prompt[p + 1] for p in positions], device=logits.device)
                    chosen = lp.gather(-1, targets[:, None])
                    ranks = (lp > chosen).sum(dim=-1) + 1
                    k = min(request.params.prompt_logprobs, lp.shape[-1])
                    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
                    chosen, ranks, top_lp, top_ids = (t.tolist() for t in (chosen[:, 0], ranks, top_lp, top_ids))
                    for j, p in enumerate(positions):
                        request.state.prompt_logprobs[p + 1] = TokenLogprob(prompt[p + 1], chosen[j],
                                                                            dict(zip(top_ids[j], top_lp[j])), ranks[j])
            if item.sample:
                sample_rows.append(row + n - 1)
            row += n
        return logits.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=logits.device))

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
        output processor holds it)."""
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


def _lora_start(prompt_ids: list[int], info) -> int:
    """The first position an activated LoRA applies to: where its invocation last starts in the prompt, or
    ``NOT_INVOKED`` (never: PEFT runs the base model throughout) when the prompt lacks it; 0 for other adapters."""
    invocation = None if info is None else info.invocation_tokens
    if invocation is None:
        return 0
    start = activation_start(prompt_ids, invocation)
    return NOT_INVOKED if start is None else start


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


def _quantized(model: nn.Module, config: EngineConfig) -> None:
    """Quantize the model's base weights as the config asks, in place (before it is patched); a model already
    quantized with that scheme is left as it is."""
    scheme = config.quantization
    if scheme is None:
        return
    schemes = {m.scheme for m in model.modules() if isinstance(m, QuantizedLinear)}
    if schemes:
        if schemes != {scheme}:
            raise ValueError(f"the model's layers are already quantized as {sorted(schemes)}, but the engine config "
                             f"asks for quantization={scheme!r}; give the engine an unquantized model, or that scheme")
        return
    if getattr(model, "_lorakit_handle", None) is not None:
        raise ValueError(f"quantization={scheme!r} needs an unpatched model (the LoRA wrappers must wrap the "
                         f"quantized layers): give the engine the model before lorakit.patch, or quantize it with "
                         f"lorakit.quantize before patching")
    count = quantize(model, scheme)
    size = weight_bytes(model)
    logger.info("quantization %s: %d linear layers, %.2f GiB of weights (%.2f GiB quantized, %.2f GiB in %s)", scheme,
                count, sum(size.values()) / 2**30, size["quantized"] / 2**30, size["other"] / 2**30,
                str(next(model.parameters()).dtype).removeprefix("torch."))


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


# The device memory free after the weights is one budget: the KV cache and the adapter slots (at max_rank) together
# take at most KV_SHARE of it by default, and slots chosen automatically at most ADAPTER_SHARE (the rest is
# activations, CUDA graphs and the allocator's slack). On the CPU, CPU_MEMORY stands for the free memory.
KV_SHARE, ADAPTER_SHARE, CPU_MEMORY = 0.5, 0.1, 4 << 30
AUTO_MAX_LORAS = 64  # the most slots "auto" gives: past it an adapter's slot would rarely be used before eviction


def _free_memory(device: torch.device) -> int:
    """The free memory sizing reads: the GPU's; on the CPU, CPU_MEMORY (or less where less is available), so that
    the KV cache and slots stay the size one model needs, not a share of the machine's memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return min(CPU_MEMORY, _available_cpu_memory() or CPU_MEMORY)


def _available_cpu_memory() -> int | None:
    """The machine's available memory (Linux's MemAvailable), in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _slot_count(model: nn.Module, config: EngineConfig) -> EngineConfig:
    """The config with ``max_loras`` "auto" (None) resolved: the slots of a model already patched, else as many as
    ADAPTER_SHARE of the free memory holds at max_rank, from 1 to AUTO_MAX_LORAS."""
    if config.max_loras is not None:
        return config
    handle = getattr(model, "_lorakit_handle", None)
    if isinstance(handle, LoraHandle):
        return dataclasses.replace(config, max_loras=handle.num_slots)
    per_slot = max(slot_bytes(model, config.max_rank), 1)
    free = _free_memory(next(model.parameters()).device)
    count = max(1, min(AUTO_MAX_LORAS, int(ADAPTER_SHARE * free) // per_slot))
    logger.info("max_loras auto: %d slots of %.1f MiB at max_rank=%d (%s)", count, per_slot / 2**20,
                config.max_rank, _free_text(free, next(model.parameters()).device))
    return dataclasses.replace(config, max_loras=count)


def _free_text(free: int, device: torch.device) -> str:
    """The log's words for ``free`` (what sizing read): on the CPU, the machine's available memory beside it."""
    if device.type == "cuda":
        return f"{free / 2**30:.1f} GiB free"
    available = _available_cpu_memory()
    shown = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
    return f"{shown} available on the CPU, sized from {free / 2**30:.1f} GiB"


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
        handle = model._lorakit_handle  # the slot buffers still to grow to max_rank come out of the same budget
        slots = max(0, handle.slot_bytes(config.max_rank) - handle.memory()["slot_buffers"])
        budget = int(KV_SHARE * _free_memory(device)) - slots
        num_blocks = max(min(config.max_num_seqs * blocks_per_seq, budget // per_block), blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_seq_len={max_seq_len} "
                         f"({blocks_per_seq} blocks of {block_size}); raise num_blocks or lower max_seq_len")
    return dataclasses.replace(config, max_seq_len=max_seq_len, num_blocks=num_blocks)


class LLM:
    """Offline generation with adapters: a model (a path, a Hugging Face hub id ``ORG/NAME[@REVISION]``, or a
    loaded transformers model) and a tokenizer."""

    def __init__(self, model: str | Path | nn.Module, tokenizer=None, config: EngineConfig | None = None, *,
                 adapters: dict[str, str | Path] | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, **options):
        """``config`` / ``options``: the engine's settings, as ``Engine`` takes them. A model or adapter given by
        hub id is downloaded once into the hub cache as ``lorakit serve`` does (``lorakit.adapters.hub``: a local
        folder of that spelling wins; safetensors, configs and tokenizer files only)."""
        from lorakit.adapters.hub import ADAPTER_FILES, MODEL_FILES, local_or_hub

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, str):
            model = local_or_hub(model, "model", MODEL_FILES)
        if adapters:
            adapters = {name: local_or_hub(path, f"adapter {name}", ADAPTER_FILES) if isinstance(path, str) else path
                        for name, path in adapters.items()}
        if isinstance(model, (str, Path)):
            import transformers

            from lorakit.layers.checkpoint import load_causal_lm

            dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(model)
            quantization = options.get("quantization", config.quantization if config is not None else None)
            model = load_causal_lm(model, dtype, device, quantization)
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
        engine, processors = self.engine, {}
        ids = []
        try:
            for prompt, p, name in zip(prompts, params, names):
                ids.append(engine.add_request(prompt, p, name))
                request = engine._requests[ids[-1]]
                processors[ids[-1]] = OutputProcessor(ids[-1], request.prompt_ids, request.params,
                                                      engine.tokenizer_for(name))
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            engine.step()
            raise
        results = {request_id: CompletionOutput(request_id, name, engine._requests[request_id].prompt_ids, "", [],
                                                None) for request_id, name in zip(ids, names)}
        while any(r.finish_reason is None for r in results.values()):
            for raw in engine.step():
                processed = processors[raw.request_id].process(raw)
                out = processed.output
                if out is None:
                    continue
                if processed.abort:  # a stop string ended it
                    engine.abort(out.request_id)
                result = results[out.request_id]
                result.text += out.text
                result.token_ids += out.token_ids
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
        return [results[request_id] for request_id in ids]
