"""An OpenAI-compatible HTTP server over the engine: the adapter is the request's ``model`` field.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (as vLLM has them), ``POST
/generate`` (as SGLang has it), ``GET /health``, ``GET /metrics`` (Prometheus). Errors come in OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, and never disturb other requests.

Runtime loading from paths is a security boundary: off unless ``allow_runtime_lora``, and then only
folders inside ``lora_roots`` (symbolic links resolved, so neither ``..`` nor a link escapes), and only
safetensors (the loader never unpickles).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from lorakit.engine import AsyncEngine, Engine, RequestOutput, SamplingParams
from lorakit.layers.adapter import AdapterError
from lorakit.serve import sglang
from lorakit.serve.metrics import CountResponses, Metrics


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


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status)


# Request bodies (unknown fields are ignored, as OpenAI's API does).

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None


class LoadBody(BaseModel):
    lora_name: str
    lora_path: str


class UnloadBody(BaseModel):
    lora_name: str


def create_app(engine: Engine, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (its steps run on a thread of their own)."""
    config = config or ServeConfig()
    runner: AsyncEngine | None = None
    metrics = Metrics(engine, lambda: runner)
    slots = asyncio.Semaphore(config.max_concurrent)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal runner
        runner = AsyncEngine(engine)
        yield
        runner.shutdown()  # in-flight requests finish or get an error

    app = FastAPI(title="lorakit", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        return _error(400, f"invalid request: {where or 'body'}: {first.get('msg', 'bad value')}",
                      "invalid_request_error", where or None)

    if config.api_key:
        app.add_middleware(_BearerAuth, key=config.api_key, open_paths=("/health", "/metrics"))
    app.add_middleware(CountResponses, metrics=metrics, routes=app.router.routes)  # last: outside the key check

    # Helpers.

    def adapter_of(model: str) -> str | None:
        if model == config.model_name:
            return None
        if model not in engine.pool.adapters:
            raise ApiError(404, f"the model {model!r} does not exist; available: "
                                f"{[config.model_name, *sorted(engine.pool.adapters)]}", "not_found_error", "model")
        return model

    def params_of(body: _Sampling, logprobs: int | None) -> SamplingParams:
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        max_tokens = 16 if max_tokens is None else max_tokens
        if max_tokens > config.max_tokens_limit:
            raise ApiError(400, f"max_tokens={max_tokens} is above this server's limit of "
                                f"{config.max_tokens_limit}", param="max_tokens")
        if not 1 <= body.n <= 16:
            raise ApiError(400, f"n must be in [1, 16], got {body.n}", param="n")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, stop=body.stop or (),
                                  stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos,
                                  logprobs=logprobs, min_tokens=body.min_tokens)
        except ValueError as e:
            raise ApiError(400, str(e).replace("SamplingParams.", "")) from None

    async def run(prompt, params: SamplingParams, adapter: str | None, seed_offset: int) -> AsyncIterator[RequestOutput]:
        """One request's outputs, with metrics; bad prompts become 400s."""
        if params.seed is not None and seed_offset:
            params = dataclasses.replace(params, seed=(params.seed + seed_offset) % 2**63)
        with metrics.request(adapter or config.model_name) as measured:
            try:
                stream = runner.generate(prompt, params, adapter)
                async for out in stream:
                    measured.update(out)
                    if out.finish_reason == "error":  # its adapter could not be loaded
                        raise ApiError(400, out.error or "the request failed", param="model")
                    yield out
            except (ValueError, AdapterError) as e:
                raise ApiError(400, str(e), param="prompt") from None

    async def collect(gen: AsyncIterator[RequestOutput]) -> dict:
        text, tokens, reason, logprobs, prompt_tokens = "", [], None, [], 0
        async for out in gen:
            text += out.text
            tokens += out.token_ids
            logprobs += out.logprobs or []
            reason, prompt_tokens = out.finish_reason, out.num_prompt_tokens
        return dict(text=text, token_ids=tokens, finish_reason=reason, logprobs=logprobs, prompt_tokens=prompt_tokens)

    def busy() -> ApiError:
        return ApiError(429, f"too many requests in flight (limit {config.max_concurrent}); retry later",
                        "rate_limit_error")

    async def guarded(request: Request, endpoint: str, coro):
        """Run a handler within the concurrency limit; a client that disconnects cancels (aborts) its work.
        (``endpoint`` is unused: CountResponses counts every response.)"""
        if slots.locked():
            coro.close()  # never started
            raise busy()
        async with slots:
            task = asyncio.ensure_future(coro)
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    return JSONResponse({}, 499)
            return task.result()

    def sse(chunks: AsyncIterator[dict], endpoint: str) -> StreamingResponse:
        """Server-sent events within the concurrency limit; an error once streaming is an error event, then [DONE].
        (``endpoint`` is unused: CountResponses counts every response, and streams that end in an error.)"""
        if slots.locked():
            raise busy()

        async def body():
            try:
                if slots.locked():  # taken since
                    raise busy()
                async with slots:
                    async for chunk in chunks:
                        yield _sse(chunk)
            except ApiError as e:
                yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    def encode_chat(body: ChatBody, adapter: str | None) -> list[int]:
        tokenizer = engine.tokenizer_for(adapter)  # an adapter's own tokenizer may add tokens
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        if not body.messages:
            raise ApiError(400, "messages is empty", param="messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "".join(p.get("text", "") for p in m.content or [])} for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def chat_logprobs(lps) -> dict:
        """OpenAI's chat shape: per token its text, logprob and the top alternatives."""
        return {"content": [{"token": token_text(t.token_id), "logprob": t.logprob,
                             "top_logprobs": [{"token": token_text(i), "logprob": v} for i, v in t.top.items()]}
                            for t in lps]}

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def prompt_ids(prompt, adapter: str | None = None) -> list[int]:
        """Tokenized and checked once, before any response starts (so a stream can still get a 400)."""
        try:
            return engine.prompt_ids(prompt, adapter)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None

    # Endpoints.

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [{"id": config.model_name, "object": "model", "created": created, "owned_by": "lorakit",
                 "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "lorakit",
                  "parent": config.model_name} for name in sorted(engine.pool.adapters)]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        adapter = adapter_of(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise ApiError(400, f"logprobs must be in [0, 20], got {body.logprobs}", param="logprobs")
        params = params_of(body, body.logprobs)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        prompts = [prompt_ids(p, adapter) for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = [(i * body.n + k, p, k) for i, p in enumerate(prompts) for k in range(body.n)]

        def logprob_block(lps):
            if not lps:
                return None
            return {"tokens": [tokenizer.decode([t.token_id]) if tokenizer else str(t.token_id) for t in lps],
                    "token_logprobs": [t.logprob for t in lps],
                    "top_logprobs": [{(tokenizer.decode([i]) if tokenizer else str(i)): v for i, v in t.top.items()}
                                     for t in lps]}

        if body.stream:
            async def chunks():
                queue: asyncio.Queue = asyncio.Queue()

                async def pump(index, prompt, k):
                    try:
                        async for out in run(prompt, params, adapter, k):
                            await queue.put((index, out))
                    except ApiError as e:
                        await queue.put(e)
                    await queue.put((index, None))

                tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
                try:
                    remaining = len(jobs)
                    while remaining:
                        item = await queue.get()
                        if isinstance(item, ApiError):
                            raise item
                        index, out = item
                        if out is None:
                            remaining -= 1
                            continue
                        yield {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                               "choices": [{"index": index, "text": out.text, "logprobs": logprob_block(out.logprobs),
                                            "finish_reason": out.finish_reason}]}
                finally:
                    for t in tasks:
                        t.cancel()
            return sse(chunks(), "completions")

        async def complete():
            results = await asyncio.gather(*(collect(run(p, params, adapter, k)) for _, p, k in jobs))
            choices = [{"index": i, "text": r["text"], "logprobs": logprob_block(r["logprobs"]),
                        "finish_reason": r["finish_reason"]} for i, r in enumerate(results)]
            prompt_tokens = sum(r["prompt_tokens"] for i, r in enumerate(results) if i % body.n == 0)
            return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices, "usage": usage(prompt_tokens, sum(len(r["token_ids"]) for r in results))}
        return await guarded(request, "completions", complete())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        adapter = adapter_of(body.model)
        top = body.top_logprobs if body.logprobs else None
        if top is not None and not 0 <= top <= 20:
            raise ApiError(400, f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
        params = params_of(body, (top or 0) if body.logprobs else None)
        prompt = prompt_ids(encode_chat(body, adapter), adapter)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            async def chunks():
                for k in range(body.n):
                    yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                           "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]}
                    async for out in run(prompt, params, adapter, k):
                        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                               "choices": [{"index": k, "delta": {"content": out.text} if out.text else {},
                                            "logprobs": chat_logprobs(out.logprobs or []) if body.logprobs else None,
                                            "finish_reason": out.finish_reason}]}
            return sse(chunks(), "chat")

        async def complete():
            results = await asyncio.gather(*(collect(run(prompt, params, adapter, k)) for k in range(body.n)))
            choices = [{"index": k, "message": {"role": "assistant", "content": r["text"]},
                        "logprobs": chat_logprobs(r["logprobs"]) if body.logprobs else None,
                        "finish_reason": r["finish_reason"]} for k, r in enumerate(results)]
            return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                    "choices": choices,
                    "usage": usage(len(prompt), sum(len(r["token_ids"]) for r in results))}
        return await guarded(request, "chat", complete())

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadBody):
        if not config.allow_runtime_lora:
            raise ApiError(403, "runtime adapter loading is off; start the server with --allow-runtime-lora "
                                "(and --lora-root DIR)", "permission_error")
        path = confined(body.lora_path, config.lora_roots)
        if body.lora_name == config.model_name:
            raise ApiError(400, f"{body.lora_name!r} is the base model's name; pick another", param="lora_name")
        try:
            version = await runner.call(engine.register_adapter, body.lora_name, path)
        except (AdapterError, ValueError) as e:
            raise ApiError(400, str(e), param="lora_path") from None
        return {"status": "ok", "lora_name": body.lora_name, "version": version}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadBody):
        if not config.allow_runtime_lora:
            raise ApiError(403, "runtime adapter loading is off; start the server with --allow-runtime-lora",
                           "permission_error")
        try:
            await runner.call(engine.unregister_adapter, body.lora_name)
        except AdapterError as e:
            raise ApiError(404, str(e), "not_found_error", "lora_name") from None
        return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/generate")
    async def generate(body: sglang.GenerateBody, request: Request):
        """SGLang's native endpoint: see serve/sglang.py for the mapping and the shapes."""
        try:
            jobs, batched = sglang.jobs(body, engine.pool.adapters, config.model_name, config.max_tokens_limit)
        except sglang.Refused as e:
            raise ApiError(e.status, str(e), e.type, e.param) from None
        outputs = [sglang.Output(job, prompt_ids(job.prompt, job.adapter), engine.eos_token_id,
                                 engine.tokenizer_for(job.adapter)) for job in jobs]

        def streams():
            return [run(out.prompt_ids, out.job.params, out.job.adapter, 0) for out in outputs]

        if body.stream:
            async def chunks():
                async for i, out in sglang.interleave(streams()):
                    outputs[i].add(out)
                    yield outputs[i].as_dict(i if batched else None)
            return sse(chunks(), "generate")

        async def complete():
            async for i, out in sglang.interleave(streams()):
                outputs[i].add(out)
            results = [out.as_dict() for out in outputs]
            return results if batched else results[0]
        return await guarded(request, "generate", complete())

    return app


class _BearerAuth:
    """Requires 'Authorization: Bearer KEY' on every path but ``open_paths``. Plain ASGI, so streamed responses
    pass straight through (a BaseHTTPMiddleware would relay every chunk through a task of its own)."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...]):
        self.app, self.expected, self.open_paths = app, f"Bearer {key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                response = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def confined(path: str, roots: list[Path]) -> Path:
    """``path`` resolved (links followed) if it and every file in it lie inside one of ``roots``; else ApiError."""
    if not roots:
        raise ApiError(403, "runtime loading has no --lora-root to load from", "permission_error", "lora_path")
    resolved = Path(path).expanduser().resolve()
    for root in roots:
        root = Path(root).expanduser().resolve()
        if resolved.is_relative_to(root):
            if resolved.is_dir() and any(not f.resolve().is_relative_to(root) for f in resolved.iterdir()):
                break  # a link inside the folder points outside the root
            return resolved
    raise ApiError(403, f"lora_path {path!r} is outside the allowed --lora-root folders", "permission_error",
                   "lora_path")
