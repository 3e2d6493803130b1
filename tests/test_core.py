"""The engine core in a process of its own (``lorakit.frontend.core``): the server over a ``CoreClient`` answers what
the in-process engine answers (text, stop strings found in the server process, logprobs, n, chat, runtime loads,
hot-swaps and unloads), a core that cannot start says why, and a core that dies fails every waiting request and
makes ``lorakit serve`` exit non-zero instead of hanging."""

import concurrent.futures
import contextlib
import copy
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from _serve_helpers import LiveServer, check_pushes, children, engine_pid, gone, reference, wait_gone
from helpers import FakeHub, free_port, wait_for
from lorakit.engine import Engine, EngineConfig, SamplingParams
from lorakit.frontend.core_client import CoreClient
from lorakit.engine.lifeline import parent_death_signal
from lorakit.peft import AdapterError
from lorakit.serve import ServeConfig, create_app
from lorakit.serve.model import load_engine, load_tokenizer

CONFIG = EngineConfig(max_loras=2, block_size=4, patience=4)
PROMPT = "What is the capital of France?"
pytestmark = pytest.mark.world(save_model=True)  # the module's `world` (tests/conftest.py), saved at model_dir()


def model_dir(world) -> Path:
    return world[2].parent / "model"


def core_client(world, adapters=("sql", "chat"), config=CONFIG) -> CoreClient:
    paths = world[3]
    build = functools.partial(load_engine, str(model_dir(world)), "cpu", "float32", config,
                              {name: str(paths[name]) for name in adapters})
    return CoreClient(build, load_tokenizer(model_dir(world)))


@pytest.fixture(scope="module")
def server(world):
    client = core_client(world)
    client.launch()
    live = LiveServer(create_app(client, ServeConfig(model_name="tiny", lora_roots=[world[2]],
                                                     allow_runtime_lora=True)))
    yield live
    live.close()


def test_the_core_serves_what_the_in_process_engine_serves(world, server):
    client = server.client()
    for model, adapter in (("tiny", None), ("sql", "sql"), ("chat", "chat")):
        ref = reference(world, PROMPT, adapter, max_tokens=12, temperature=0.0)
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids)
        streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == ref.text
    # A stop string is found here, in the server process; the core is told to stop the request.
    long = reference(world, PROMPT, "sql", max_tokens=30, temperature=0.0, ignore_eos=True).text
    stop = long[len(long) // 2: len(long) // 2 + 3]
    assert stop.strip(), "the reference text is too short to take a stop string from"
    cut = reference(world, PROMPT, "sql", max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut.text and out.choices[0].finish_reason == "stop"
    scored = client.completions.create(model="chat", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert len(scored.choices[0].logprobs.tokens) == 4
    a = client.completions.create(model="chat", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    b = client.completions.create(model="chat", prompt="hello", max_tokens=8, temperature=1.0, seed=3, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hello world"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    metrics = httpx.get(f"{server.url}/metrics").text
    pid = server.server.config.app.state.server.engine.pid
    assert pid != os.getpid() and f"lorakit_engine_pid {float(pid)}" in metrics


def test_prompt_logprobs_come_through_the_core(world, server):
    """echo with logprobs (the prompt's logprobs) and vLLM's prompt_logprobs cross the core's wire: the same values
    as the in-process engine gives."""
    base, tokenizer, _, paths = world
    prompt = tokenizer.encode(PROMPT)
    body = {"model": "sql", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 1}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"sql": paths["sql"]}, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2), "sql")
    (out,) = [o for o in engine.step() if o.request_id == rid]
    want = [None] + [lp.logprob for lp in out.prompt_logprobs[1:]]
    got = choice["logprobs"]["token_logprobs"][: len(prompt)]
    assert got[0] is None and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got[1:], want[1:])), (got, want)
    assert [e is None for e in choice["prompt_logprobs"]] == [True] + [False] * (len(prompt) - 1)


