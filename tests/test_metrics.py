"""/metrics against a live server: a known mix of requests (successes on the base and adapters, 400, 401, 404, 405,
429, 499, 500, a stream that fails midway), then the Prometheus text parsed and every series checked to count
exactly what was sent: responses by endpoint and status, and per adapter requests, tokens, latency histograms,
loads, evictions and residency."""

import json
import shutil
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from _serve_helpers import start
from helpers import wait_for

KEY = {"authorization": "Bearer secret"}
PROMPT = "What is the capital of France?"


def scrape(url) -> dict[str, dict[tuple, float]]:
    """{sample name: {((label, value), ...) sorted: value}} of the server's /metrics."""
    r = httpx.get(f"{url}/metrics")  # open without the key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    series: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return series


def by(series, name, *labels, skip=()) -> dict:
    """One series as {label values (in the order of ``labels``): value}, without the label values in ``skip``."""
    out = {}
    for key, value in series.get(name, {}).items():
        labelled = dict(key)
        values = tuple(labelled[label] for label in labels)
        if not set(values) & set(skip):
            out[values[0] if len(values) == 1 else values] = value
    return out


def post(url, path, body, headers=KEY, **kw):
    return httpx.post(url + path, content=body if isinstance(body, str) else json.dumps(body),
                      headers={"content-type": "application/json", **headers}, timeout=60, **kw)


