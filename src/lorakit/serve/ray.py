"""lorakit behind Ray Serve: N replicas of the engine, each adapter a multiplexed model id (``pip install lorakit[ray]``).

    lorakit serve-ray --replicas 2 --model DIR --lora-root /adapters --adapters-per-replica 8

A ``Router`` reads each request's adapter and sends it, through Ray's multiplexing, to a replica that holds it (or
loads it by name, ``lorakit.serve.resolver``); each replica runs an in-process engine behind lorakit's own FastAPI
app, so the routes, checks and errors are those of ``lorakit serve``. An adapter pushed to the router
(``PUT /v1/lora_adapters/NAME``) is numbered there, checked by one replica and kept in Ray's object store; every
replica a request for it reaches installs it first under the same number. Routing, failures, metrics:
docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import ray
    from ray import serve
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("lorakit.serve.ray needs Ray Serve: pip install 'lorakit[ray]' (or 'ray[serve]')") from e

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lorakit.serve.auth import authorized
from lorakit.serve.protocol import ApiError, parse_version
from lorakit.serve.streaming import DONE, event

logger = logging.getLogger("lorakit.serve.ray")

__all__ = ["FleetConfig", "build_app", "run_fleet"]

ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
PUSH_PREFIX = "/v1/lora_adapters/"  # lorakit serve's pushes (serve/adapters.py): numbered by the router
REPLICA_HEADER = "x-lorakit-replica"  # on every response: the Ray Serve replica that answered
REPLICA_FAILED = "the replica serving this request failed; retry"
STOP_S = 60  # after Ctrl-C: how long Serve and Ray get to stop before the process leaves without them


@dataclass
class FleetConfig:
    """Everything a replica needs to build its engine and app (plain values: it travels to Ray's workers).

    model: a transformers model folder (None: the bundled model); device/dtype: None for auto; engine: EngineConfig
    fields; serve: ServeConfig fields (limits, model_name, api_key); adapters: name -> folder, registered on every
    replica at start; lora_roots: folders adapters are resolved in by name; cache: a folder shared by the replicas
    that resolved adapters are copied into (None: read them in place); adapters_per_replica: Ray Serve's
    ``max_num_models_per_replica``; replica_cpus / replica_gpus: what Ray reserves per replica (GPUs: 1 when device
    is cuda unless given); metrics_dir: the folder where each node's replicas add up their metrics (None: a new
    temporary one; created on every node that lacks it)."""

    model: str | None = None
    device: str | None = "cpu"
    dtype: str | None = None
    engine: dict = field(default_factory=dict)
    serve: dict = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    lora_roots: list[str] = field(default_factory=list)
    cache: str | None = None
    replicas: int = 2
    adapters_per_replica: int = 8
    replica_cpus: float = 1.0
    replica_gpus: float | None = None  # None: 1 when device is cuda, else 0
    metrics_dir: str | None = None

    def __post_init__(self):
        for name in ("replicas", "adapters_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FleetConfig.{name} must be an int >= 1, got {value!r}")
        if self.replica_gpus is None:
            self.replica_gpus = 1.0 if (self.device or "").startswith("cuda") else 0.0


def adapter_of(method: str, path: str, body: bytes, base_name: str) -> str:
    """The adapter a request asks for ("" for the base model or when the body names none): the JSON body's
    ``model``, or /generate's ``lora_path`` when it names one adapter for every prompt."""
    if method != "POST" or not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""  # the replica's app answers the malformed body with its usual 400
    if not isinstance(data, dict):
        return ""
    name = data.get("lora_path") if path.rstrip("/").endswith("/generate") else data.get("model")
    if isinstance(name, list):
        distinct = {n for n in name if isinstance(n, str)}
        name = distinct.pop() if len(distinct) == 1 else None
    if isinstance(name, str) and "@" in name and name != base_name:  # NAME@N: a version of NAME, on NAME's replica
        name = name.rpartition("@")[0]
    return name if isinstance(name, str) and name != base_name and len(name) <= 128 else ""


class _Held:
    """An adapter a replica holds for Ray Serve's multiplexing; unregistered when Ray evicts it (``__del__``)."""

    def __init__(self, replica: "Replica", name: str):
        self.replica, self.name = replica, name
        self._released = False

    def __del__(self):
        if not self._released:
            self._released = True
            self.replica.release(self.name)


