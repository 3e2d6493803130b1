"""One request's output can never stop the reader of the engine's outputs: a failure while one request's output is
delivered (its detokenizing, its tool parser, its stream's writer) ends that request alone, with an error in
OpenAI's shape (a stream's error event, then ``[DONE]``; a 400, never a 500), logged with its id, while a Bystander
streams on with normal gaps, later requests succeed and ``/health`` stays 200; in the engine core process's server
(``CoreClient``) and with the engine on a thread (``--engine-in-process``). Should the reader die anyway (a bug),
the server says so in its log, fails its requests in flight, answers 503 and exits non-zero."""

import asyncio
import contextlib
import copy
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import _serve_helpers
from _serve_helpers import Bystander, LiveServer
from helpers import free_port, wait_for
from lorakit.engine import Engine, EngineConfig
from lorakit.engine.lifeline import parent_death_signal
from lorakit.engine.outputs import OutputProcessor, RequestOutput
from lorakit.engine.sampling import SamplingParams
from lorakit.frontend.async_engine import AsyncEngine
from lorakit.frontend.core_client import CoreClient
from lorakit.frontend.streams import RequestStream
from lorakit.frontend.wire import Abort
from lorakit.serve import ServeConfig, create_app
from lorakit.serve.model import load_engine, load_tokenizer
from lorakit.serve.protocol import error_status
from lorakit.serve.tools import ToolCalls

TEMPLATE = ("{% if tools %}<system>tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
STEP_SECONDS = 0.01  # added to every engine step: the Bystander's stream lasts long enough to see an attack happen
TOKENS = 150  # the Bystander's (about 2 s at that pace)
MAX_GAP = 0.5  # the longest a Bystander may wait for a chunk (its normal largest gap here: 0.01-0.05 s)
POISON_SEED = 4242  # a request with this seed is the one whose delivery fails
# The module's `world` (tests/conftest.py): the tiny model and tokenizer with a chat template that renders tools and
# room for them in the context, saved for a core process too.
pytestmark = pytest.mark.world(chat_template=TEMPLATE, max_position_embeddings=512, save_model=True)


@pytest.fixture(scope="module", autouse=True)
def solo_once():
    """Every Bystander here streams the same prompt: its solo text is made once (seconds on a busy CPU), not per
    test."""
    known, make = {}, _serve_helpers.reference

    def reference(world, prompt, adapter, adapter_path=None, **params):
        key = (id(world[0]), prompt, adapter, adapter_path, tuple(sorted(params.items())))
        if key not in known:
            known[key] = make(world, prompt, adapter, adapter_path, **params)
        return known[key]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(_serve_helpers, "reference", reference)
        yield


def paced_engine(folder: str, seconds: float) -> Engine:
    """The tiny engine, each step ``seconds`` longer (picklable: built in a core process)."""
    engine = load_engine(folder, "cpu", "float32", EngineConfig(max_loras=2, block_size=4), {})
    step = engine.step
    engine.step = lambda: (time.sleep(seconds), step())[1]
    return engine


@pytest.fixture(scope="module", params=["core", "in-process"])
def live(request, world):
    """A live server over the tiny engine (paced) in a core process of its own or on a thread of this one;
    ``aborted``: the request ids the engine was told to abort."""
    folder = str(world[2].parent / "model")
    aborted = []
    if request.param == "core":
        client = CoreClient(functools.partial(paced_engine, folder, STEP_SECONDS), load_tokenizer(folder))
        client.launch()
        send = client._send
        client._send = lambda m: (aborted.extend(m.request_ids) if isinstance(m, Abort) else None, send(m))[1]
        engine = client
    else:
        engine = paced_engine(folder, STEP_SECONDS)
        abort = engine.abort
        engine.abort = lambda rid: (aborted.append(rid), abort(rid))[1]
    server = LiveServer(create_app(engine, ServeConfig(model_name="tiny")))
    server.aborted = aborted
    try:  # closed however the tests end: a core left running holds this process at its exit
        serves_on(server)  # warm: a first chat with tools costs seconds of the server's CPU (not what is tested here)
        yield server
    finally:
        server.close()


@pytest.fixture()
def poisoned():
    """The ids of the requests sent with POISON_SEED, as their OutputProcessors are made (in this process: the
    server's side in both modes)."""
    ids, init = set(), OutputProcessor.__init__

    def tagged(self, request_id, prompt_ids, params, tokenizer):
        init(self, request_id, prompt_ids, params, tokenizer)
        if params.seed == POISON_SEED:
            ids.add(request_id)
    OutputProcessor.__init__ = tagged
    try:
        yield ids
    finally:
        OutputProcessor.__init__ = init


@contextlib.contextmanager
def bystander(live, world):
    """A Bystander streaming when the block starts; checked (its solo text, no gap of MAX_GAP) when it ends, and it
    must still have been streaming when the block's attacks were over."""
    with Bystander(live, world, max_tokens=TOKENS, max_gap=MAX_GAP) as b:
        wait_for(lambda: len(b.gaps) >= 2 or b.error is not None)
        yield b
        assert b.thread.is_alive(), "the Bystander finished before the attack did; the test needs a longer one"
    b.check()


def post(live, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=timeout)


def events(r: httpx.Response) -> list[dict]:
    """A stream's events, decoded; it must end with [DONE]."""
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-500:]
    return [json.loads(line) for line in lines[:-1]]