def test_every_response_and_every_adapter_is_counted_exactly(world):
    _, _, root, adapters = world
    nan = root / "nan"  # changed on disk after its load and dropped from the CPU tier: its stream fails at first use
    shutil.copytree(adapters["sql"], nan)
    # A CPU tier that holds v2 (27 KiB) and nothing beside it.
    live = start(world, adapters=("sql", "chat", "v2"), engine_options={"cpu_budget_bytes": 28 << 10},
                 api_key="secret", allow_runtime_lora=True)
    engine = live.server.config.app.state.engine
    url = live.url
    sent = Counter()  # (endpoint, status) -> responses
    used = {}  # adapter label -> [(prompt tokens, generated tokens, finish reason)] of each generation request

    def check(response, endpoint, status):
        assert response.status_code == status, response.text
        sent[endpoint, str(status)] += 1
        return response

    try:
        # Successes: every request generates exactly max_tokens (ignore_eos), on the base and three adapters.
        for model in ("tiny", "sql", "v2"):
            out = check(post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}), "/v1/completions", 200)
            usage = out.json()["usage"]
            used.setdefault(model, []).append((usage["prompt_tokens"], usage["completion_tokens"], "length"))
        out = check(post(url, "/v1/chat/completions", {"model": "chat", "max_tokens": 4, "ignore_eos": True,
                                                       "messages": [{"role": "user", "content": "hello world"}]}),
                    "/v1/chat/completions", 200)
        usage = out.json()["usage"]
        used["chat"] = [(usage["prompt_tokens"], usage["completion_tokens"], "length")]
        with httpx.stream("POST", f"{url}/v1/completions", headers=KEY, timeout=60, json={
                "model": "sql", "prompt": "hello", "max_tokens": 6, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
        sent["/v1/completions", "200"] += 1
        used["sql"].append((len(engine.prompt_ids("hello", "sql")), 6, "length"))
        out = check(post(url, "/generate", {"text": ["hello", PROMPT], "lora_path": ["chat", None],
                                            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}),
                    "/generate", 200)
        for label, result in zip(("chat", "tiny"), out.json()):
            meta = result["meta_info"]
            used[label].append((meta["prompt_tokens"], meta["completion_tokens"], "length"))
        # A stream that fails midway: its status is 200, its error event a 400.
        check(post(url, "/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": str(nan)}),
              "/v1/load_lora_adapter", 200)
        weights = load_file(nan / "adapter_model.safetensors")
        weights[next(k for k in weights if "lora_A" in k)][0, 0] = float("nan")
        save_file(weights, nan / "adapter_model.safetensors")
        out = check(post(url, "/v1/completions", {"model": "v2", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                  "ignore_eos": True}), "/v1/completions", 200)  # drops nan's image
        used["v2"].append((out.json()["usage"]["prompt_tokens"], 2, "length"))
        with httpx.stream("POST", f"{url}/v1/completions", headers=KEY, timeout=60, json={
                "model": "nan", "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
            events = list(r.iter_lines())
            assert r.status_code == 200 and '"code":null' in events[0] and events[-2] == "data: [DONE]"
        sent["/v1/completions", "200"] += 1
        used["nan"] = [(0, 0, "error")]
        # Refusals, from every layer: FastAPI's validation, the handlers, the API-key check, the router.
        check(post(url, "/v1/completions", "{not json"), "/v1/completions", 400)
        check(post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -2}), "/v1/completions",
              400)
        check(post(url, "/generate", {"text": "hi", "sampling_params": {"min_p": 0.5}}), "/generate", 400)
        check(httpx.get(f"{url}/v1/models"), "/v1/models", 401)
        check(post(url, "/v1/completions", {"model": "nope", "prompt": "hi"}), "/v1/completions", 404)
        check(httpx.get(f"{url}/v1/nope", headers=KEY), "unmatched", 404)
        check(httpx.get(f"{url}/wp-login.php?x=1", headers=KEY), "unmatched", 404)
        check(httpx.get(f"{url}/v1/completions", headers=KEY), "/v1/completions", 405)
        check(httpx.get(f"{url}/v1/models", headers=KEY), "/v1/models", 200)

        series = scrape(url)
        assert by(series, "lorakit_requests_total", "endpoint", "status", skip=("/metrics",)) == sent
        assert by(series, "lorakit_stream_errors_total", "endpoint", "status") == {("/v1/completions", "400"): 1}
        finished = Counter()
        for label, requests in used.items():
            for _, _, reason in requests:
                finished[label, reason] += 1
        assert by(series, "lorakit_adapter_requests_total", "adapter", "finish_reason") == finished
        expect_tokens = {}
        for label, requests in used.items():  # prompt tokens: those of requests that got a first token
            expect_tokens[label, "prompt"] = sum(p for p, g, _ in requests if g)
            expect_tokens[label, "generation"] = sum(g for _, g, _ in requests)
        assert by(series, "lorakit_tokens_total", "adapter", "kind") == expect_tokens
        assert by(series, "lorakit_time_to_first_token_seconds_count", "adapter") == {
            label: sum(1 for _, g, _ in r if g) for label, r in used.items()}  # one first token per request
        assert by(series, "lorakit_time_per_output_token_seconds_count", "adapter") == {
            label: sum(max(g - 1, 0) for _, g, _ in r) for label, r in used.items()}  # one gap per further token
        # Three adapters through two GPU slots: sql, v2, chat, sql again, v2 again; each load after two evicted one.
        loads = by(series, "lorakit_adapter_loads_total", "adapter")
        evictions = by(series, "lorakit_adapter_evictions_total", "adapter")
        assert loads == engine.pool.stats.loads_by_adapter and set(loads) == {"sql", "v2", "chat"}
        assert evictions == engine.pool.stats.evictions_by_adapter and sum(evictions.values()) == sum(
            loads.values()) - 2
        resident = by(series, "lorakit_adapter_resident", "adapter", "tier")
        tiers = {adapter: tier for (adapter, tier), value in resident.items() if value == 1}
        assert len(resident) == 3 * 4 and sum(resident.values()) == 4  # four adapters, one tier each
        assert tiers == engine.pool.residency() and tiers["nan"] == "disk"
        assert sorted(tier for tier in tiers.values() if tier == "gpu") == ["gpu", "gpu"]
    finally:
        live.close()


def test_429_499_and_500_and_streams_the_client_leaves(world):
    live = start(world, adapters=("v2",), max_concurrent=1)
    engine = live.server.config.app.state.engine
    url = live.url
    step = engine.step
    engine.step = lambda: (time.sleep(0.03), step())[1]
    try:
        slow = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={"model": "v2", "stream": True, **slow}) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(lines).startswith("data: {")  # the one place in flight is taken
                busy = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
                assert busy.status_code == 429
                busy = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True},
                                  timeout=30)
                assert busy.status_code == 429 and "retry-after" in busy.headers
                assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        # The client left the stream: counted once the server notices, which frees its place.
        wait_for(lambda: by(scrape(url), "lorakit_stream_errors_total", "endpoint", "status"),
                 timeout=20.0, poll=0.05)
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a plain request
            httpx.post(f"{url}/generate", json={"text": "hello", "lora_path": "v2", "sampling_params": {
                "max_new_tokens": 100, "ignore_eos": True}}, timeout=0.5)
        wait_for(lambda: ("/generate", "499") in by(scrape(url), "lorakit_requests_total", "endpoint", "status"),
                 timeout=20.0, poll=0.05)
        wait_for(lambda: not engine.has_unfinished(), timeout=20.0, poll=0.05)
        def broken():
            raise RuntimeError("a step failed")  # every request in it fails

        engine.step = broken
        failed = httpx.post(f"{url}/v1/completions", json={"model": "v2", "prompt": "hi"}, timeout=30)
        assert failed.status_code == 503 and "the engine step failed" in failed.json()["error"]["message"]  # as the
        # engine core process answers it: the server's fault, and worth a retry
    finally:
        engine.step = step
    try:
        assert httpx.post(f"{url}/v1/completions", json={"model": "v2", "prompt": "hi", "max_tokens": 2,
                                                               "ignore_eos": True},
                          timeout=30).status_code == 200
        series = scrape(url)
        assert by(series, "lorakit_requests_total", "endpoint", "status", skip=("/metrics",)) == {
            ("/v1/completions", "200"): 2, ("/v1/completions", "429"): 2, ("/generate", "499"): 1,
            ("/v1/completions", "503"): 1}
        assert by(series, "lorakit_stream_errors_total", "endpoint", "status") == {("/v1/completions", "499"): 1}
        assert by(series, "lorakit_adapter_requests_total", "adapter", "finish_reason") == {
            ("v2", "abort"): 2, ("v2", "error"): 1, ("v2", "length"): 1}
        prompt = len(engine.prompt_ids("hello", "v2")) * 2 + len(engine.prompt_ids("hi", "v2"))
        assert by(series, "lorakit_tokens_total", "adapter", "kind")["v2", "prompt"] == prompt  # 3 got a token
    finally:
        live.close()