class Replica:
    """One engine and lorakit's FastAPI app; ``handle`` runs one HTTP request through the app (see the module)."""

    def __init__(self, config: FleetConfig):
        from prometheus_client import Counter

        from lorakit.engine.config import EngineConfig
        from lorakit.serve import metrics
        from lorakit.serve.app import create_app
        from lorakit.serve.model import load_engine, model_folder
        from lorakit.serve.resolver import LocalRoots, SharedCache
        from lorakit.serve.state import ServeConfig

        if config.metrics_dir:
            os.makedirs(config.metrics_dir, exist_ok=True)
            metrics.share_across_processes(config.metrics_dir)
        folder, name = model_folder(config.model)
        engine = load_engine(str(folder), config.device, config.dtype, EngineConfig(**config.engine), config.adapters)
        self.app = create_app(engine, ServeConfig(**({"model_name": name} | config.serve)))
        self.state = self.app.state.server
        self.state.start()
        self.fixed = set(config.adapters)  # registered at start: never evicted
        resolver = LocalRoots([Path(r) for r in config.lora_roots]) if config.lora_roots else None
        self.resolver = SharedCache(resolver, Path(config.cache)) if resolver and config.cache else resolver
        if self.resolver is not None:  # /v1/models and 404s list every adapter the fleet can serve
            self.state.on_request = self.resolver.names
        # In no registry: its value goes to the node's multiprocess folder, which any replica's /metrics adds up.
        self._loads_metric = Counter("lorakit_ray_adapter_loads", "Adapters the fleet's replicas loaded by name",
                                     registry=None)
        self._unloads_metric = Counter("lorakit_ray_adapter_unloads", "Adapters the fleet's replicas unloaded when "
                                       "Ray Serve evicted them (least recently used past adapters_per_replica)",
                                       registry=None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unloading: dict[str, concurrent.futures.Future] = {}  # evictions and unregisters under way
        # Ray's LRU evicts without knowing what runs: an evicted adapter stays registered while requests use it.
        self._in_use: collections.Counter[str] = collections.Counter()
        self._evicted: set[str] = set()  # unregister when its last request ends
        self._pushing: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.pushed: set[str] = set()  # names pushed to the fleet: kept (nothing to read them again from)

    async def push(self, name: str, version: int, body) -> dict:
        """Install the pushed adapter ``body`` (a safetensors push body, or Ray's reference to one) as version
        ``version`` of ``name`` unless this replica has it already; lorakit serve's answer to the push (its version
        and sha256), or its error as {"error": {...}, "status": N}. A replica holding a later version than the
        router's (a router that restarted and numbers from 1 again) refuses it (409) rather than answer for another
        content."""
        from lorakit.serve import adapters
        from lorakit.serve.protocol import ApiError

        async with self._pushing[name]:
            current = self.state.adapter_versions.get(name)
            if current is not None and current[0] == version:
                return {"status": "ok", "lora_name": name, "version": current[0], "sha256": current[1]}
            if current is not None and current[0] > version:
                e = ApiError(409, f"adapter {name!r}: a replica has version {current[0]}, above the {version} the "
                                  f"router gave this push (the router restarted?): push again with "
                                  f"?version={current[0] + 1} or above", "version")
                return {**e.body(), "status": e.status}
            if isinstance(body, ray.ObjectRef):
                body = await body
            try:
                if len(body) > self.state.config.max_push_bytes:
                    raise ApiError(413, f"the pushed adapter has {len(body)} bytes, more than --max-push-bytes "
                                        f"{self.state.config.max_push_bytes}", "body")
                answer = await adapters.push(name, body, self.state, version=str(version))
            except ApiError as e:
                return {**e.body(), "status": e.status}
            self.pushed.add(name)
            return answer

    async def load(self, name: str) -> _Held:
        """Hold ``name`` for a request (``build_app``'s replicas wrap this in Ray Serve's multiplexing)."""
        return await self.acquire(name)

    async def acquire(self, name: str) -> _Held:
        """Resolve and register ``name`` (Ray Serve's multiplexed loader calls this; see ``build_app``)."""
        from lorakit.peft import AdapterError

        self._loop = asyncio.get_running_loop()
        unloading = self._unloading.pop(name, None)
        if unloading is not None:  # evicted a moment ago and asked for again: let the eviction finish first
            await asyncio.wrap_future(unloading)
        self._evicted.discard(name)  # held again: keep it
        if name in self.fixed or name in self.state.adapters:
            return _Held(self, name)
        if self.resolver is None:
            raise AdapterError(f"adapter {name!r} is not registered and the fleet has no --lora-root to find it in")
        path = await asyncio.get_running_loop().run_in_executor(None, self.resolver.resolve, name)
        version = await self.state.register_adapter(name, path)
        self._loads_metric.inc()
        logger.info("replica %d loaded adapter %r (version %d)", os.getpid(), name, version)
        return _Held(self, name)

    def release(self, name: str) -> None:
        """Ray evicted ``name``: unregister it once no request of this replica uses it. Ray Serve calls the held
        object's ``__del__`` on a worker thread, so this is handed to the replica's event loop."""
        if name in self.fixed or name in self.pushed or self._loop is None or self._loop.is_closed():
            return
        self._unloading[name] = asyncio.run_coroutine_threadsafe(self._evict(name), self._loop)

    async def _evict(self, name: str) -> None:
        if self._in_use[name]:
            self._evicted.add(name)  # handle() unregisters it when its last request ends
        else:
            await self._unregister(name)

    async def _unregister(self, name: str) -> None:
        from lorakit.peft import AdapterError

        try:
            await self.state.unregister_adapter(name)
        except AdapterError:
            return
        self._unloads_metric.inc()
        logger.info("replica %d unloaded adapter %r", os.getpid(), name)

    async def handle(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                     name: str, pushed: tuple | None = None) -> AsyncIterator[dict | bytes]:
        """Run one request through the app: yields {"status", "headers"} first, then the body's chunks. ``pushed``:
        (version, body) of the adapter's latest push to the fleet, installed first where this replica lacks it."""
        self._in_use[name] += 1  # before the load: an eviction from here on waits for this request
        try:
            if name and pushed is not None:
                answer = await self.push(name, *pushed)
                if "error" in answer:
                    logger.warning("replica %d could not install pushed adapter %r: %s", os.getpid(), name, answer)
            if name:
                try:
                    await self.load(name)
                except Exception as e:  # noqa: BLE001 - the app answers for an adapter it does not have (404)
                    logger.info("adapter %r not loaded: %s", name, e)
            async for item in _asgi(self.app, method, path, query, headers, body):
                if isinstance(item, dict):  # the response's start: say which replica answers (logs, operators)
                    item["headers"].append((REPLICA_HEADER, _replica_id()))
                yield item
        finally:
            self._in_use[name] -= 1
            if not self._in_use[name] and name in self._evicted:  # acquire() waits for it, as for an eviction
                self._evicted.discard(name)
                self._unloading[name] = asyncio.run_coroutine_threadsafe(self._unregister(name), self._loop)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (tests call Replica directly)
        return str(os.getpid())


async def _asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes) -> AsyncIterator[dict | bytes]:
    """Call an ASGI app in-process and yield its response start and body chunks as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    sent = False
    disconnected = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await queue.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()  # raises what the app raised
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()


class Router:
    """The fleet's ingress: picks the adapter from the request and forwards the request to a replica holding it."""

    def __init__(self, replicas, base_name: str, fixed: list[str], api_key: str | None = None,
                 metrics_dir: str | None = None):
        from prometheus_client import Counter

        from lorakit.serve import metrics

        if metrics_dir:
            os.makedirs(metrics_dir, exist_ok=True)
            metrics.share_across_processes(metrics_dir)
        self.replicas = replicas
        self.base_name = base_name
        self.fixed = set(fixed)  # registered on every replica: no multiplexing needed
        self.api_key = api_key
        self.pushed: dict[str, tuple[int, object]] = {}  # name -> (version, its push body in Ray's object store)
        self._numbers: dict[str, int] = {}  # name -> the last version number given
        self._pushing: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.failures = Counter("lorakit_ray_replica_failures", "Requests whose replica failed: before its first byte "
                                "(retried once on another replica) or mid-answer (the stream ends with a 503 event)",
                                ["when"], registry=None)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        if (request.method == "POST" and path in ADMIN_PATHS) or path.startswith(PUSH_PREFIX):
            if self.api_key is not None and not authorized(request.headers.get("authorization"), self.api_key):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
            if path.startswith(PUSH_PREFIX) and request.method == "PUT":
                return await self.push(path[len(PUSH_PREFIX):], request, body)
            return _error(403, "a Ray fleet fetches adapters by name from its --lora-root folders; runtime loading "
                               "by path is off (put the adapter folder under a root and ask for it by name)")
        name = adapter_of(request.method, path, body, self.base_name)
        name = "" if name in self.fixed else name
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
        query = request.url.query.encode()
        for attempt in (1, 2):
            handle = self.replicas.options(stream=True, multiplexed_model_id=name)
            stream = handle.handle.remote(request.method, path, query, headers, body, name or "", self.pushed.get(name))
            try:
                head = await stream.__anext__()
                break
            except Exception as e:  # noqa: BLE001 - a replica that died before answering: once more, elsewhere
                self.failures.labels("before_answer").inc()
                logger.warning("replica failed before answering %s %s (attempt %d): %r", request.method, path,
                               attempt, e)
                if attempt == 2:
                    return _error(503, REPLICA_FAILED)
        status = head["status"]
        out_headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        streaming = "text/event-stream" in out_headers.get("content-type", "")

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the replica died mid-answer
                self.failures.labels("mid_answer").inc()
                logger.warning("replica failed mid-answer: %r", e)
                if streaming:  # as lorakit serve ends a stream whose engine died
                    yield event(ApiError(503, REPLICA_FAILED).body()) + DONE

        return StreamingResponse(rest(), status_code=status, headers=out_headers)


    async def push(self, name: str, request: Request, body: bytes) -> Response:
        """A push to the fleet: numbered here (the name's last number plus one, or the query's ``version``), checked
        and installed by one replica, whose answer is the push's; kept in Ray's object store for every replica a
        request for it reaches (``Replica.handle``). Only the latest push of a name is kept."""
        from lorakit.serve.push import IPC_CONTENT_TYPE

        if IPC_CONTENT_TYPE in request.headers.get("content-type", ""):
            return _error(400, "a Ray fleet takes pushes as a safetensors body (its replicas may be on other hosts): "
                               "push without cuda_ipc")
        try:
            asked = parse_version(request.query_params.get("version"))
        except ApiError as e:
            return _error(e.status, e.message)
        async with self._pushing[name]:
            last = self._numbers.get(name, 0)
            version = last + 1 if asked is None else asked
            if version <= last:
                return _error(409, f"adapter {name!r}: version {version} is not above its last version {last}; "
                                   f"version numbers are never reused: give one above {last}, or none")
            ref = ray.put(body)
            try:
                answer = await self.replicas.options(multiplexed_model_id=name).push.remote(name, version, ref)
            except Exception as e:  # noqa: BLE001 - a replica that died checking it
                logger.warning("replica failed checking pushed adapter %r: %r", name, e)
                return _error(503, REPLICA_FAILED)
            if "error" in answer:
                status = answer.pop("status")
                return JSONResponse(answer, status_code=status)
            self._numbers[name] = version
            self.pushed[name] = (version, ref)
            return JSONResponse(answer)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(ApiError(status, message).body(), status_code=status)