def undelivered(error: dict, caplog) -> str:
    """The request id an undeliverable request's error names (a 400, never a 500), logged with its traceback."""
    assert set(error) == {"message", "type", "param", "code"} and error_status(error["code"]) == 400, error
    found = re.search(r"has it as request (\S+)$", error["message"])
    assert found, error["message"]
    logged = [r for r in caplog.records if found[1] in r.getMessage() and r.levelno >= logging.ERROR]
    assert logged and logged[0].exc_info is not None, [r.getMessage() for r in caplog.records]
    return found[1]


def chat(live, stream: bool, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "tools": [TOOL],
            "tool_choice": "auto", "max_tokens": 6, "temperature": 0, "stream": stream, **extra}
    return post(live, "/v1/chat/completions", body)


def serves_on(live):
    """Later requests succeed (a tool chat streamed and not, a completion) and /health says 200."""
    r = chat(live, stream=True)
    assert r.status_code == 200 and events(r)[-1]["choices"][0]["finish_reason"] in ("stop", "length"), r.text[-300:]
    assert chat(live, stream=False).status_code == 200
    r = post(live, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(live.url + "/health").status_code == 200


# One request's failure is its own.

def test_a_tool_parser_that_raises_ends_only_its_own_stream(live, world, monkeypatch, caplog):
    """The tool parser raises RecursionError on a finished output (what 1,500 "[" in a <tool_call> did): the stream
    gets an error event and [DONE] (it used to end the reader of the core's messages: every stream and request on
    that server hung for good, /health turned 503, nothing was logged); not streamed, a 400 (it was a 500)."""
    def raising(self, text):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
    monkeypatch.setattr(ToolCalls, "split", raising)
    with caplog.at_level(logging.ERROR), bystander(live, world):
        for _ in range(2):
            r = chat(live, stream=True)
            assert r.status_code == 200
            got = events(r)
            assert "RecursionError" in got[-1]["error"]["message"] and "choices" in got[0], got
            undelivered(got[-1]["error"], caplog)
        r = chat(live, stream=False)  # the same failure in a JSON answer: the same 400
        assert r.status_code == 400 and "RecursionError" in r.json()["error"]["message"], r.text
        assert httpx.get(live.url + "/health").status_code == 200
    monkeypatch.undo()
    serves_on(live)


def test_a_detokenizer_that_raises_ends_only_its_own_request(live, world, poisoned, monkeypatch, caplog):
    """Detokenizing one request's second output raises: that request ends with a 400 (a stream: after its first
    text, an error event and [DONE]) and is aborted in the engine; the others go on."""
    process, seen = OutputProcessor.process, {}

    def raising(self, out):
        seen[self.request_id] = seen.get(self.request_id, 0) + 1
        if self.request_id in poisoned and seen[self.request_id] > 1:
            raise ValueError("the detokenizer broke")
        return process(self, out)
    monkeypatch.setattr(OutputProcessor, "process", raising)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "seed": POISON_SEED}
    with caplog.at_level(logging.ERROR), bystander(live, world):
        r = post(live, "/v1/completions", {**body, "stream": True})
        got = events(r)
        assert r.status_code == 200 and "choices" in got[0] and "ValueError" in got[-1]["error"]["message"]
        streamed = undelivered(got[-1]["error"], caplog)
        r = post(live, "/v1/completions", body)
        assert r.status_code == 400, r.text
        answered = undelivered(r.json()["error"], caplog)
        wait_for(lambda: {streamed, answered} <= set(live.aborted), timeout=5)
    monkeypatch.undo()
    serves_on(live)


