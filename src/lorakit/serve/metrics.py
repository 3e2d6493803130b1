"""The server's Prometheus metrics, in a registry of their own (one per app).

Every HTTP response is counted once, by ``CountResponses`` at the ASGI level, whatever produced it (a handler,
FastAPI's validation, the API-key check, the router's 404 and 405), under the route's path template or
"unmatched". Generation is counted per adapter (the base model under its served name) by ``Metrics.request``.
Adapter loads, evictions and residency, and the engine's gauges, are read when scraped, without a lock.

The engine's load is also exported under vLLM's names (``vllm:num_requests_running``, ``vllm:lora_requests_info``, ...),
as the routers that pick a server by them read them (the Gateway API Inference Extension, llm-d): see docs/metrics.md.

The series are bounded by the adapters registered now: an adapter's series go when it is unregistered
(``Metrics.prune``, at each unregister and each scrape), and a scrape shows no series of an adapter that is gone
(with several API server processes, whose values live in files, they are left out of the answer).
"""

from __future__ import annotations

import bisect
import json
import os
import time

import prometheus_client as prom
from prometheus_client import multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from lorakit.engine import RequestOutput
from lorakit.engine.outputs import FinishReason
from lorakit.frontend.client import EngineClient
from lorakit.serve.protocol import error_status
from lorakit.serve.streaming import ERROR_EVENT

__all__ = ["CountResponses", "Metrics"]

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: where each process writes its values
UNMATCHED = "unmatched"  # the endpoint label of every path no route matches (a scanner cannot add labels)
TIERS = ("gpu", "cpu", "disk")


class Metrics:
    """The series (see docs/serve.md): HTTP responses and failed streams by endpoint; per adapter, generation
    requests by finish reason, tokens, time to first token and per output token, loads, evictions, residency."""

    def __init__(self, engine: EngineClient, base_label: str = ""):
        r = self.registry = prom.CollectorRegistry()
        self.responses = prom.Counter("lorakit_requests", "HTTP responses by endpoint (route template) and status",
                                      ["endpoint", "status"], registry=r)
        self.stream_errors = prom.Counter(
            "lorakit_stream_errors", "Streamed responses (status 200) that ended in an error: the error event's "
            "code, 499 when the client left, 500 when the server failed", ["endpoint", "status"], registry=r)
        self.finished = prom.Counter("lorakit_adapter_requests", "Generation requests (one per prompt and choice) by "
                                     "how they ended: stop, length, abort (client gone), error",
                                     ["adapter", "finish_reason"], registry=r)
        self.tokens = prom.Counter("lorakit_tokens", "Tokens by kind and adapter: prompt (of requests that got a "
                                   "first token), generation", ["kind", "adapter"], registry=r)
        self.ttft = prom.Histogram("lorakit_time_to_first_token_seconds", "Time to first token", ["adapter"],
                                   registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tpot = prom.Histogram("lorakit_time_per_output_token_seconds", "Time between output tokens",
                                   ["adapter"], registry=r,
                                   buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.5))
        self._engine = _EngineCollector(engine, base_label)
        r.register(self._engine)
        self._client, self._base_label = engine, base_label
        self._series: dict[str, set[tuple]] = {}  # adapter label -> the (metric, label values) made for it

    def request(self, adapter: str) -> RequestMetrics:
        """The metrics of one generation request for ``adapter`` (the label), its clock started now."""
        return RequestMetrics(self, adapter)

    def labels(self, metric, *values: str):
        """``metric.labels(*values)``, remembered under its adapter label (the last value but for ``finished``,
        whose adapter comes first) so ``prune`` can remove it."""
        adapter = values[0] if metric is self.finished else values[-1]
        self._series.setdefault(adapter, set()).add((metric, values))
        return metric.labels(*values)

    def live(self) -> set[str]:
        """The adapter labels that may have series: the registered adapters and the base model."""
        return {*self._client.adapters, self._base_label}

    def prune(self) -> None:
        """Remove the series of every adapter label that is no longer registered."""
        live = self.live()
        for adapter in [a for a in self._series if a not in live]:
            for metric, values in self._series.pop(adapter):
                try:
                    metric.remove(*values)
                except KeyError:
                    pass

    def render(self) -> bytes:
        """The series in Prometheus' text format; with several API server processes (``multiprocess``), every
        process's counters and histograms added up, and the engine's gauges once."""
        self.prune()
        if not os.environ.get(MULTIPROCESS_ENV):
            return prom.generate_latest(_Only(self.live(), self.registry))
        registry = prom.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return prom.generate_latest(_Only(self.live(), registry, self._engine))