def build_app(args: dict | FleetConfig):
    """The Ray Serve application: a Router in front of ``replicas`` Replicas (``serve run lorakit.serve.ray:build_app``
    calls this with the config file's ``args``, whose keys are FleetConfig's fields)."""
    config = args if isinstance(args, FleetConfig) else FleetConfig(**args)
    if config.metrics_dir is None:
        config = dataclasses.replace(config, metrics_dir=tempfile.mkdtemp(prefix="lorakit-ray-metrics-"))

    class MultiplexedReplica(Replica):
        @serve.multiplexed(max_num_models_per_replica=config.adapters_per_replica)
        async def load(self, name: str) -> _Held:
            return await self.acquire(name)

    replica = serve.deployment(MultiplexedReplica, name="LorakitReplica", num_replicas=config.replicas,
                               ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
                               max_ongoing_requests=1024)
    router = serve.deployment(Router, name="LorakitRouter", ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=4096)
    base_name = config.serve.get("model_name") or _model_name(config.model)
    return router.bind(replica.bind(config), base_name, sorted(config.adapters), config.serve.get("api_key"),
                       config.metrics_dir)


def _model_name(model: str | None) -> str:
    from lorakit.serve.model import model_folder

    return model_folder(model)[1]


def run_fleet(config: FleetConfig, host: str = "127.0.0.1", port: int = 8000, *, num_cpus: int | None = None,
              blocking: bool = True):
    """Start Ray (a local cluster unless RAY_ADDRESS names one), Ray Serve's proxy on host:port, and the fleet."""
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    try:
        return serve.run(build_app(config), name="lorakit", route_prefix="/", blocking=blocking)
    except KeyboardInterrupt:  # Ctrl-C, once the fleet runs or while it still starts: stopped, without a traceback
        _stop()
        return None


def _stop() -> None:
    """Serve and Ray (the local cluster ``run_fleet`` started, or the connection to RAY_ADDRESS's) stopped within
    STOP_S; past it, the process leaves without them: Ray retries a dead controller's graceful shutdown forever, and
    Ctrl-C reaches every process of the cluster it started at once."""
    stopper = threading.Thread(target=lambda: (serve.shutdown(), ray.shutdown()), name="lorakit-stop", daemon=True)
    stopper.start()
    stopper.join(STOP_S)
    if stopper.is_alive():
        logger.warning("Ray Serve did not stop within %d s of Ctrl-C; leaving without it", STOP_S)
        logging.shutdown()
        os._exit(130)