def test_a_request_stream_survives_its_own_failures(caplog):
    """``RequestStream.put`` never raises: a processor or a listener that raises ends that request with an error
    output (aborted once, logged with its id), and a pass over many streams goes on to the next."""
    class Broken:
        request_id = "r-bad"

        def process(self, out):
            raise RecursionError("deep")

    good = OutputProcessor("r-good", [1, 2], SamplingParams(max_tokens=4), None)
    aborts, heard = [], []
    bad, fine = RequestStream(Broken(), lambda: aborts.append("r-bad")), RequestStream(good, lambda: None)
    fine.listen(heard.append)
    with caplog.at_level(logging.ERROR):
        for stream, rid in ((bad, "r-bad"), (fine, "r-good")):  # one pass, as CoreClient._deliver makes it
            stream.put(RequestOutput(rid, "", [5], False, None))
        bad.put(RequestOutput("r-bad", "", [6], True, "length"))  # later outputs are dropped
    assert aborts == ["r-bad"] and [o.token_ids for o in heard] == [[5]]
    out = asyncio.run(bad.__anext__())
    assert out.finish_reason == "error" and "RecursionError" in out.error and "r-bad" in out.error
    assert any("r-bad" in r.getMessage() and r.exc_info for r in caplog.records)

    def deaf(item):  # a listener that raises on every output (a broken writer)
        heard.append(item)
        raise OSError("broken pipe")
    broken = RequestStream(OutputProcessor("r-deaf", [1], SamplingParams(max_tokens=4), None), lambda: None)
    broken.listen(deaf)
    broken.put(RequestOutput("r-deaf", "", [5], False, None))
    assert heard[-1].finish_reason == "error"  # it was told, and its second failure did not escape either


def test_an_event_loop_that_closes_mid_request_does_not_end_the_engine_thread(world):
    """Embedding code whose event loop ends with a request still running (a stream never read nor closed): its
    outputs find the loop closed, and the request is aborted; the engine thread serves the next loop (it used to
    die there, and every later request hung)."""
    base, tokenizer, _, _ = world
    engine = AsyncEngine(Engine(copy.deepcopy(base), tokenizer, block_size=4))
    try:
        async def leave():
            await engine.submit("hello", SamplingParams(max_tokens=200, ignore_eos=True))
        asyncio.run(leave())

        async def again():
            outs = engine.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))
            return await asyncio.wait_for(_last(outs), 30)
        assert asyncio.run(again()).num_output_tokens == 4
        wait_for(lambda: not engine.engine._requests, timeout=10)  # the abandoned one was aborted
        assert engine.dead is None
    finally:
        engine.shutdown(5)


async def _last(outs):
    async for out in outs:
        last = out
    return last


# Should the reader die anyway.

# What runs `lorakit serve` with a reader that dies at a poisoned request's first output (this test's own code).
DYING_READER = f"""
import sys
from lorakit.__main__ import main
from lorakit.frontend.core_client import CoreClient
from lorakit.engine.outputs import OutputProcessor

poisoned, init, deliver = set(), OutputProcessor.__init__, CoreClient._deliver
def tagged(self, request_id, prompt_ids, params, tokenizer):
    init(self, request_id, prompt_ids, params, tokenizer)
    if params.seed == {POISON_SEED}:
        poisoned.add(request_id)
def delivered(self, outputs):
    if poisoned & set(outputs):
        raise RuntimeError("a bug in the reader")
    deliver(self, outputs)
OutputProcessor.__init__, CoreClient._deliver = tagged, delivered
sys.exit(main(sys.argv[1:]))
"""


