"""What every handler is given: ``ServerState``, the server's config, metrics, limits on what is in flight, and its
one door to the engine, an ``EngineClient`` (``lorakit.frontend.client``): the engine on a thread of this process, or
in a core process of its own (``lorakit serve``).

From the event loop, ServerState only looks things up (the registered adapters, a tokenizer, the context length);
a long prompt is tokenized on a thread of its own and every chat template, untrusted input, is rendered in a worker
process within budgets (``lorakit.frontend.chat_templates``), so neither holds up the event loop and the streams it
serves; whatever changes the engine (a request, a load, an unload) goes through the client to the
engine's thread or process, which reads and checks an adapter's files while it keeps stepping.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextvars import ContextVar
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.adapters.pool import AdapterGone, AdapterRef
from lorakit.adapters.shared import SharedWeights
from lorakit.engine import Engine, RequestOutput, SamplingParams
from lorakit.engine.detokenize import rust_tokenizer
from lorakit.engine.errors import EngineDead, Overloaded
from lorakit.engine.lengths import fit_max_tokens
from lorakit.engine.outputs import FinishReason
from lorakit.frontend.chat_templates import ChatTemplates, TemplateBudget, TemplateError
from lorakit.frontend.client import Adapter, EngineClient, InProcessClient
from lorakit.engine.structured import StructuredOutput
from lorakit.frontend.streams import RequestStream
from lorakit.peft import AdapterError
from lorakit.serve.auth import check_key
from lorakit.serve.edge import BodyBudget, default_bytes_in_flight
from lorakit.serve.metrics import Metrics, RequestMetrics
from lorakit.serve.protocol import ApiError, shown, ChatBody, CompletionBody, sampling_params, structured_param
from lorakit.serve.streaming import ConcurrencyLimit, outputs

__all__ = ["JobListener", "Result", "ServeConfig", "ServerState", "Submitted"]

CLIENT: ContextVar[str | None] = ContextVar("lorakit_client", default=None)  # who sent the request being handled (its
# peer address: an API key is the server's one, shared by every client); set by the app for each request
JobListener = Callable[[int, "RequestOutput | BaseException"], None]  # (job index, an output or the job's error)

INLINE_SIZE = 2048  # prompts up to this many characters (or token ids) are tokenized on the event loop
CHARS_PER_TOKEN = 32  # max_prompt_chars' default per token of context: 8 times what text averages, about 4
# max_queued_tokens' default, in KV caches full. The engine runs what its cache holds and queues the rest, so the
# requests in flight may hold more than the cache: enough that a finished request's place is taken at the next step
# (the engine never waits on HTTP), and a request admitted last waits about three rounds of the cache, not an
# unbounded queue's time that its client cannot see (a 429 with Retry-After tells it). Each sequence counts its whole
# max_tokens, which most do not reach (an EOS, a stop string): what they really occupy is less.
QUEUE_FACTOR = 4
# max_concurrent's default, per request the engine runs at once (max_num_seqs). The tokens are the bound that counts;
# this one bounds what each sequence costs this process whatever its length (a stream, a queue, an output processor):
# four times QUEUE_FACTOR, so that only sequences shorter than a quarter of a running request's share of the cache
# (kv_tokens / max_num_seqs) meet it before the tokens' limit.
SEQUENCES_PER_SEAT = 16


@dataclass
class ServeConfig:
    """model_name: what clients call the base model. max_tokens_limit: the largest max_tokens accepted.

    Bounds on what one request may make the server do (each refused before the work it bounds, with a 400 unless
    said otherwise): max_concurrent, sequences in flight at once in this API process (one per prompt and sample; None:
    SEQUENCES_PER_SEAT per request the engine runs at once, max_num_seqs); max_queued_tokens, the tokens these
    sequences can occupy in the KV cache together (each one's prompt and max_tokens, fitted to the context; None:
    QUEUE_FACTOR times the cache's room). Both defaults are shared by the API server processes of one engine, and
    the tokens' is at least max_seq_len. A request that would pass either gets 429 with Retry-After (the engine
    queues what it cannot run yet: these bound its queue), one that alone passes one, 400 (``in_flight``);
    max_body_bytes, a request body's size (413, before it is parsed; max_push_bytes for an adapter pushed to
    ``PUT /v1/lora_adapters/NAME``, with allow_runtime_lora); max_prompt_chars, a prompt's characters (a
    chat's messages' together) before it is tokenized (None: 32 per token of the engine's max_seq_len);
    max_stop_strings and max_stop_chars, a request's stop strings and the characters of each (each is looked for in
    the output at every token, as it is detokenized on this process's event loop); max_template_seconds and max_template_bytes, the time and the
    memory one chat template's render may take (the model's or an adapter's: untrusted input, rendered in a worker
    process that is killed past them), which may render at most twice max_prompt_chars.

    Bounds on what a connection may cost (edge.py): max_body_bytes_in_flight, the bytes of request bodies held at
    once by this process, all connections together (503 at once for one that would pass it; None: an eighth of the
    machine's memory, at least max_body_bytes); header_timeout, seconds a connection has to send a request's headers
    (from its start, or its previous response's end); body_timeout, seconds a body has to arrive whole after its
    headers (408 for either). api_key: what 'Authorization: Bearer' must carry (None: nothing).

    Life and death: health_timeout, the seconds without a word from an engine core process (it beats every 0.5 s from
    a thread of its own, whatever its loop does, so a long step or graph capture does not count) after which
    ``/health`` answers 503; shutdown_grace, the seconds requests in flight get to finish at Ctrl-C or SIGTERM,
    after which each still running ends with a 503 (a stream: an error event, then ``[DONE]``)."""

    model_name: str = "base"
    allow_runtime_lora: bool = False
    allow_lora_repos: list[str] = field(default_factory=list)  # hub id patterns runtime loading may download
    lora_roots: list[Path] = field(default_factory=list)
    api_key: str | None = None
    max_tokens_limit: int = 4096
    max_concurrent: int | None = None
    max_queued_tokens: int | None = None
    max_body_bytes: int = 16 * 2**20
    max_push_bytes: int = 2 << 30
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    tool_call_parser: str = "auto"  # serve.tools.PARSERS, or "auto": the one the chat template speaks
    max_template_seconds: float = 1.0
    max_template_bytes: int = 2 << 30
    max_body_bytes_in_flight: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    health_timeout: float = 10.0
    shutdown_grace: float = 30.0

    def __post_init__(self):
        for name in ("max_tokens_limit", "max_concurrent", "max_queued_tokens", "max_body_bytes", "max_push_bytes",
                     "max_prompt_chars",
                     "max_stop_strings", "max_stop_chars", "max_body_bytes_in_flight"):
            value = getattr(self, name)
            if not (value is None and name in ("max_concurrent", "max_queued_tokens", "max_prompt_chars",
                                               "max_body_bytes_in_flight")) and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"ServeConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_body_bytes_in_flight is not None and self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(f"ServeConfig.max_body_bytes_in_flight (--max-body-bytes-in-flight, "
                             f"{self.max_body_bytes_in_flight}) is below max_body_bytes (--max-body-bytes, "
                             f"{self.max_body_bytes}): no body of the largest size could ever be received; raise the "
                             f"first or lower the second")
        for name in ("header_timeout", "body_timeout", "max_template_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ServeConfig.{name} must be a number of seconds > 0, got {value!r}")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json", "mistral"):
            raise ValueError(f"ServeConfig.tool_call_parser must be auto, hermes, llama3_json or mistral, got "
                             f"{self.tool_call_parser!r}")
        if self.api_key is not None:
            check_key(self.api_key, "ServeConfig.api_key")
        if isinstance(self.max_template_bytes, bool) or not isinstance(self.max_template_bytes, int) \
                or self.max_template_bytes < 1 << 24:
            raise ValueError(f"ServeConfig.max_template_bytes must be an int >= 16 MiB, got {self.max_template_bytes!r}")
        for name, zero in (("health_timeout", False), ("shutdown_grace", True)):  # zero: may it be 0
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not (value >= 0 if zero else value > 0):
                raise ValueError(f"ServeConfig.{name} must be a finite number of seconds {'>=' if zero else '>'} 0, "
                                 f"got {value!r}")

    @property
    def template_budget(self) -> TemplateBudget:
        return TemplateBudget(self.max_template_seconds, self.max_template_bytes)

    @property
    def bytes_in_flight(self) -> int:
        """max_body_bytes_in_flight, or its default for this machine."""
        if self.max_body_bytes_in_flight is not None:
            return self.max_body_bytes_in_flight
        return max(default_bytes_in_flight(), self.max_body_bytes)

    def in_flight(self, engine: EngineClient) -> tuple[int, int]:
        """(sequences, tokens) one API process of ``engine`` holds in flight: max_concurrent and max_queued_tokens, or
        their defaults for this engine, divided among its ``servers``."""
        servers = engine.servers
        sequences = self.max_concurrent or max(SEQUENCES_PER_SEAT * engine.max_num_seqs // servers, 1)
        tokens = self.max_queued_tokens or max(QUEUE_FACTOR * engine.kv_tokens // servers, engine.max_seq_len)
        return sequences, tokens


class Result:
    """One job's outputs, added up."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason: FinishReason | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.prompt_logprobs = None  # with prompt_logprobs: one per prompt token (None for the first)

    def add(self, out: RequestOutput) -> None:
        self.cached_tokens = out.num_cached_tokens
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason


def _encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a rendered chat template, as ``apply_chat_template(..., tokenize=True)`` makes them (its text holds
    the special tokens itself: none are added); a transformers fast tokenizer's Rust one is called directly, without
    the Python around ``__call__`` (about a third of a chat request's tokenizing time)."""
    rust = rust_tokenizer(tokenizer)
    if rust is not None:
        return rust.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


class ServerState:
    """See the module docstring. ``start`` (at the app's startup) runs the engine thread; ``stop`` lets the requests
    in flight finish, and fails the rest."""

    def __init__(self, engine: Engine | EngineClient, config: ServeConfig):
        self.engine = InProcessClient(engine) if isinstance(engine, Engine) else engine
        self.config = config
        self.metrics = Metrics(self.engine, self.config.model_name)
        self.in_flight = ConcurrencyLimit(*config.in_flight(self.engine))
        self.bodies = BodyBudget(config.bytes_in_flight)  # request bodies held, all connections together
        self.max_prompt_chars = config.max_prompt_chars or CHARS_PER_TOKEN * self.engine.max_seq_len
        # Adapters this server registers when a request asks for them (a Ray fleet's resolver, lorakit.serve.ray): listed
        # by /v1/models and in 404s beside the registered ones.
        self.on_request: Callable[[], Sequence[str]] | None = None
        # One thread: a tokenizer is not safe to call from several threads at once (Rust's "Already borrowed").
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="lorakit-tokenize")
        self._templates = ChatTemplates(config.template_budget)  # started at the first chat
        self._stopped = False
        self._created: dict[str, int] = {config.model_name: int(time.time())}

    def created(self, name: str) -> int:
        """``/v1/models``' ``created`` of a model: when this server started (the base model) or first listed it
        (an adapter); the same at every call while it stays registered."""
        return self._created.setdefault(name, int(time.time()))

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        """Once; a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        self.engine.stop()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self._templates.close()

    def health(self) -> str | None:
        """Why the engine cannot serve now (gone, or a core not heard from for ``health_timeout`` s); None: it can."""
        return self.engine.health(self.config.health_timeout)

    def end_requests(self, reason: str) -> None:
        """End every request in flight now: each gets a 503 with ``reason`` (a stream: an error event, then
        ``[DONE]``)."""
        self.engine.end_requests(reason)

    # Lookups, on the event loop.

    @property
    def adapters(self) -> dict[str, int]:
        """Registered adapters and their versions."""
        return self.engine.adapters

    @property
    def adapter_versions(self) -> dict[str, tuple[int, str]]:
        """Registered adapters and their versions: (number, sha256 of the files as read)."""
        return self.engine.versions

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self.engine.eos_token_id

    def servable(self) -> list[str]:
        """Every adapter this server answers for: the registered ones and those it registers on request."""
        return sorted(set(self.adapters) | set(self.on_request() if self.on_request else ()))

    def adapter_of(self, model: str | None, param: str = "model") -> Adapter | None:
        """The adapter version a request's ``model`` names, resolved once, here: everything below carries it (None:
        the base model, by its name or None). ``NAME`` is its current version, ``NAME@N`` version N while it lives
        (current, or replaced with requests still running on it). 404 naming ``param`` for a name nobody serves or a
        version that is gone."""
        if model is None or model == self.config.model_name:
            return None
        name, at, number = model.rpartition("@") if "@" in model else (model, "", "")
        if at and not (number.isdigit() and len(number) <= 12):
            raise ApiError(404, f"the model {shown(model)} does not exist: NAME@N names version N of an adapter, "
                                f"N a number", param)
        try:
            adapter = self.engine.resolve(name)
            if at and int(number) != adapter.ref.version:
                adapter = self.engine.resolve_version(name, int(number))
            return adapter
        except AdapterError as e:
            if at and name in self.servable():
                raise ApiError(404, str(e), param) from None
            available = [self.config.model_name, *self.servable()]
            what = f"the model {shown(model)} does not exist" if param == "model" else \
                f"unknown adapter {shown(model)} in {param}"
            raise ApiError(404, f"{what}; available: {available}", param) from None

    async def prompt_ids(self, prompt: str | list[int], adapter: Adapter | None) -> list[int]:
        """Tokenized (off the event loop) and checked once, before any response starts (so a stream can still get a
        400); a text longer than ``max_prompt_chars`` is refused before it is tokenized."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
        return await self._tokenize(len(prompt), self._checked_ids, prompt, adapter)

    def chat_template(self, adapter: Adapter | None) -> str:
        """The chat template of ``adapter``'s tokenizer (its own may differ); a 400 when there is none."""
        tokenizer = self.tokenizer(adapter)
        template = None if tokenizer is None else getattr(tokenizer, "chat_template", None)
        if template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        return template if isinstance(template, str) else json.dumps(template)

    async def chat_ids(self, messages: list[dict], adapter: Adapter | None, tools: list[dict] | None = None
                       ) -> list[int]:
        """The messages (and ``tools``, for a template that renders them) through the chat template of
        ``adapter``'s tokenizer (its own may add tokens), rendered in the template worker within the server's budgets
        (a 400 naming the template, the model's or the adapter's, past one), tokenized and checked as
        ``prompt_ids`` does."""
        template = self.chat_template(adapter)
        tokenizer = self.tokenizer(adapter)
        if tools and "tools" not in template:
            raise ApiError(400, "this model's chat template does not render tools, so it was not taught to call them; "
                                "drop tools, or serve a model whose template has them", "tools")
        chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self._check_chars(chars, "messages")
        if len(messages) >= self.engine.max_seq_len:  # each message takes at least one token of the context
            raise ApiError(400, f"{len(messages)} messages cannot fit in this model's context of "
                                f"{self.engine.max_seq_len} tokens", "messages")
        whose = "the model's chat template" if adapter is None or adapter.tokenizer is None else \
            f"the chat template of adapter {adapter.name!r}"
        try:
            text = await self._templates.render(tokenizer, messages, tools or None, 2 * self.max_prompt_chars, whose)
        except TemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        return await self._tokenize(len(text), lambda: self._checked_ids(_encode_rendered(tokenizer, text), adapter))

    def _check_chars(self, count: int, param: str) -> None:
        if count > self.max_prompt_chars:
            raise ApiError(400, f"{param} has {count} characters; this server tokenizes at most "
                                f"{self.max_prompt_chars} (--max-prompt-chars); shorten it", param)

    def _checked_ids(self, prompt: str | list[int], adapter: Adapter | None) -> list[int]:
        try:
            return self.engine.prompt_ids(prompt, adapter)
        except ValueError as e:  # AdapterError too: the adapter was unloaded since
            raise ApiError(400, str(e), "prompt") from None

    async def _tokenize(self, size: int, fn: Callable, *args):
        """fn(*args): on the event loop for a short input (``size``, characters or token ids, at most INLINE_SIZE:
        well under a millisecond), else on the tokenizing thread (``off_loop``). A thread that needs the GIL back
        from a busy event loop waits up to its switch interval (5 ms) each time the tokenizer releases it, and the
        one thread serves every request in turn: under load that queue, not the work, would set the time to first
        token."""
        if size <= INLINE_SIZE:
            return fn(*args)
        return await self.off_loop(fn, *args)

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenizing thread, the one thread that calls the tokenizers off the event loop (a long
        prompt's tokens, a large answer's logprobs): one such work at a time, whatever request it serves."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def sampling_params(self, body: CompletionBody | ChatBody, prompts: list[list[int]],
                        default_max_tokens: int | None, adapter: Adapter | None = None) -> SamplingParams:
        """The body's SamplingParams; a logit_bias id outside ``adapter``'s vocabulary (the model's and the tokens
        the adapter adds) is a 400 naming ``logit_bias``, here rather than as the engine's refusal."""
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        self.check_stop(stop)
        params = sampling_params(body, prompt_len=max(map(len, prompts)), max_seq_len=self.engine.max_seq_len,
                                 max_tokens_limit=self.config.max_tokens_limit, default_max_tokens=default_max_tokens)
        added = frozenset() if adapter is None else adapter.added
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.engine.vocab_size and t not in added]
        if bad:
            raise ApiError(400, f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, "
                                f"{self.engine.vocab_size}){' and the tokens its adapter adds' if added else ''}",
                           "logit_bias")
        return params

    async def check_grammar(self, spec: StructuredOutput | None, adapter: Adapter | None, param: str) -> None:
        """Has the engine compile the request's grammar (on its grammar workers, while it steps and this loop serves
        others) and waits for it: a grammar past the engine's budget (--max-grammar-bytes, --max-grammar-seconds)
        or one llguidance cannot compile or follow is a 400 naming ``param``, before anything is queued; one the
        engine had no worker for in time, or no room to queue (``Overloaded``), a 429 with Retry-After. The
        request's sequences then find it compiled: each gets a copy of its matcher."""
        if spec is None:
            return
        try:
            await self.engine.compile_grammar(spec, adapter, CLIENT.get())
        except Overloaded as e:
            raise ApiError(429, f"{param}: {e}", param, {"Retry-After": str(max(math.ceil(e.retry_after), 1))}) \
                from None
        except ValueError as e:  # GrammarError, an AdapterError
            raise ApiError(400, f"{param}: {e}", param) from None
        except EngineDead as e:
            raise ApiError(503, str(e)) from None

    async def body_grammar(self, body: CompletionBody | ChatBody, params: SamplingParams, adapter: Adapter | None
                           ) -> None:
        """``check_grammar`` for an OpenAI body's structured output (``response_format`` or a ``guided_*``)."""
        await self.check_grammar(params.structured_output, adapter, structured_param(body) or "response_format")

    def check_stop(self, stop: Sequence[str]) -> None:
        """400 for more stop strings, or longer ones, than the server's bounds."""
        config = self.config
        if len(stop) > config.max_stop_strings:
            raise ApiError(400, f"{len(stop)} stop strings; this server takes at most {config.max_stop_strings} "
                                f"(--max-stop-strings)", "stop")
        longest = max(map(len, stop), default=0)
        if longest > config.max_stop_chars:
            raise ApiError(400, f"a stop string of {longest} characters; this server takes at most "
                                f"{config.max_stop_chars} per string (--max-stop-chars)", "stop")

    def tokenizer(self, adapter: Adapter | None):
        """The tokenizer of ``adapter``'s requests (its own where its folder has one); None if the engine has none."""
        return self.engine.tokenizer_for(adapter)

    def text(self, ids: list[int], adapter: Adapter | None, skip_special_tokens: bool = False) -> str:
        """The text of token ids, as ``adapter``'s tokenizer reads them ("" without a tokenizer, as the engine's
        outputs are then)."""
        tokenizer = self.tokenizer(adapter)
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # Through the engine client.

    async def register_adapter(self, name: str, path: Path, roots: list[Path] | None = None) -> int:
        """Reads and checks the adapter's files (every file inside ``roots``, by default the --lora-root folders;
        AdapterError for a bad one) while the engine keeps stepping, then installs them between steps; its
        version."""
        return await self.engine.register_adapter(name, path, roots or self.config.lora_roots or None)

    async def push_adapter(self, name: str, weights: bytes | memoryview | SharedWeights, config: dict | None,
                           version: int | None = None) -> AdapterRef:
        """Checks weights pushed from memory (a safetensors file's bytes, or a client's CUDA buffer; AdapterError for
        bad ones) while the engine keeps stepping, then installs them between steps as ``name``'s new version."""
        return await self.engine.push_adapter(name, weights, config, version)

    async def unregister_adapter(self, name: str) -> None:
        await self.engine.unregister_adapter(name)
        self.metrics.prune()  # its series go with it
        self._created.pop(name, None)

    async def submit(self, jobs: Sequence[tuple[list[int], SamplingParams, Adapter | None]], listener: JobListener
                     ) -> Submitted:
        """Start every job (prompt ids, params, adapter): each of job ``i``'s outputs goes to ``listener(i, out)`` as
        it comes, on the pass that delivers its step (no task and no wake-up per job), counted in the metrics. A job
        that fails gives ``listener(i, error)`` once, and nothing more: an ApiError 400 for a request the engine
        refuses or fails (its adapter could not be loaded or was unloaded before it ran, its grammar failed), 503 for
        an abort this server did not cause and for an engine that is gone (a request never ends empty with a 200).
        A request refused as it is sent raises here, the jobs started before it closed. ``close()`` on the handle
        ends the jobs still running (aborted in the engine: a client gone)."""
        submitted = Submitted()
        try:
            for i, (prompt, params, adapter) in enumerate(jobs):
                watched = _Watched(i, listener, self.metrics.request(
                    self.config.model_name if adapter is None else adapter.name))
                try:
                    stream = await self.engine.submit(prompt, params, adapter)
                except BaseException as e:
                    watched.end(FinishReason.ERROR if isinstance(e, Exception) else FinishReason.ABORT)
                    told = _api_error(e)
                    if told is e:
                        raise
                    raise told from None
                submitted.add(stream, watched)
                stream.listen(watched)
        except BaseException:
            submitted.close()
            raise
        return submitted

    def tokens(self, jobs: Sequence[tuple[list[int], SamplingParams, Adapter | None]]) -> int:
        """What the jobs (prompt ids, params, adapter) can occupy in the KV cache together: each one's prompt and its
        max_tokens, cut to the context as the engine cuts it (``fit_max_tokens``)."""
        return sum(len(prompt) + fit_max_tokens(len(prompt), self.engine.max_seq_len, default=params.max_tokens)
                   for prompt, params, _ in jobs)

    def stream(self, jobs: Sequence[tuple[list[int], SamplingParams, Adapter | None]]
               ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every job (prompt ids, params, adapter) as they come, each with its job's index (``submit``
        read with ``async for``); the first error ends them all (raised here), and leaving early aborts every job."""
        return outputs(lambda listener: self.submit(jobs, listener), len(jobs))

    async def results(self, jobs: Sequence[tuple[list[int], SamplingParams, Adapter | None]]) -> list[Result]:
        """Every job's outputs added up, in the order of ``jobs``."""
        results = [Result() for _ in jobs]
        async for i, out in self.stream(jobs):
            results[i].add(out)
        return results


