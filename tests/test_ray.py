"""lorakit behind Ray Serve: two replicas of a tiny model on a local Ray cluster, six adapters, three per replica.

Every answer equals the single server's (greedy, token for token); requests for an adapter stick to the replica
that holds it (each adapter is loaded once); a replica killed mid-run costs only its own requests (retried, or
failed with a clean error) and the fleet serves on. Skipped where Ray Serve is not installed.
"""

import dataclasses
import json
import queue
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from peft import LoraConfig

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'lorakit[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'lorakit[ray]'")

from _peft_models import save_adapter  # noqa: E402
from _serve_helpers import build_world  # noqa: E402
from helpers import free_port  # noqa: E402
from lorakit.engine import EngineConfig  # noqa: E402
from lorakit.serve.ray import FleetConfig, adapter_of, build_app  # noqa: E402
from lorakit.serve import ServeConfig, create_app  # noqa: E402
from lorakit.serve.model import load_engine  # noqa: E402

ENGINE = dict(max_loras=2, block_size=4, patience=4)
NAMES = ["sql", "chat", "v2", "a3", "a4", "a5"]
EXTRA = ["a6", "a7"]  # past the fleet's six places: Ray evicts
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    base, tokenizer, root, adapters = build_world(tmp)
    for seed, name in enumerate(NAMES[3:] + EXTRA, 3):
        cfg = LoraConfig(r=4 * seed, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
        save_adapter(base, name, cfg, root, seed=seed, std=0.3)
    base.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    return tmp / "model", root


@pytest.fixture(scope="module")
def single(world):
    """The single server over the same model, every adapter registered: what the fleet must answer."""
    model, root = world
    engine = load_engine(str(model), "cpu", "float32", EngineConfig(**ENGINE), {n: str(root / n) for n in NAMES + EXTRA})
    with TestClient(create_app(engine, ServeConfig(model_name="tiny"))) as client:
        yield client


@pytest.fixture(scope="module")
def fleet(world):
    model, root = world
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = FleetConfig(model=str(model), device="cpu", dtype="float32", engine=ENGINE,
                         serve={"model_name": "tiny", "allow_runtime_lora": True},  # pushes (paths stay refused)
                         lora_roots=[str(root)], cache=str(root.parent / "cache"), replicas=2, adapters_per_replica=3,
                         replica_cpus=0.5)
    serve.run(build_app(dataclasses.asdict(config)), name="lorakit", route_prefix="/")  # as `serve run` passes args
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client, url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | extra
    return client.post(f"{url}/v1/completions" if url else "/v1/completions", json=body)


def test_the_adapter_is_read_from_the_body():
    assert adapter_of("POST", "/v1/completions", b'{"model": "sql", "prompt": "x"}', "tiny") == "sql"
    assert adapter_of("POST", "/v1/chat/completions", b'{"model": "tiny"}', "tiny") == ""
    assert adapter_of("POST", "/generate", b'{"text": "x", "lora_path": ["sql", "sql"]}', "tiny") == "sql"
    assert adapter_of("POST", "/generate", b'{"text": "x", "lora_path": ["sql", "chat"]}', "tiny") == ""
    assert adapter_of("POST", "/v1/completions", b"not json", "tiny") == ""
    assert adapter_of("GET", "/v1/models", b"", "tiny") == ""


def test_every_request_answers_as_the_single_server_does(fleet, single):
    with httpx.Client(timeout=120) as client:
        for model in ["tiny", *NAMES, "tiny"]:
            expected = complete(single, "", model).json()
            got = complete(client, fleet, model).json()
            assert got["choices"][0]["text"] == expected["choices"][0]["text"], model
            same = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: each replica's own cache
            assert {k: got["usage"][k] for k in same} == {k: expected["usage"][k] for k in same}, model
        chat = {"model": "a4", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0,
                "stream": True}
        expected = single.post("/v1/chat/completions", json=chat).text
        got = client.post(f"{fleet}/v1/chat/completions", json=chat).text
        assert _content(got) == _content(expected)
        missing = complete(client, fleet, "no-such-adapter")
        assert missing.status_code == 404 and missing.json() == complete(single, "", "no-such-adapter").json()
        listed = [m["id"] for m in client.get(f"{fleet}/v1/models").json()["data"]]  # every adapter it can serve
        assert listed == [m["id"] for m in single.get("/v1/models").json()["data"]]
        refused = client.post(f"{fleet}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
        assert refused.status_code == 403 and "by name" in refused.json()["error"]["message"]
        pushed = client.put(f"{fleet}/v1/lora_adapters/x", content=b"\0" * 64)  # checked by a replica, by name
        assert pushed.status_code == 400 and "safetensors" in pushed.json()["error"]["message"]


def _state_dict(folder):
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors"), json.loads((folder / "adapter_config.json").read_text())


def test_a_push_to_the_fleet_is_numbered_once_and_answers_as_the_single_server(fleet, single, world):
    """A push goes through the router: one version number for the fleet, checked by a replica before it is
    answered; requests for it answer as the single server does with the same weights, naming that version."""
    from lorakit.serve.push import IPC_CONTENT_TYPE, push_adapter

    _, root = world
    with httpx.Client(timeout=120) as client:
        for version, source in ((1, "sql"), (2, "chat")):
            answer = push_adapter(fleet, "policy", *_state_dict(root / source))
            assert (answer["lora_name"], answer["version"]) == ("policy", version)
            for _ in range(3):
                got = complete(client, fleet, "policy").json()
                assert got["choices"][0]["text"] == complete(single, "", source).json()["choices"][0]["text"]
                assert got["lorakit"] == {"adapter": "policy", "version": version, "sha256": answer["sha256"]}
        with pytest.raises(RuntimeError, match="409.*not above its last version 2"):
            push_adapter(fleet, "policy", *_state_dict(root / "sql"), version=2)
        assert push_adapter(fleet, "policy", *_state_dict(root / "sql"), version=9)["version"] == 9
        r = client.put(f"{fleet}/v1/lora_adapters/policy", content=b"{}", headers={"content-type": IPC_CONTENT_TYPE})
        assert r.status_code == 400 and "safetensors body" in r.json()["error"]["message"]
        assert complete(client, fleet, "policy").json()["lorakit"]["version"] == 9


def test_every_replica_installs_a_fleet_push_under_the_routers_number(world):
    """Two replicas, one push numbered 7 by the router: each installs it on its first request for it (the same
    number, the same sha256, the same answer), once; Ray's evictions leave a pushed adapter registered (there is no
    folder to find it in again)."""
    import asyncio

    from lorakit.serve.push import push_body
    from lorakit.serve.ray import Replica

    model, root = world
    config = FleetConfig(model=str(model), device="cpu", dtype="float32", engine=ENGINE,
                         serve={"allow_runtime_lora": True})
    replicas = [Replica(config), Replica(config)]
    body = push_body(*_state_dict(root / "sql"))
    request = json.dumps({"model": "policy", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).encode()

    async def ask(replica):
        chunks = [c async for c in replica.handle("POST", "/v1/completions", b"", [("content-type", "application/json")],
                                                  request, "policy", (7, body))]
        return json.loads(b"".join(c for c in chunks if isinstance(c, bytes)))

    async def scenario():
        answers = [await ask(r) for r in replicas] + [await ask(replicas[0])]
        held = await replicas[1].load("policy")
        await asyncio.get_running_loop().run_in_executor(None, held.__del__)  # as Ray Serve evicts
        await asyncio.sleep(0.2)
        behind = await replicas[0].push("policy", 5, body)  # a router that restarted numbers from 1 again
        return answers, [await r.push("policy", 7, body) for r in replicas], "policy" in replicas[1].state.adapters, \
            behind

    try:
        answers, again, kept, behind = asyncio.run(scenario())
    finally:
        for r in replicas:
            r.state.stop()
    assert len({json.dumps(a["choices"]) for a in answers}) == 1
    assert {a["lorakit"]["version"] for a in answers} == {7} and len({a["lorakit"]["sha256"] for a in answers}) == 1
    assert [a["version"] for a in again] == [7, 7] and kept
    assert behind["status"] == 409 and "?version=8" in behind["error"]["message"]
    assert all(r.state.engine.engine.pool.stats.swaps == 0 for r in replicas)  # installed once each


def _content(sse: str) -> str:
    parts = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def loads(client, fleet: str) -> float:
    text = client.get(f"{fleet}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("lorakit_ray_adapter_loads_total"))


def test_requests_for_an_adapter_stick_to_the_replica_that_holds_it(fleet):
    """Six adapters for six places: once a round of requests loads none (the adapters of earlier tests, the pushed
    one among them, evicted by then; a load may first land on a full replica and evict one of the six), every
    request for an adapter goes to the replica that holds it, and nothing is loaded again."""
    def round_() -> dict[str, str]:  # each adapter's answering replica
        answers = {name: complete(client, fleet, name) for name in NAMES}
        assert all(r.status_code == 200 for r in answers.values())
        return {name: r.headers["x-lorakit-replica"] for name, r in answers.items()}

    with httpx.Client(timeout=120) as client:
        for _ in range(10):
            before = loads(client, fleet)
            held = round_()
            if loads(client, fleet) == before:
                break
        else:
            pytest.fail("ten rounds of six adapters for six places each loaded an adapter again")
        assert len(set(held.values())) == 2  # three a replica
        for _ in range(3):
            assert round_() == held, "a request went to a replica that did not hold its adapter"
        assert loads(client, fleet) == before, "an adapter was loaded again"


def metric(client, fleet: str, name: str) -> float:
    text = client.get(f"{fleet}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_adapters_past_the_replicas_places_evict_the_least_recently_used(fleet, single):
    """Six places, eight adapters: each new one evicts one (unregistered from that replica's engine), and an evicted
    adapter asked for again is loaded again and answers as before."""
    with httpx.Client(timeout=120) as client:
        loads_before = metric(client, fleet, "lorakit_ray_adapter_loads_total")
        unloads_before = metric(client, fleet, "lorakit_ray_adapter_unloads_total")
        for name in EXTRA:
            reply = complete(client, fleet, name).json()
            assert reply["choices"][0]["text"] == complete(single, "", name).json()["choices"][0]["text"], name
        deadline = time.monotonic() + 30
        while metric(client, fleet, "lorakit_ray_adapter_unloads_total") < unloads_before + len(EXTRA):
            assert time.monotonic() < deadline, "evicted adapters were not unloaded from their engines"
            time.sleep(0.2)
        for name in NAMES:  # two of them were evicted: loaded again, and right
            reply = complete(client, fleet, name).json()
            assert reply["choices"][0]["text"] == complete(single, "", name).json()["choices"][0]["text"], name
        assert metric(client, fleet, "lorakit_ray_adapter_loads_total") >= loads_before + len(EXTRA) + 1


def test_a_killed_replica_costs_only_its_own_requests(fleet, single):
    """Long requests in flight on both replicas, one replica killed: plain requests that had no answer yet are
    retried elsewhere and answer right; streams cut mid-answer end with a 503 event after a correct prefix; the
    fleet serves everything afterwards (the survivor, then the replica Ray restarts)."""
    long = dict(max_tokens=120, ignore_eos=True)
    expected = {name: complete(single, "", name, **long).json()["choices"][0]["text"] for name in NAMES}
    results: dict[tuple[str, bool], object] = {}
    first = queue.Queue()  # the replica of each stream, as its first tokens arrive

    def run(name, stream):
        body = {"model": name, "prompt": PROMPT, "temperature": 0, "stream": stream} | long
        try:
            with httpx.Client(timeout=180) as client, client.stream("POST", f"{fleet}/v1/completions", json=body) as r:
                chunks = []
                for chunk in r.iter_text():
                    if stream and not chunks:
                        first.put(r.headers["x-lorakit-replica"])  # this stream is decoding there
                    chunks.append(chunk)
                results[name, stream] = (r.status_code, "".join(chunks))
        except httpx.HTTPError as e:
            results[name, stream] = e

    with httpx.Client(timeout=180) as client:
        failures_before = metric(client, fleet, "lorakit_ray_replica_failures_total")
        threads = [threading.Thread(target=run, args=(name, stream)) for name in NAMES for stream in (False, True)]
        for t in threads:
            t.start()
        replica = first.get(timeout=120)  # kill the replica of the first stream to start: it is mid-answer
        victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                      if "LorakitReplica" in a["name"] and a["name"].endswith(replica))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        for t in threads:
            t.join(240)
        assert len(results) == 2 * len(NAMES), "a request hung"
        cut = 0
        for (name, stream), result in results.items():  # each answered right, or failed cleanly
            assert not isinstance(result, Exception), (name, stream, result)
            status, body = result
            assert status == 200, (name, stream, body[:300])
            if not stream:
                assert json.loads(body)["choices"][0]["text"] == expected[name], name
                continue
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in body.splitlines()
                           if line.startswith('data: {"id"'))
            if text != expected[name]:
                cut += 1
                assert expected[name].startswith(text), name
                assert '"code":"service_unavailable"' in body and "retry" in body, body[-300:]
        assert cut >= 1, "no stream was cut: the kill did not land mid-answer"
        assert metric(client, fleet, "lorakit_ray_replica_failures_total") > failures_before
        for name in NAMES:  # the fleet serves on
            reply = complete(client, fleet, name, **long)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected[name], name


def test_an_adapter_asked_for_right_after_its_eviction_stays_registered(world):
    """Ray calls an evicted adapter's __del__ on a worker thread and the unregister runs later on the replica's loop;
    a load of the same adapter in between waits for it, then registers the adapter again."""
    import asyncio

    from lorakit.serve.ray import Replica

    model, root = world
    replica = Replica(FleetConfig(model=str(model), device="cpu", dtype="float32", engine=ENGINE,
                                  lora_roots=[str(root)]))

    async def scenario():
        held = await replica.acquire("sql")
        assert "sql" in replica.state.adapters
        await asyncio.get_running_loop().run_in_executor(None, held.__del__)  # as Ray Serve evicts
        again = await replica.acquire("sql")  # asked for again before the unregister ran (Ray keeps what it gets)
        await asyncio.sleep(0.2)
        return again.name in replica.state.adapters

    try:
        assert asyncio.run(scenario())
    finally:
        replica.state.stop()


def test_an_evicted_adapter_stays_registered_until_its_last_request_ends(world):
    """Ray's LRU evicts without knowing what runs: the replica unregisters an evicted adapter only once the requests
    using it have ended, and they end with their whole answer."""
    import asyncio

    from lorakit.serve.ray import Replica

    model, root = world
    replica = Replica(FleetConfig(model=str(model), device="cpu", dtype="float32", engine=ENGINE,
                                  lora_roots=[str(root)]))
    body = json.dumps({"model": "chat", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()

    async def scenario():
        stream = replica.handle("POST", "/v1/completions", b"", [("content-type", "application/json")], body, "chat")
        head = await stream.__anext__()
        held = await replica.load("chat")  # what Ray keeps, then evicts while the stream runs
        await asyncio.get_running_loop().run_in_executor(None, held.__del__)
        await asyncio.sleep(0.1)
        during = "chat" in replica.state.adapters
        text = b"".join([chunk async for chunk in stream]).decode()
        await asyncio.sleep(0.2)
        return head["status"], during, text, "chat" in replica.state.adapters

    try:
        status, during, text, after = asyncio.run(scenario())
    finally:
        replica.state.stop()
    assert status == 200 and during and not after
    assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