class _Only:
    """Collectors' families without the samples of adapters outside ``live``: other processes' series, kept in their
    files, and the engine's stats as of its last step (an idle engine's still name an adapter unloaded since)."""

    def __init__(self, live: set[str], *collectors):
        self.live, self.collectors = live, collectors

    def collect(self):
        for family in (c for collector in self.collectors for c in collector.collect()):
            family.samples = [s for s in family.samples if s.labels.get("adapter", self.live) in self.live or
                              "adapter" not in s.labels]
            yield family


class RequestMetrics:
    """A context manager around one generation request: feed it each RequestOutput (``update``); on exit it counts
    how the request ended (its finish reason; ERROR on an exception; ABORT when cancelled or closed early)."""

    def __init__(self, metrics: Metrics, adapter: str):
        self._metrics, self._adapter = metrics, adapter  # an adapter's series all appear at its first request
        self._ttft, self._tpot = metrics.labels(metrics.ttft, adapter), metrics.labels(metrics.tpot, adapter)
        self._prompt, self._generated = (metrics.labels(metrics.tokens, kind, adapter)
                                         for kind in ("prompt", "generation"))
        self._last = time.monotonic()
        self._first = True
        self._finish_reason: FinishReason | None = None

    def update(self, out: RequestOutput) -> None:
        if out.token_ids:
            now = time.monotonic()
            n = len(out.token_ids)  # more than one when the stream caught up after falling behind
            if self._first:  # its prompt has been read: count it
                self._ttft.observe(now - self._last)
                self._prompt.inc(out.num_prompt_tokens)
                n -= 1
            if n:
                observe(self._tpot, (now - self._last) / len(out.token_ids), n)
            self._first, self._last = False, now
            self._generated.inc(len(out.token_ids))
        if out.finished:
            self._finish_reason = out.finish_reason

    def __enter__(self) -> RequestMetrics:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.end(self._finish_reason if kind is None else
                 FinishReason.ERROR if issubclass(kind, Exception) else FinishReason.ABORT)

    def end(self, reason: FinishReason | None) -> None:
        """Count the request as ended with ``reason`` (None: it did not finish, ABORT); once."""
        self._metrics.labels(self._metrics.finished, self._adapter, str(reason or FinishReason.ABORT)).inc()


