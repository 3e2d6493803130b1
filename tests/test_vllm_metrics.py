"""/metrics as the routers that read vLLM's series see it (the Gateway API Inference Extension's endpoint picker,
llm-d): a live server scraped while a request to one adapter runs and one to another waits (a batch of one), the
text read the way the picker reads it; and the Grafana dashboard in docs/ names only series the server exports."""

import copy
import json
import re
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _serve_helpers import start
from helpers import wait_for

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "lorakit-dashboard.json"
PROMPT = "What is the capital of France?"


def families(url) -> dict:
    """{family name: family} of the server's /metrics."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def picked(found: dict) -> dict:
    """What the endpoint picker's vLLM scraper (pkg/epp/backend/metrics) makes of a scrape: each gauge's last sample
    (none carries a timestamp); of ``vllm:lora_requests_info``, among the samples whose running or waiting list is
    not empty, the one of the largest value (the time it was set), its lists split on commas and ``max_lora`` read
    as an integer; None when there is no such sample (the picker keeps what it knew)."""
    read = {name: found[name].samples[-1].value for name in
            ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc")}
    latest, best = None, 0.0
    for sample in found["vllm:lora_requests_info"].samples:
        labels = sample.labels
        if (labels["running_lora_adapters"] or labels["waiting_lora_adapters"]) and sample.value > best:
            latest, best = labels, sample.value
    read["lora"] = None if latest is None else {
        "running": latest["running_lora_adapters"].split(",") if latest["running_lora_adapters"] else [],
        "waiting": latest["waiting_lora_adapters"].split(",") if latest["waiting_lora_adapters"] else [],
        "max_lora": int(latest["max_lora"])}
    return read


def test_a_router_sees_running_and_waiting_adapters_and_the_load(world):
    live = start(world, engine_options={"max_num_seqs": 1}, max_concurrent=4)  # one runs, the next waits
    engine, url = live.server.config.app.state.engine, live.url
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]
    waiter = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "chat", "prompt": "hello", "max_tokens": 2, "ignore_eos": True}))
    try:
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json={
                "model": "sql", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a generator collected closes the stream
            assert r.status_code == 200 and next(lines).startswith("data: {")  # sql runs
            waiter.start()
            seen = wait_for(lambda: (p := picked(families(url)))["lora"] and p["lora"]["waiting"] and p,
                            timeout=30.0, poll=0.02)
            assert seen["lora"] == {"running": ["sql"], "waiting": ["chat"], "max_lora": 2}
            assert seen["vllm:num_requests_running"] == 1 and seen["vllm:num_requests_waiting"] == 1
            assert 0 < seen["vllm:kv_cache_usage_perc"] == seen["vllm:gpu_cache_usage_perc"] <= 1
            found = families(url)
            assert {s.labels["model_name"] for s in found["vllm:num_requests_running"].samples} == {"tiny"}
            by_adapter = {s.labels["adapter"]: s.value for s in found["lorakit_adapter_requests_running"].samples}
            assert by_adapter == {"sql": 1}
        waiter.join(60)  # the stream left: chat runs, and ends
        idle = wait_for(lambda: (p := picked(families(url)))["vllm:num_requests_running"] == 0 and
                        p["vllm:num_requests_waiting"] == 0 and p, timeout=30.0, poll=0.02)
        assert idle["lora"] is None and idle["vllm:kv_cache_usage_perc"] == 0  # nothing running: the picker keeps
        # its last view, as with vLLM, whose older samples stay behind a newer empty one
    finally:
        engine.step = step
        live.close()


def test_the_engine_core_sends_what_the_series_need(world):
    """With the engine in a process of its own (`lorakit serve`), the stats come over the wire once a step: the
    adapters running and waiting, the KV usage and the slots travel in them and give the same series."""
    from types import SimpleNamespace

    import msgspec

    from lorakit.engine import Engine, SamplingParams
    from lorakit.frontend.wire import FromCore, Step
    from lorakit.serve.metrics import Metrics

    base, tokenizer, _, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={n: paths[n] for n in ("sql", "chat")}, block_size=4,
                    max_num_seqs=1)
    for adapter in ("sql", "chat", None):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), adapter=adapter)
    engine.step()
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(Step([], engine.stats())), type=FromCore).stats
    assert (stats.running_by_adapter, stats.waiting_by_adapter, stats.max_loras) == ({"sql": 1}, {"chat": 1, "": 1}, 2)
    assert 0 < stats.kv_usage <= 1
    client = SimpleNamespace(adapters=engine.pool.adapters, stats=lambda: stats)
    found = {f.name: f for f in text_string_to_metric_families(Metrics(client, "tiny").render().decode())}
    seen = picked(found)
    assert seen["lora"] == {"running": ["sql"], "waiting": ["chat"], "max_lora": 2}  # the base model is no adapter
    assert (seen["vllm:num_requests_running"], seen["vllm:num_requests_waiting"]) == (1, 2)
    assert {s.labels["adapter"]: s.value for s in found["lorakit_adapter_requests_waiting"].samples} == {
        "chat": 1, "tiny": 1}


# PromQL words before "(" that are not metrics; label lists after by / without are not metrics either.
_GROUPING = re.compile(r"\b(?:by|without)\s*\([^)]*\)")
_METRIC = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=[{\[)])")


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads: each name followed by a selector's ``{``, a range's ``[`` or a closing
    ``)``, with the by / without label lists taken out first."""
    return set(_METRIC.findall(_GROUPING.sub(" ", expr)))


def exported(found: dict) -> set[str]:
    """Every series name a scrape declares: its samples' names, each family's (and a counter's ``_total``, a
    histogram's ``_bucket``, ``_sum`` and ``_count``), with or without samples yet."""
    names = {s.name for f in found.values() for s in f.samples} | set(found)
    for name, family in found.items():
        names |= {name + "_total"} if family.type == "counter" else set()
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if family.type == "histogram" else set()
    return names


def test_every_dashboard_panel_reads_series_the_server_exports(world):
    dashboard = json.loads(DASHBOARD.read_text())
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dashboard["templating"]["list"])
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]
    assert len(targets) >= 10
    live = start(world)
    try:
        r = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "model": "sql", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200
        names = exported(families(live.url))
    finally:
        live.close()
    for title, expr in targets:
        read = metric_names(expr)
        assert read, f"panel {title!r}: no metric found in {expr!r}"
        assert read <= names, f"panel {title!r} reads {sorted(read - names)}, which lorakit does not export"
