"""An OpenAI-compatible HTTP server over the engine: the adapter is the request's ``model`` field.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, ``PUT /v1/lora_adapters/NAME`` (an adapter's weights
pushed in the body), ``POST /tokenize`` / ``/detokenize`` and
``GET /tokenizer_info`` (as vLLM has them), ``POST /generate`` (as SGLang has it), ``GET /health``, ``GET /metrics``
(Prometheus). This file only assembles them: a route binds a path to its handler (openai.py, sglang.py, adapters.py,
tokenize.py: plain functions of the validated body and the ServerState), and
``streaming.respond`` sends the handler's reply. Whatever fails, the client gets an error in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}`` (``ApiError.body``), and other requests are not disturbed. What
a request may cost before its handler runs (its headers, its body, all bodies in flight, the API key) is edge.py's
and auth.py's; a body is parsed by ``protocol.parse_body``, which refuses text no tokenizer takes.
"""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from typing import Annotated

import prometheus_client as prom
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

import lorakit
from lorakit.engine import Engine
from lorakit.serve import adapters, openai, sglang, tokenize
from lorakit.serve.auth import BearerAuth
from lorakit.serve.edge import BODY_KEY, BodyGate
from lorakit.serve.metrics import CountResponses
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody, LoadBody, UnloadBody, parse_body
from lorakit.serve.state import CLIENT, ServeConfig, ServerState
from lorakit.serve.streaming import respond

__all__ = ["ServeConfig", "create_app"]

logger = logging.getLogger("lorakit.serve")


def create_app(engine: Engine, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (its steps run on a thread of their own)."""
    state = ServerState(engine, config or ServeConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield
        state.stop()  # in-flight requests finish or get an error

    app = FastAPI(title="lorakit", lifespan=lifespan)
    app.state.engine, app.state.server = engine, state
    app.router.route_class = _Route
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    for kind in (ApiError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, error_response)
    pushes = {adapters.PUSH_PREFIX: (state.config.max_push_bytes, "--max-push-bytes")}
    app.add_middleware(BodyGate, limit=state.config.max_body_bytes, budget=state.bodies,  # inside the key check:
                       timeout=state.config.body_timeout,  # no key, no reading
                       limits=pushes if state.config.allow_runtime_lora else None)
    if state.config.api_key is not None:
        app.add_middleware(BearerAuth, key=state.config.api_key, open_paths=("/health", "/metrics"))
    app.add_middleware(CountResponses, metrics=state.metrics, routes=app.router.routes)  # last: outside the key check
    return app


# Routes: each binds a path to its handler.

async def _state(request: Request) -> ServerState:  # async: FastAPI runs a plain function on a worker thread
    CLIENT.set(request.client.host if request.client else None)  # (the handler runs in this task: it sees it)
    return request.app.state.server


State = Annotated[ServerState, Depends(_state)]


async def health(state: State):
    """200 while the engine can serve; 503, saying why, once it cannot (gone, or a core silent past
    ``health_timeout``)."""
    problem = state.health()
    if problem is not None:
        raise ApiError(503, problem)
    return {"status": "ok"}


async def metrics(state: State):
    return Response(state.metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)


async def version():
    return {"version": lorakit.__version__}


async def models(state: State):
    return openai.models(state)


async def model(model_id: str, state: State):
    return openai.model(model_id, state)


async def completions(body: CompletionBody, request: Request, state: State):
    return await respond(request, await openai.completions(body, state), state.in_flight)


async def chat(body: ChatBody, request: Request, state: State):
    return await respond(request, await openai.chat(body, state), state.in_flight)


async def generate(body: sglang.GenerateBody, request: Request, state: State):
    return await respond(request, await sglang.generate(body, state), state.in_flight)


async def load_lora_adapter(body: LoadBody, state: State):
    return await adapters.load(body, state)


async def unload_lora_adapter(body: UnloadBody, state: State):
    return await adapters.unload(body, state)


async def push_lora_adapter(lora_name: str, request: Request, state: State):
    body = request.scope.get(BODY_KEY)  # as BodyGate read it: 84 MB not joined into bytes again
    return await adapters.push(lora_name, await request.body() if body is None else body, state,
                               request.headers.get("content-type", ""),
                               request.client.host if request.client is not None else None,
                               request.query_params.get("version"))


ROUTES = [("GET", "/health", health), ("GET", "/metrics", metrics), ("GET", "/version", version),
          ("GET", "/v1/models", models), ("GET", "/v1/models/{model_id:path}", model),
          ("POST", "/v1/completions", completions), ("POST", "/v1/chat/completions", chat),
          ("POST", "/generate", generate), ("POST", "/v1/load_lora_adapter", load_lora_adapter),
          ("POST", "/v1/unload_lora_adapter", unload_lora_adapter),
          ("PUT", adapters.PUSH_PREFIX + "{lora_name}", push_lora_adapter),
          ("POST", "/tokenize", tokenize.tokenize_route), ("POST", "/detokenize", tokenize.detokenize_route),
          ("GET", "/tokenizer_info", tokenize.tokenizer_info_route)]


# Errors: every one is an ApiError, in OpenAI's shape.

async def error_response(request: Request, e: Exception) -> JSONResponse:
    """The response to whatever a route raised: an ApiError, a body that does not validate, an unknown path (404)
    or method (405), or a bug (500, its traceback logged)."""
    if isinstance(e, _BadBody):
        e = e.error
    elif isinstance(e, RequestValidationError):
        errors = e.errors()  # of a union: one per member; a length or value check's is the one to name
        first = next((x for x in errors if x.get("type") == "value_error"), errors[0] if errors else {})
        where = ".".join(str(p)[:100] for p in first.get("loc", ()) if p != "body" and not _member(p))[:300]
        if first.get("type") == "json_invalid":
            e = ApiError(400, "the request body is not valid JSON")
        else:
            e = ApiError(400, f"invalid request: {where or 'body'}: {first.get('msg', 'bad value')}", where or None)
    elif isinstance(e, StarletteHTTPException):
        e = ApiError(e.status_code, {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed "
                                     f"on {request.url.path}"}.get(e.status_code, str(e.detail)))
    elif not isinstance(e, ApiError):
        logger.exception("an unexpected error on %s %s", request.method, request.url.path)
        e = ApiError(500, f"internal error ({type(e).__name__}); the server log has the details")
    return JSONResponse(e.body(), e.status, headers=e.headers or None)


def _member(part) -> bool:
    """Whether a part of a validation error's location names a union's member ("str", "list[int]"), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))


class _BadBody(StarletteHTTPException):
    """A body ``parse_body`` refused: FastAPI lets an HTTPException out of its body parsing (any other error it turns
    into "There was an error parsing the body"); ``error_response`` answers with the ApiError it carries."""

    def __init__(self, error: ApiError):
        super().__init__(error.status, error.message)
        self.error = error


class _JsonRequest(Request):
    """A request whose JSON body is parsed by ``parse_body``, with the cyclic garbage collector paused: parsing a body
    of a million small lists spent seconds in collections (json.loads holds the GIL: on any thread, no stream moves
    meanwhile)."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._json = parse_body(body)
            except ApiError as e:
                raise _BadBody(e) from None
            finally:
                if collecting:
                    gc.enable()
        return self._json


class _Route(APIRoute):
    """Every route reads its body through ``_JsonRequest``."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_JsonRequest(request.scope, request.receive))
        return route