class _EngineCollector:
    """Read at scrape time from the engine client's stats (as of the engine's last step), no lock taken."""

    def __init__(self, engine: EngineClient, base_label: str = ""):
        self.engine = engine
        self.base_label = base_label  # the adapter label of the base model's requests (the served model's name)

    def collect(self):
        stats = self.engine.stats()
        yield GaugeMetricFamily("lorakit_engine_pid", "Process id of the engine (the server's own when the engine runs "
                                "on a thread of it)", value=stats.pid)
        yield GaugeMetricFamily("lorakit_requests_running", "Requests being generated", value=stats.running)
        yield GaugeMetricFamily("lorakit_queue_length", "Requests waiting for a batch", value=stats.waiting)
        yield GaugeMetricFamily("lorakit_engine_steps", "Engine steps since start", value=stats.steps)
        yield GaugeMetricFamily("lorakit_engine_step_seconds", "Wall time inside engine steps since start",
                                value=stats.step_seconds)
        yield GaugeMetricFamily("lorakit_engine_gpu_seconds", "Device time of the engine steps' forwards since start "
                                "(CUDA events; 0 on the CPU)", value=stats.gpu_seconds)
        for name, counts, help_ in (
            ("lorakit_adapter_loads", stats.loads_by_adapter, "Adapter uploads into GPU slots"),
            ("lorakit_adapter_evictions", stats.evictions_by_adapter, "Adapters evicted from GPU slots"),
        ):
            family = CounterMetricFamily(name, help_, labels=["adapter"])
            for adapter, n in sorted(dict(counts).items()):
                family.add_metric([adapter], n)
            yield family
        yield from self._prefix(stats)
        resident = GaugeMetricFamily("lorakit_adapter_resident", "1 for the tier that holds each registered adapter "
                                     "(gpu: a slot, cpu: the CPU cache, disk: neither), else 0",
                                     labels=["adapter", "tier"])
        for adapter, tier in sorted(stats.residency.items()):
            for t in TIERS:
                resident.add_metric([adapter, t], float(t == tier))
        yield resident
        yield from self._load(stats)
        yield from self._vllm(stats)

    def _load(self, stats):
        """Requests running and waiting by adapter, the KV cache's usage, the GPU adapter slots."""
        for name, counts, help_ in (
            ("lorakit_adapter_requests_running", stats.running_by_adapter, "Requests being generated, by adapter"),
            ("lorakit_adapter_requests_waiting", stats.waiting_by_adapter, "Requests waiting for a batch, by adapter"),
        ):
            family = GaugeMetricFamily(name, help_, labels=["adapter"])
            for key, n in sorted(counts.items()):
                family.add_metric([key or self.base_label], n)
            yield family
        yield GaugeMetricFamily("lorakit_kv_cache_usage", "Share of the KV cache's blocks held by requests (0..1)",
                                value=stats.kv_usage)
        yield GaugeMetricFamily("lorakit_max_loras", "GPU adapter slots: adapters that can run in one batch",
                                value=stats.max_loras)

    def _vllm(self, stats):
        """vLLM's series that LoRA-aware routers read, with vLLM's labels: the load gauges by ``model_name`` (the
        served name) and ``engine``, and ``vllm:lora_requests_info``, one sample whose value is the time of the
        scrape (a router takes the sample with the largest) and whose labels list the adapters of the running and
        the waiting requests (comma-separated, registered ones only) and the GPU slots."""
        for name, help_, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches", stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", stats.kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name). 1 means 100 percent usage",
             stats.kv_usage),
        ):
            family = GaugeMetricFamily(name, help_, labels=["model_name", "engine"])
            family.add_metric([self.base_label, "0"], value)
            yield family
        registered = self.engine.adapters
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(stats.max_loras), _names(stats.running_by_adapter, registered),
                         _names(stats.waiting_by_adapter, registered)], time.time())
        yield info

    def _prefix(self, stats):
        """The prefix cache: prompt tokens and those served from the cache, by adapter; hit rates; blocks; evictions."""
        label = {k: k or self.base_label for k in stats.prefix_prompt_tokens}
        for name, counts, help_ in (
            ("lorakit_prefix_cache_prompt_tokens", stats.prefix_prompt_tokens, "Prompt tokens of admitted requests"),
            ("lorakit_prefix_cache_hit_tokens", stats.prefix_cached_tokens,
             "Prompt tokens served from the prefix cache (computed by an earlier request with the same weights)"),
        ):
            family = CounterMetricFamily(name, help_, labels=["adapter"])
            for key, n in sorted(counts.items()):
                family.add_metric([label[key]], n)
            yield family
        rate = GaugeMetricFamily("lorakit_prefix_cache_adapter_hit_rate", "Share of an adapter's prompt tokens served "
                                 "from the prefix cache since start", labels=["adapter"])
        for key, n in sorted(stats.prefix_prompt_tokens.items()):
            rate.add_metric([label[key]], stats.prefix_cached_tokens.get(key, 0) / n if n else 0.0)
        yield rate
        total = sum(stats.prefix_prompt_tokens.values())
        yield GaugeMetricFamily("lorakit_prefix_cache_hit_rate", "Share of all prompt tokens served from the prefix "
                                "cache since start", value=sum(stats.prefix_cached_tokens.values()) / total if total
                                else 0.0)
        yield GaugeMetricFamily("lorakit_prefix_cache_blocks", "KV-cache blocks held in the prefix cache",
                                value=stats.prefix_cached_blocks)
        yield CounterMetricFamily("lorakit_prefix_cache_evictions", "Cached KV blocks evicted to make room",
                                  value=stats.prefix_evictions)