def test_lorakit_serve_exits_nonzero_when_its_reader_dies(world):
    """`lorakit serve` whose reader of the core's messages dies (a bug, injected): the requests in flight end with a
    503 (a stream: an error event, then [DONE]), the log says why, and the server exits non-zero (a supervisor
    restarts it) instead of serving nothing for ever with its process up."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])))
    server = subprocess.Popen([sys.executable, "-c", DYING_READER, "serve", "--model", str(world[2].parent / "model"),
                               "--served-model-name", "tiny", "--device", "cpu", "--port", str(port), "--block-size",
                               "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                              preexec_fn=parent_death_signal())
    log = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.poll() is not None or _healthy(url), timeout=180)
        assert server.poll() is None, "".join(log)
        result, started = {}, threading.Event()

        def stream():
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                result["text"] = "\n".join(lines)
        streaming = threading.Thread(target=stream)
        streaming.start()
        assert started.wait(60)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                      "seed": POISON_SEED}, timeout=60)
        assert r.status_code == 503 and "stopped reading" in r.json()["error"]["message"], r.text
        streaming.join(60)
        assert '"code":"service_unavailable"' in result["text"].replace(" ", "") and \
            result["text"].strip().endswith("data: [DONE]"), result["text"][-300:]
        assert server.wait(60) == 1, "the server must exit 1 when it cannot serve any more"
        text = "".join(log)
        assert "a bug in the reader" in text and "failing 2 requests in flight" in text, text[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_dead_reader_fails_the_requests_in_flight_and_turns_health_503(live, caplog):
    """A bug ends the reader of the engine's outputs (the core's messages; in-process, the engine thread, which
    hands them over): the stream in flight ends with a 503 error event, new requests and /health get 503 saying why,
    the log has it, ``on_death`` is called (``lorakit serve`` then exits 1), and a core still alive is stopped with
    the server. In-process, such a bug used to end the engine thread alone: every request hung, /health said 200.
    Last in this file: it ends the module's server."""
    client = live.server.config.app.state.server.engine
    broken, deaths = threading.Event(), []
    client.on_death = lambda: deaths.append(1)
    if isinstance(client, CoreClient):
        handle = client._handle

        async def failing(message):  # every message but a Step: the core's beats come every 0.5 s
            if broken.is_set():
                raise RuntimeError("a bug in the reader")
            await handle(message)
        client._handle, why, logged = failing, "stopped reading", "reader of the engine core's messages ended"
    else:
        loop = client.async_engine._loop
        emit = loop.emit

        def failing(outputs):
            if broken.is_set():
                raise RuntimeError("a bug in the reader")
            emit(outputs)
        loop.emit, why, logged = failing, "RuntimeError: a bug in the reader", "the engine thread failed"
    result = {}
    streaming = threading.Thread(target=lambda: result.update(r=post(live, "/v1/completions", {
        "model": "tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}, timeout=30)))
    with caplog.at_level(logging.ERROR):
        streaming.start()
        time.sleep(0.3)
        broken.set()
        streaming.join(30)
    assert "r" in result, "the stream in flight never ended"
    got = events(result["r"])
    assert error_status(got[-1]["error"]["code"]) == 503 and why in got[-1]["error"]["message"], got[-1]
    health = httpx.get(live.url + "/health")
    assert health.status_code == 503 and why in health.json()["error"]["message"]
    r = post(live, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and why in r.json()["error"]["message"]
    assert deaths == [1] and client.crashed
    assert any(logged in r.getMessage() and r.exc_info for r in caplog.records), [r.msg for r in caplog.records]
    live.close()
    assert not isinstance(client, CoreClient) or not client.process.is_alive()
