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
import logging
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
from starlette.exceptions import HTTPException as StarletteHTTPException

import lorakit
from lorakit.engine import AsyncEngine, Engine, RequestOutput, SamplingParams
from lorakit.layers.adapter import AdapterError
from lorakit.serve import sglang
from lorakit.serve.metrics import CountResponses, Metrics
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody, chat_messages, sampling_params

logger = logging.getLogger("lorakit.serve")


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


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error"}


def _error(status: int, message: str, type_: str | None = None, param: str | None = None) -> JSONResponse:
    type_ = type_ or _ERROR_TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status)


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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # 404 unknown path, 405 wrong method
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(e.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("an unexpected error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error ({type(e).__name__}); the server log has the details")

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

    def params_of(body: CompletionBody | ChatBody, prompts: list[list[int]], default_max_tokens: int | None):
        return sampling_params(body, prompt_len=max(map(len, prompts)), max_seq_len=engine.max_seq_len,
                               max_tokens_limit=config.max_tokens_limit, default_max_tokens=default_max_tokens)

    async def run(prompt, params: SamplingParams, adapter: str | None, seed_offset: int) -> AsyncIterator[RequestOutput]:
        """One request's outputs, with metrics; bad prompts become 400s."""
        if params.seed is not None and seed_offset:
            params = dataclasses.replace(params, seed=(params.seed + seed_offset) % 2**63)
        with metrics.request(adapter or config.model_name) as measured:
            try:
                stream = runner.generate(prompt, params, adapter)
                async for out in stream:
                    measured.update(out)
                    if out.finish_reason == "error":  # its adapter could not be loaded, or its grammar failed
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
        messages = chat_messages(body)
        tokenizer = engine.tokenizer_for(adapter)  # an adapter's own tokenizer may add tokens
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def merged(jobs: list[tuple[int, list[int], int]], params: SamplingParams, adapter: str | None):
        """(choice index, output) from all jobs (index, prompt ids, seed offset) as they come, the index being
        the job's position; the first error raises; leaving early aborts every job."""
        return sglang.interleave([run(prompt, params, adapter, k) for _, prompt, k in jobs])

    def stream_usage(body, chunk: dict, usage_: dict) -> dict | None:
        """The last chunk, carrying usage, when the client asked with stream_options.include_usage."""
        if body.stream_options is None or not body.stream_options.include_usage:
            return None
        return {**chunk, "choices": [], "usage": usage_}

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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        adapter_of(model_id)
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "lorakit",
                "parent": None if model_id == config.model_name else config.model_name}

    @app.get("/version")
    async def version():
        return {"version": lorakit.__version__}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        adapter = adapter_of(body.model)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        prompts = [prompt_ids(p, adapter) for p in prompts]
        params = params_of(body, prompts, default_max_tokens=16)
        n = body.n or 1
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = [(i * n + k, p, k) for i, p in enumerate(prompts) for k in range(n)]
        text_of = engine.tokenizer_for(adapter)
        echoed = [text_of.decode(p) if text_of is not None else "" for p in prompts] if body.echo else None
        offsets = [0] * len(jobs)  # characters of each choice's text so far (logprobs' text_offset)

        def logprob_block(index: int, lps):
            if not lps:
                return None
            tokens = [token_text(t.token_id) for t in lps]
            starts = []
            for t in tokens:
                starts.append(offsets[index])
                offsets[index] += len(t)
            return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps], "text_offset": starts,
                    "top_logprobs": [{token_text(i): v for i, v in t.top.items()} for t in lps]}

        if body.stream:
            async def chunks():
                head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
                usage_ = body.stream_options is not None and body.stream_options.include_usage
                extra = {"usage": None} if usage_ else {}
                if echoed:
                    for index, _, _ in jobs:
                        yield {**head, "choices": [{"index": index, "text": echoed[index // n], "logprobs": None,
                                                    "finish_reason": None}], **extra}
                counts = [0, 0]
                async for index, out in merged(jobs, params, adapter):
                    counts[1] += len(out.token_ids)
                    if out.finished and index % n == 0:
                        counts[0] += out.num_prompt_tokens
                    yield {**head, "choices": [{"index": index, "text": out.text,
                                                "logprobs": logprob_block(index, out.logprobs),
                                                "finish_reason": out.finish_reason}], **extra}
                last = stream_usage(body, head, usage(*counts))
                if last is not None:
                    yield last
            return sse(chunks(), "completions")

        async def complete():
            results = await asyncio.gather(*(collect(run(p, params, adapter, k)) for _, p, k in jobs))
            choices = [{"index": i, "text": (echoed[i // n] if echoed else "") + r["text"],
                        "logprobs": logprob_block(i, r["logprobs"]), "finish_reason": r["finish_reason"]}
                       for i, r in enumerate(results)]
            prompt_tokens = sum(r["prompt_tokens"] for i, r in enumerate(results) if i % n == 0)
            return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices, "usage": usage(prompt_tokens, sum(len(r["token_ids"]) for r in results))}
        return await guarded(request, "completions", complete())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        adapter = adapter_of(body.model)
        prompt = prompt_ids(encode_chat(body, adapter), adapter)
        params = params_of(body, [prompt], default_max_tokens=None)
        n = body.n or 1
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        jobs = [(k, prompt, k) for k in range(n)]
        if body.stream:
            async def chunks():
                head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
                usage_ = body.stream_options is not None and body.stream_options.include_usage
                extra = {"usage": None} if usage_ else {}
                for k in range(n):
                    yield {**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], **extra}
                generated = 0
                async for k, out in merged(jobs, params, adapter):
                    generated += len(out.token_ids)
                    yield {**head, "choices": [{"index": k, "delta": {"content": out.text} if out.text else {},
                                                "logprobs": chat_logprobs(out.logprobs or []) if body.logprobs
                                                else None, "finish_reason": out.finish_reason}], **extra}
                last = stream_usage(body, head, usage(len(prompt), generated))
                if last is not None:
                    yield last
            return sse(chunks(), "chat")

        async def complete():
            results = await asyncio.gather(*(collect(run(prompt, params, adapter, k)) for k in range(n)))
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