def _names(counts: dict[str, int], registered) -> str:
    """The adapters of ``counts`` registered now, comma-separated as vLLM lists them (the base model, "", left out)."""
    return ",".join(sorted(name for name in counts if name and name in registered))


def observe(histogram, value: float, times: int) -> None:
    """``histogram.observe(value)`` ``times`` times, in one update of its bucket and sum (an output that carries
    several tokens counts each; per output, not per token). prometheus_client's Histogram keeps a value per
    bucket (``_buckets``, not cumulative), ``_upper_bounds`` and ``_sum``, in this process or in its multiprocess
    files alike; a histogram without them is observed one by one."""
    buckets, bounds = getattr(histogram, "_buckets", None), getattr(histogram, "_upper_bounds", None)
    if buckets is None or bounds is None or not hasattr(histogram, "_sum"):
        for _ in range(times):
            histogram.observe(value)
        return
    histogram._sum.inc(value * times)
    buckets[bisect.bisect_left(bounds, value)].inc(times)


class CountResponses:
    """Counts every HTTP response by endpoint and status, and streams that end in an error (an SSE error event,
    the client leaving, an exception). Plain ASGI, so streamed chunks pass straight through; add it last (it
    must sit outside the API-key check to count its 401s)."""

    def __init__(self, app, metrics: Metrics, routes: list):
        self.app, self.metrics, self.routes = app, metrics, routes  # routes: the app's list, read per request

    def endpoint(self, scope) -> str:
        """The path template of the route the router will pick (a method mismatch, 405, still names it)."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
            if match is Match.PARTIAL and partial is None:
                partial = route.path
        return partial or UNMATCHED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.endpoint(scope)
        status, events, done = None, False, False

        async def counted(message):
            nonlocal status, events, done
            if message["type"] == "http.response.start":
                status = message["status"]
                events = any(k == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", ()))
                self.metrics.responses.labels(endpoint, str(status)).inc()
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if events and body[:len(ERROR_EVENT)] == ERROR_EVENT:
                    self.metrics.stream_errors.labels(endpoint, _error_code(body)).inc()
                done = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as e:
            code = "499" if isinstance(e, (ClientDisconnect, OSError)) else "500"
            if status is None:  # the server's outermost handler answers 500
                self.metrics.responses.labels(endpoint, code).inc()
            elif not done:
                self.metrics.stream_errors.labels(endpoint, code).inc()
            raise
        if status is not None and not done:  # the stream was cut short: its client left
            self.metrics.stream_errors.labels(endpoint, "499").inc()


def _error_code(event: bytes) -> str:
    """The HTTP status an SSE error event ``data: {"error": {..., "code": ...}}`` stands for, else "500"."""
    try:
        code = json.loads(bytes(event)[len(b"data: "):])["error"].get("code")
    except (ValueError, KeyError, AttributeError, TypeError):
        return "500"
    return str(error_status(code)) if code is None or isinstance(code, str) else "500"


def share_across_processes(folder: str) -> None:
    """Keep this process's counters and histograms in ``folder``, where every API server process keeps its own and a
    scrape of any of them adds them up. Call it before any series is created; the processes it starts (spawned)
    inherit it. prometheus_client reads its setting when imported, so this process's is set here too."""
    os.environ[MULTIPROCESS_ENV] = folder
    values.ValueClass = values.MultiProcessValue()