def test_the_series_are_bounded_by_the_adapters_registered_now(world):
    """Issue 29: 300 adapter names loaded, used once and unloaded took /metrics from 856 series to 12,579, 11,700
    of them naming adapters that were gone. Now an unregistered adapter's series go with it (here and in the
    engine's stats), so the scrape after many such cycles is the scrape after none. Issue 45: the scrape right after
    the last unload held 7 series naming it (the idle engine's stats of its last step) for seconds."""
    _, _, _, adapters = world
    live = start(world, adapters=("sql",), api_key="secret", allow_runtime_lora=True)
    state, engine = live.server.config.app.state.server, live.server.config.app.state.engine
    url = live.url

    def use(model):
        out = post(url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert out.status_code == 200, out.text

    def samples():
        return {(name, key) for name, values in scrape(url).items() for key in values if dict(key).get("adapter")}

    try:
        use("tiny"), use("sql")
        before = samples()
        for i in range(12):
            name = f"gone{i}"
            assert post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["chat"])}
                        ).status_code == 200
            use(name)
            assert any(dict(key)["adapter"] == name for _, key in samples())  # counted while it is registered
            assert post(url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
        assert set(state.metrics._series) == {"tiny", "sql"}  # the series themselves are gone, not only hidden
        # at once, though the idle engine's stats (loads, residency, prefix cache) still name the last one
        assert not any(dict(key)["adapter"].startswith("gone") for _, key in samples())
        after = samples()
        assert after == before  # the same series (the base's and sql's), however many adapters came and went
        assert set(engine.scheduler.prefix_stats) <= {None, "sql"}
    finally:
        live.close()


def test_a_scrape_of_several_api_servers_leaves_out_adapters_that_are_gone():
    """With several API server processes, counters live in files that a removal cannot reach: the scrape leaves
    out samples of adapters not registered now, and keeps those without an adapter label."""
    import prometheus_client as prom

    from lorakit.serve.metrics import _Only

    registry = prom.CollectorRegistry()
    counter = prom.Counter("x", "x", ["adapter"], registry=registry)
    plain = prom.Counter("y", "y", registry=registry)
    for adapter in ("a", "gone", "base"):
        counter.labels(adapter).inc()
    plain.inc()
    text = prom.generate_latest(_Only({"a", "base"}, registry)).decode()
    assert 'x_total{adapter="a"}' in text and 'x_total{adapter="base"}' in text and "y_total 1.0" in text
    assert "gone" not in text


def test_an_engines_stale_stats_name_no_adapter_that_is_gone():
    """The engine core sends its stats with its steps: an idle core's last ones still name an adapter unloaded since
    (issue 45: 7 series of it 3 s after its unload). A scrape shows only the registered adapters' and the base's."""
    from types import SimpleNamespace

    from lorakit.serve.metrics import Metrics

    stats = SimpleNamespace(
        pid=1, running=0, waiting=0, steps=5, step_seconds=0.1, gpu_seconds=0.0,
        loads_by_adapter={"sql": 1, "gone": 1}, evictions_by_adapter={"gone": 1},
        residency={"sql": "gpu", "gone": "disk"}, prefix_prompt_tokens={"": 8, "sql": 4, "gone": 4},
        prefix_cached_tokens={"gone": 2}, prefix_cached_blocks=0, prefix_evictions=0,
        running_by_adapter={"": 1, "sql": 1, "gone": 1}, waiting_by_adapter={"gone": 2}, kv_usage=0.5, max_loras=2)
    engine = SimpleNamespace(adapters={"sql": object()}, stats=lambda: stats)
    text = Metrics(engine, "tiny").render().decode()
    assert 'adapter="sql"' in text and 'adapter="tiny"' in text
    assert 'adapter="gone"' not in text
    lora = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert lora.startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""}')