def _api_error(error: BaseException) -> BaseException:
    """What a client is told of an engine's error: a request it refused (ValueError, AdapterError) is a 400, a gone
    engine a 503; anything else is itself (a bug)."""
    if isinstance(error, AdapterGone):  # unloaded, or the version named ended, since the server resolved it
        return ApiError(404, str(error), "model")
    if isinstance(error, (ValueError, AdapterError)):
        return ApiError(400, str(error), "prompt")
    if isinstance(error, EngineDead):
        return ApiError(503, str(error))
    return error


class _Watched:
    """Job ``index``'s listener on its engine stream: counts its outputs in ``measured`` and turns how it ends into
    what the client is told (``ServerState.submit``); nothing reaches ``listener`` after its end."""

    __slots__ = ("index", "listener", "measured", "ended")

    def __init__(self, index: int, listener: JobListener, measured: RequestMetrics):
        self.index, self.listener, self.measured, self.ended = index, listener, measured, False

    def __call__(self, item: RequestOutput | BaseException) -> None:
        if self.ended:
            return
        if isinstance(item, BaseException):
            self.end(FinishReason.ERROR)
            self.listener(self.index, _api_error(item))
            return
        self.measured.update(item)
        reason = item.finish_reason
        if reason == FinishReason.ERROR:
            self.end(FinishReason.ERROR)
            self.listener(self.index, ApiError(404 if item.adapter_gone else 400, item.error or "the request failed",
                                               "model"))
        elif reason == FinishReason.ABORT:
            self.end(FinishReason.ERROR)
            why = f" ({item.error})" if item.error else ""
            self.listener(self.index, ApiError(503, f"the server ended this request before it finished{why}; send "
                                                    f"it again"))
        else:
            if item.finished:
                self.end(reason)
            self.listener(self.index, item)

    def end(self, reason: FinishReason | None) -> None:
        if not self.ended:
            self.ended = True
            self.measured.end(reason)


class Submitted:
    """The jobs ``ServerState.submit`` started: ``close()`` ends those still running (aborted in the engine, counted
    as aborted)."""

    def __init__(self):
        self._jobs: list[tuple[RequestStream, _Watched]] = []

    def add(self, stream: RequestStream, watched: _Watched) -> None:
        self._jobs.append((stream, watched))

    def close(self) -> None:
        for stream, watched in self._jobs:
            watched.end(FinishReason.ABORT)
            stream.close()