def test_the_core_reports_its_cache_and_the_servers_limits_follow(world, server):
    """The core's Ready carries the KV cache's room and max_num_seqs, as the engine in this process would have them;
    the server's default limits follow from them."""
    client = server.server.config.app.state.server.engine
    engine = load_engine(str(model_dir(world)), "cpu", "float32", CONFIG, {})
    expected = engine.config.num_blocks * engine.config.block_size
    assert (client.kv_tokens, client.max_num_seqs, client.servers) == (expected, engine.config.max_num_seqs, 1)
    limit = server.server.config.app.state.server.in_flight
    assert (limit.sequences, limit.tokens) == (16 * engine.config.max_num_seqs, 4 * expected)


def test_runtime_load_hot_swap_and_unload_go_through_the_core(world, server):
    _, _, _, paths = world
    client = server.client()
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "v2", "lora_path": str(paths["v2"])})
    assert r.status_code == 200, r.text
    out = client.completions.create(model="v2", prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == reference(world, PROMPT, "v2", max_tokens=10, temperature=0.0).text
    # Hot-swap "v2" to sql's weights: new requests get them.
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "v2", "lora_path": str(paths["sql"])})
    assert r.status_code == 200, r.text
    out = client.completions.create(model="v2", prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == reference(world, PROMPT, "sql", max_tokens=10, temperature=0.0).text
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(world[2] / "nope")})
    assert bad.status_code in (400, 404) and "bad" not in {m.id for m in client.models.list().data}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "v2"}).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"model": "v2", "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 404
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == reference(world, PROMPT, "sql", max_tokens=10, temperature=0.0).text


def test_pushes_over_http_go_through_the_core(world, server):
    check_pushes(world, server)


def test_a_large_pushed_body_is_mapped_by_the_core_where_the_server_holds_it(world, server, tmp_path, monkeypatch):
    """A body of several HTTP messages is gathered in a memfd, and the core maps it there instead of receiving its
    bytes (through zmq, 84 MB held every step behind them for 50-60 ms on an H200): the version answers as its folder
    does, and neither process keeps the map once the push is answered."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from _peft_models import save_adapter
    from lorakit.frontend import core_client
    from lorakit.serve.push import push_adapter

    cfg = LoraConfig(r=64, lora_alpha=32, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    folder = Path(save_adapter(world[0], "big", cfg, tmp_path, seed=5, std=0.1).path)
    weights = load_file(folder / "adapter_model.safetensors")
    assert sum(t.nbytes for t in weights.values()) > 2 << 16  # two reads of the socket at least: several messages
    handed, describe = [], core_client.describe
    monkeypatch.setattr(core_client, "describe", lambda body: handed.append(describe(body)) or handed[-1])
    answer = push_adapter(server.url, "big", weights, json.loads((folder / "adapter_config.json").read_text()))
    client = server.server.config.app.state.server.engine
    assert handed and handed[-1] is not None and client._body_files  # handed over where it lies, and mapped
    prompt = "What is the capital of France?"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "big", "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["lorakit"]["version"] == answer["version"], r.text
    assert r.json()["choices"][0]["text"] == reference(world, prompt, "big", adapter_path=folder, max_tokens=8,
                                                       temperature=0.0).text

    def mapped(pid):
        return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "lorakit-body" in line]
    wait_for(lambda: not mapped(client.core_pid) and not mapped(os.getpid()), timeout=5)


def test_a_core_that_cannot_start_says_why(world, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    paths = dict(world[3], bad=bad)
    client = CoreClient(functools.partial(load_engine, str(model_dir(world)), "cpu", "float32", CONFIG,
                                          {"bad": str(paths["bad"])}), load_tokenizer(model_dir(world)))
    with pytest.raises(AdapterError, match="adapter_config.json"):
        client.launch(timeout=120)
    assert not client.process.is_alive()


@contextlib.contextmanager
def serve_cli(world, *flags: str):
    """``lorakit serve`` on the tiny model as a subprocess in a process group of its own (as a terminal's job), once it
    answers /health: (the process, its URL, its output so far). Killed with its group on the way out if still alive,
    and by the kernel if this test process is killed outright."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])))
    server = subprocess.Popen([sys.executable, "-m", "lorakit", "serve", "--model", str(model_dir(world)), "--device",
                               "cpu", "--port", str(port), "--block-size", "4", *flags], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=Path(__file__).resolve().parents[1],
                              start_new_session=True, preexec_fn=parent_death_signal())
    log = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "".join(log)
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield server, url, log
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_dead_core_fails_every_waiting_request_and_the_server_exits_nonzero(world, api_servers):
    with serve_cli(world, f"--lora=sql={world[3]['sql']}", "--api-servers", str(api_servers)) as (server, url, log):
        time.sleep(2.0 if api_servers > 1 else 0)  # the other API servers start after the first
        metrics = httpx.get(f"{url}/metrics").text
        pid = int(float(next(line.split()[1] for line in metrics.splitlines()
                             if line.startswith("lorakit_engine_pid "))))
        assert pid > 0 and pid not in (os.getpid(), server.pid)  # (0 would signal this test's own group)
        n = 3 * api_servers  # on new connections: spread over the servers
        results, started = [], [threading.Event() for _ in range(n)]

        def stream(i):
            body = {"model": "sql", "prompt": PROMPT, "max_tokens": 110, "stream": True, "ignore_eos": True,
                    "temperature": 0}
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started[i].set()
                results.append((r.status_code, "".join(lines)))

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in streams:
            t.start()
        for event in started:
            assert event.wait(60)
        os.kill(pid, signal.SIGSTOP)  # mid-stream: 110 tokens take longer than this
        assert not results, "a stream finished before the core was stopped; the test needs longer streams"
        os.kill(pid, signal.SIGKILL)
        for t in streams:
            t.join(60)
        assert len(results) == n
        for status, body in results:
            assert status == 200 and '"error"' in body and "engine core" in body, body[-500:]
        assert server.wait(60) != 0, "the server must exit non-zero when its engine core dies"
        assert "engine core" in "".join(log)


def test_ctrl_c_lets_the_requests_in_flight_finish_and_stops_the_core(world):
    """SIGINT to the whole process group, as Ctrl-C in a terminal sends it: the core ignores it, the server finishes
    the stream in flight, then stops the core and exits with status 0 (not 1, as for a dead core), without a
    traceback (uvicorn's re-raised SIGINT used to end in asyncio's runner: a CancelledError, exit status -2 or 1)."""
    with serve_cli(world) as (server, url, log):
        result, started = [], threading.Event()

        def stream():
            body = {"model": "model", "prompt": PROMPT, "max_tokens": 110, "stream": True, "ignore_eos": True,
                    "temperature": 0, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                result.append(lines)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.killpg(server.pid, signal.SIGINT)
        t.join(60)
        lines = [line for line in result[0] if line] if result else []
        assert lines and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        # All 110 tokens (a loaded machine sends several in one event, so the events are not counted).
        assert json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 110, "the stream was cut short"
        assert server.wait(60) == 0, "".join(log)[-3000:]
        assert "exited with code" not in "".join(log)  # the core was stopped, it did not die
        assert "Traceback" not in "".join(log), "".join(log)[-3000:]
        assert "leaked" not in "".join(log), "".join(log)[-3000:]  # nanobind, of a heap left frozen at exit


class Stream:
    """A greedy stream of ``max_tokens`` on a thread: its status and lines once it ends, ``started`` at its first
    line."""

    def __init__(self, url: str, max_tokens: int = 110):
        self.url, self.max_tokens = url, max_tokens
        self.status, self.lines, self.started, self.error = None, [], threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        body = {"model": "model", "prompt": PROMPT, "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        self.started.set()

    def join(self) -> "Stream":
        self.thread.join(120)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self


def test_ctrl_c_ends_a_stream_past_the_grace_with_an_error_event_and_done(world):
    """--shutdown-grace 1: a stream still running when the grace ends gets an error event (503, the server shutting
    down) and [DONE] before its connection closes, and the server exits 0. The core is stopped (SIGSTOP) while the
    stream runs, so it is still running then, however fast or slow this machine is."""
    with serve_cli(world, "--shutdown-grace", "1") as (server, url, log):
        core = engine_pid(url)
        stream = Stream(url)
        assert stream.started.wait(60)
        os.kill(core, signal.SIGSTOP)
        try:
            os.killpg(server.pid, signal.SIGINT)
            stream.join()
        finally:
            os.kill(core, signal.SIGCONT)
        assert stream.status == 200 and stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        error = stream.lines[-2]
        assert '"code":"service_unavailable"' in error, error
        assert "shutting down" in error and "--shutdown-grace" in error, error
        assert server.wait(60) == 0, "".join(log)[-3000:]
        assert "Traceback" not in "".join(log), "".join(log)[-3000:]


def test_a_dead_tensor_parallel_worker_is_a_dead_engine(world):
    """--tensor-parallel-size 2 on the CPU (gloo), rank 1 killed mid-stream: it is not taken for a request's fault.
    The streams in flight end with a 503 error event naming the TensorParallelError, /health stops answering 200, and
    the server exits non-zero (the core exits 1, the same death as a killed core), instead of 400s for every request
    while /health says 200 and the server runs on."""
    with serve_cli(world, "--tensor-parallel-size", "2") as (server, url, log):
        core = engine_pid(url)
        [worker] = children(core)
        assert (command_line(core), command_line(worker)) == ("lorakit engine-core", "lorakit tp-worker 1")
        streams = [Stream(url) for _ in range(2)]
        for stream in streams:
            assert stream.started.wait(60)
        os.kill(worker, signal.SIGSTOP)  # mid-step: the streams cannot finish before it dies
        os.kill(worker, signal.SIGKILL)
        for stream in streams:
            stream.join()
            assert stream.status == 200 and stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
            error = stream.lines[-2]
            assert '"code":"service_unavailable"' in error and "TensorParallelError" in error, error
        try:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        except httpx.TransportError:
            pass  # exited already
        assert server.wait(60) == 1, "".join(log)[-3000:]
        assert gone(core)
        assert "exited with code 1" in "".join(log) or "failed: the engine cannot run any more steps" in "".join(log)


def test_health_follows_a_stopped_core_and_the_core_and_its_workers_die_with_the_server(world):
    """--health-timeout 1: /health turns 503 while the core is stopped (SIGSTOP: no beats), and 200 again once it
    runs (SIGCONT). Then the server is SIGKILLed: the core and its tensor-parallel worker are gone within 2 s."""
    with serve_cli(world, "--tensor-parallel-size", "2", "--health-timeout", "1") as (server, url, log):
        core = engine_pid(url)
        [worker] = children(core)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        os.kill(core, signal.SIGSTOP)
        try:
            start = time.monotonic()
            while (r := httpx.get(f"{url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() - start < 60, "/health still says 200 for a stopped core"
                time.sleep(0.1)
            assert r.status_code == 503 and "has sent nothing for" in r.text, r.text
        finally:
            os.kill(core, signal.SIGCONT)
        start = time.monotonic()
        while (r := httpx.get(f"{url}/health", timeout=10)).status_code != 200:
            assert time.monotonic() - start < 60, r.text
            time.sleep(0.1)
        out = httpx.post(f"{url}/v1/completions", json={"model": "model", "prompt": PROMPT, "max_tokens": 4},
                         timeout=60)
        assert out.status_code == 200, out.text
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        wait_gone([core, worker], within=2.0)


def test_runtime_loading_by_hub_id_only_for_allowed_repos(world, tmp_path, monkeypatch):
    """``--allow-runtime-lora --allow-lora-repo org/*``: POST /v1/load_lora_adapter with a hub id downloads the
    adapter (a fake hub on localhost; huggingface_hub lays out its cache) and serves it as the same adapter loaded
    from a folder; an id outside the patterns is a 403 and downloads nothing."""
    folder = Path(world[3]["sql"])
    hub = FakeHub({"org/sql-lora": {"main": {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}},
                   "other/sql-lora": {"main": {}}})
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    for key, value in hub.env(tmp_path / "hf").items():
        monkeypatch.setenv(key, value)
    try:
        with serve_cli(world, "--allow-runtime-lora", "--allow-lora-repo", "org/*") as (server, url, log):
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "hubbed", "lora_path": "org/sql-lora"},
                           timeout=60)
            assert r.status_code == 200, r.text
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            text = httpx.post(f"{url}/v1/completions", json={"model": "hubbed", **body}, timeout=60).json()
            assert text["choices"][0]["text"] == reference(world, PROMPT, "sql", max_tokens=8, temperature=0.0).text
            asked = len(hub.requests)
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "other/sql-lora"},
                           timeout=60)
            assert r.status_code == 403 and "--allow-lora-repo" in r.json()["error"]["message"], r.text
            assert len(hub.requests) == asked
    finally:
        hub.shutdown()


def command_line(pid: int) -> str:
    """What ps shows for ``pid``: its command line, as setproctitle leaves it."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_several_api_servers_share_one_core(world):
    """--api-servers 2: two server processes on one port (the kernel spreads connections), one core. Every request
    answers as the single server does, and an adapter loaded through one server is served by both."""
    flags = ("--api-servers", "2", f"--lora=sql={world[3]['sql']}", "--allow-runtime-lora", "--lora-root",
             str(world[2]))
    with serve_cli(world, *flags) as (server, url, log):
        time.sleep(2.0)  # the second API server starts after the first

        def complete(model, n=12):  # each on a new connection: spread over both servers
            bodies = [{"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0} for _ in range(n)]
            return [httpx.post(f"{url}/v1/completions", json=b, timeout=60) for b in bodies]

        for model, adapter in (("model", None), ("sql", "sql")):
            ref = reference(world, PROMPT, adapter, max_tokens=10, temperature=0.0).text
            assert {(r.status_code, r.json()["choices"][0]["text"]) for r in complete(model)} == {(200, ref)}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "v2", "lora_path": str(world[3]["v2"])})
        assert r.status_code == 200, r.text
        time.sleep(0.5)  # the other server reads the new adapter's facts from the core's broadcast
        ref = reference(world, PROMPT, "v2", max_tokens=10, temperature=0.0).text
        assert {(r.status_code, r.json()["choices"][0]["text"]) for r in complete("v2")} == {(200, ref)}
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "v2"}).status_code == 200
        time.sleep(0.5)
        assert {r.status_code for r in complete("v2", 8)} == {404}
        scrapes = [httpx.get(f"{url}/metrics").text for _ in range(6)]  # on new connections: from both servers
        pids = {line.split()[1] for text in scrapes for line in text.splitlines()
                if line.startswith("lorakit_engine_pid ")}
        assert len(pids) == 1  # one core behind both
        assert "lorakit api-server 1" in [command_line(pid) for pid in children(server.pid)]
        done = {line.split()[1] for text in scrapes for line in text.splitlines()
                if line.startswith('lorakit_requests_total{endpoint="/v1/completions",status="200"}')}
        assert done == {"36.0"}  # every server's completions, added up, whichever answers the scrape
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(90) == 0, "".join(log)[-3000:]
        assert "exited with code" not in "".join(log)


def test_a_tensor_parallel_core_serves_what_the_in_process_engine_serves(world):
    """``--tensor-parallel-size 2`` on the CPU: the core process (daemonic) starts its gloo worker, and completions
    over the base model and adapters, and a runtime load, give the unsharded engine's greedy text."""
    _, _, _, paths = world
    config = EngineConfig(max_loras=2, block_size=4, patience=4, tensor_parallel_size=2)
    client = core_client(world, config=config)
    client.launch(timeout=180)
    live = LiveServer(create_app(client, ServeConfig(model_name="tiny", lora_roots=[world[2]],
                                                     allow_runtime_lora=True)))
    try:
        api = live.client()
        r = httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": "v2", "lora_path": str(paths["v2"])})
        assert r.status_code == 200, r.text
        for model, adapter in (("tiny", None), ("sql", "sql"), ("chat", "chat"), ("v2", "v2")):
            ref = reference(world, PROMPT, adapter, max_tokens=12, temperature=0.0)
            out = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
            assert out.choices[0].text == ref.text, model
    finally:
        live.close()
    assert not client.process.is_alive()


def test_every_call_crosses_the_wire_as_its_own_type_and_the_core_has_a_handler_for_each():
    """The calls are one struct each (no method string): each decodes as itself from the server's bytes, and the
    core dispatches every message type the wire allows (``ToCore``) by type."""
    import typing

    import msgspec

    from lorakit.adapters.pool import AdapterRef
    from lorakit.engine.structured import StructuredOutput
    from lorakit.frontend.core import _Core
    from lorakit.frontend.wire import Abort, Add, CompileGrammar, Register, Shutdown, ToCore, Unregister

    calls = [Register(1, "sql", "/adapters/sql", ["/adapters"], 2), Unregister(2, "sql", 1),
             CompileGrammar(3, StructuredOutput(choice=("yes", "no")), AdapterRef("sql", 4, "ab"), "client", 1),
             Shutdown(4, 2.5), Add("s0-r1", [1, 2], SamplingParams(max_tokens=3), None), Abort(["s0-r1"])]
    decode = msgspec.msgpack.Decoder(ToCore).decode
    for call in calls:
        assert decode(msgspec.msgpack.encode(call)) == call
    core = _Core(object(), None, [])  # its dispatch table only: no engine is run, no socket read
    try:
        assert set(core.handlers) == set(typing.get_args(ToCore))
    finally:
        core.reader.shutdown()


def test_a_pushed_body_crosses_to_the_core_as_a_frame_of_its_own():
    """A Push's bytes are not encoded into its message (84 MB copied twice under the server's GIL): they go as a second
    frame, uncopied, and the core's inbox puts them back in ``weights``, a view of the frame it received; any other
    message is one frame."""
    import msgspec
    import zmq
    from lorakit.frontend.core import _Core
    from lorakit.frontend.wire import Abort, Push, ToCore, to_frames

    encode = msgspec.msgpack.Encoder().encode
    body = os.urandom(1 << 20)
    push = Push(call_id=7, name="policy", weights=memoryview(body), config={"r": 8}, version=3)
    frames = to_frames(push, encode)
    assert len(frames) == 2 and frames[1] is push.weights and len(frames[0]) < 100
    assert len(to_frames(Abort(["r1"]), encode)) == 1

    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        outbox.connect(f"tcp://127.0.0.1:{port}")
        for message in (Abort(["r1"]), push, Abort(["r2"])):
            outbox.send_multipart(to_frames(message, encode), copy=False)
        core = _Core.__new__(_Core)
        core.inbox, core.decode, taken = inbox, msgspec.msgpack.Decoder(ToCore).decode, []
        core.handle = taken.append
        deadline = time.monotonic() + 10
        while len(taken) < 3 and time.monotonic() < deadline:
            for command in core.take(1.0):
                command()
        first, got, last = taken
        assert first == Abort(["r1"]) and last == Abort(["r2"])
        assert isinstance(got, Push) and isinstance(got.weights, memoryview) and bytes(got.weights) == body
        assert (got.call_id, got.name, got.config, got.version) == (7, "policy", {"r": 8}, 3)
    finally:
        inbox.close(0)
        outbox.close(0)
        context.term()


def test_a_pushed_body_is_let_go_on_the_reader_thread_read_or_refused():
    """The core reads a Push's weights on its reader thread and drops them there, read or refused: freeing the 84 MB
    frame zmq received them in takes ~10 ms, which the loop's thread would otherwise spend between two steps."""
    import threading
    import types
    import weakref

    import numpy as np
    from lorakit.frontend.core import _Core
    from lorakit.frontend.wire import Push

    def read_pushed(name, weights, config):
        assert bytes(weights[:4]) == b"\x07" * 4  # read where it lies
        if name == "bad":
            raise ValueError(f"adapter {name!r}: refused")
        return "checked"

    core = _Core.__new__(_Core)
    core.engine = types.SimpleNamespace(registry=types.SimpleNamespace(read_pushed=read_pushed))
    core.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorakit-adapter-read")
    try:
        for name in ("good", "bad"):
            frame = np.full(1 << 20, 7, dtype=np.uint8)  # stands for zmq's frame: it tells where it was freed
            freed = []
            weakref.finalize(frame, lambda: freed.append(threading.current_thread().name))
            call = Push(call_id=1, name=name, weights=memoryview(frame), config=None)
            del frame
            read = core.reader.submit(core.read_pushed, call)
            concurrent.futures.wait([read])
            assert call.weights is None  # the loop's callbacks keep the call, not its weights
            if name == "good":
                assert read.result() == "checked"
            else:
                with pytest.raises(ValueError, match="refused"):
                    read.result()
            assert len(freed) == 1 and freed[0].startswith("lorakit-adapter-read"), (name, freed)
    finally:
        core.reader.shutdown()


def test_a_pushed_body_in_a_memfd_is_read_by_the_core_through_a_map_of_its_own():
    """The core maps a BodyFile's pages (the server's memfd, through /proc), reads the weights there on its reader
    thread and leaves its map to the Unmapper; the server's map and descriptor go when it is closed."""
    import concurrent.futures as futures
    import types

    from lorakit.frontend.bodies import BodyMap, describe, gather_map
    from lorakit.frontend.core import _Core
    from lorakit.frontend.wire import BodyFile, Push

    payload = os.urandom(3 << 16)
    held = gather_map(len(payload) + 100)
    held[:len(payload)] = payload
    body = memoryview(held)[:len(payload)]
    where = describe(body)
    assert isinstance(held, BodyMap) and where == BodyFile(os.getpid(), held.fd, len(payload))
    seen = []

    def read_pushed(name, weights, config):
        seen.append((bytes(weights), threading.current_thread().name))
        return "checked"

    core = _Core.__new__(_Core)
    core.engine = types.SimpleNamespace(registry=types.SimpleNamespace(read_pushed=read_pushed))
    core.reader = futures.ThreadPoolExecutor(1, thread_name_prefix="lorakit-adapter-read")
    try:
        call = Push(call_id=1, name="p", weights=where, config=None)
        assert core.reader.submit(core.read_pushed, call).result() == "checked"
    finally:
        core.reader.shutdown()
    assert seen == [(payload, seen[0][1])] and seen[0][1].startswith("lorakit-adapter-read")

    def maps():
        return sum("lorakit-body" in line for line in Path("/proc/self/maps").read_text().splitlines())
    wait_for(lambda: maps() == 1, timeout=5)  # the core's map closed by the Unmapper; the server's stays
    fd = held.fd
    del body
    held.close()
    assert maps() == 0 and held.fd == -1 and not os.path.exists(f"/proc/self/fd/{fd}")


def test_a_body_file_the_core_cannot_map_is_named_and_the_server_sends_the_bytes_instead(caplog):
    """open_body refuses what it cannot map with the reason (BodyFileError); the server then pushes the bytes, and
    pushes bytes from then on."""
    import asyncio

    from lorakit.adapters.pool import AdapterRef
    from lorakit.frontend.bodies import gather_map, open_body
    from lorakit.frontend.wire import AdapterFacts, BodyFile, BodyFileError

    held = gather_map(100)
    read, write = os.pipe()
    try:
        for where, why in ((BodyFile(os.getpid(), 10**6, 10), "cannot be opened"),
                           (BodyFile(os.getpid(), held.fd, 101), "not a file of 101 bytes"),
                           (BodyFile(os.getpid(), read, 10), "not a file of 10 bytes")):
            with pytest.raises(BodyFileError, match=why):
                open_body(where)
    finally:
        os.close(read)
        os.close(write)

    sent = []

    async def call(kind, **fields):  # a core that cannot open the server's descriptors
        sent.append(type(fields["weights"]).__name__)
        if isinstance(fields["weights"], BodyFile):
            raise BodyFileError("the pushed body in server 1's descriptor 5 cannot be opened (Permission denied)")
        return AdapterFacts(AdapterRef(fields["name"], len(sent), "0" * 64), "<pushed>", [])

    client = CoreClient(None)
    client._call = call
    body = memoryview(held)[:100]
    assert asyncio.run(client.push_adapter("p", body, None)).version == 2
    assert asyncio.run(client.push_adapter("p", body, None)).version == 3
    assert sent == ["BodyFile", "memoryview", "memoryview"]
    assert "cannot map pushed bodies" in caplog.text and "Permission denied" in caplog.text
    del body
    held.close()

