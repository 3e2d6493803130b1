"""The HTTP edge against a hostile client: slow and large connections are bounded (all bodies in flight together, a
header's and a body's time) and their memory comes back; text no tokenizer takes is a 400 naming its field; the API
key comes from the environment or a file, in any case of 'Bearer', compared in constant time. The attacks on a live
server run beside a greedy Bystander stream that must keep its solo text and its pace."""

import asyncio
import json
import logging
import select
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _serve_helpers import Bystander, start
from lorakit.serve.protocol import error_status
from lorakit.serve import ServeConfig
from lorakit.serve.auth import ENV_KEY, api_key, authorized
from lorakit.serve.edge import MAX_HEADER_BYTES, BodyBudget, BodyGate
from lorakit.serve.protocol import ApiError, parse_body
from helpers import BYSTANDER_TOKENS as TOKENS, bystander, post, slow_steps, wait_for

MIB = 2**20


@contextmanager
def long_bystander(live, world, seconds: float):
    """A Bystander that streams for about ``seconds`` (its steps slowed to fit), checked when the block ends."""
    with slow_steps(live, seconds / TOKENS), Bystander(live, world, max_tokens=TOKENS, max_gap=2.0) as b:
        wait_for(lambda: len(b.gaps) >= 2 or b.error is not None)
        yield b
    b.check()


def rss_mib() -> float:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def connect(live, size: int) -> socket.socket:
    """A connection that has sent the headers of a completion whose body declares ``size`` bytes."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % size)
    return sock


def response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one response the server sends before it closes ``sock``."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    while head.split()[1].startswith(b"1"):  # an interim answer (100 Continue) comes before the one response
        head, _, body = body.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def openai_error(status: int, body: dict, code: int) -> dict:
    assert status == code, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert error_status(body["error"]["code"]) == code, body
    return body["error"]


# 1. Memory was bounded per request only: 16 connections x 15 MB, idling, kept 222 MiB.

def test_bodies_in_flight_are_bounded_all_together_and_their_memory_comes_back(world):
    size, budget = 15 * 10**6, 64 * MIB
    live = start(world, max_body_bytes_in_flight=budget, body_timeout=3.0)
    payload = memoryview(b"x" * size)  # one buffer for every sender: the test's own memory does not grow
    held = live.server.config.app.state.server.bodies
    try:
        with long_bystander(live, world, 10.0):
            before = rss_mib()
            admitted = [connect(live, size) for _ in range(budget // size)]  # 4: as many as fit
            senders = [threading.Thread(target=s.sendall, args=(payload[:size - 1],)) for s in admitted]
            for t in senders:
                t.start()
            for t in senders:
                t.join(60)
            assert len(admitted) * size <= held.held <= budget  # theirs, and the Bystander's small body
            for _ in range(12):  # beyond the budget: a 503 at once, before any of the body is sent
                with connect(live, size) as refused:
                    error = openai_error(*response(refused), 503)
                    assert "--max-body-bytes-in-flight" in error["message"], error
            ok = post(live, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text  # a small body still fits beside them
            grown = rss_mib() - before
            assert grown < budget / MIB + 24, f"the server grew by {grown:.0f} MiB with {budget / MIB:.0f} in flight"
            for sock in admitted:  # idle, the last byte never sent: the body timeout answers them
                with sock:
                    error = openai_error(*response(sock), 408)
                    assert "--body-timeout" in error["message"], error
            wait_for(lambda: held.held < 1000)  # the Bystander's alone
            end = time.monotonic() + 5  # unmapped on a thread of the server's own (bodies.Unmapper), promptly
            while (left := rss_mib() - before) >= 24 and time.monotonic() < end:
                time.sleep(0.05)
            assert left < 24, f"{left:.0f} MiB of the bodies stayed in the server after their connections closed"
    finally:
        live.close()


def run_gate(gate_kwargs: dict, messages: list, headers=(), app=None):
    """(status sent, whether the app ran, the budget after) for a request of ``messages`` through a BodyGate."""
    budget = gate_kwargs.pop("budget")
    sent, ran = [], []

    async def default_app(scope, receive, send):
        ran.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        if not messages:
            await asyncio.sleep(3600)
        message = messages.pop(0)
        if message == "wait":
            await asyncio.sleep(3600)
        return message

    async def send(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    gate = BodyGate(app or default_app, budget=budget, **gate_kwargs)
    asyncio.run(gate({"type": "http", "headers": list(headers)}, receive, send))
    return (sent[0] if sent else None), ran, budget.held


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def test_the_body_gate_holds_the_budget_while_a_request_runs_and_gives_it_back_however_it_ends():
    length = [(b"content-length", b"10")]
    limits = dict(limit=100, timeout=0.5)
    # Whole, in pieces: handed to the app in one message; the budget held while the app runs.
    seen = []

    async def app(scope, receive, send):
        seen.append(budget.held)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": (await receive())["body"]})
    budget = BodyBudget(20)
    assert run_gate(dict(budget=budget, **limits), [body(b"01234", True), body(b"56789")], length, app) == (
        200, [], 0)
    assert seen == [10]
    budget = BodyBudget(20)
    assert run_gate(dict(budget=budget, **limits), [body(b"0123456789")], length)[1:] == ([b"0123456789"], 0)
    # Over the budget with others in flight: 503 before reading; over the limit: 413; too slow: 408.
    budget = BodyBudget(20)
    budget.take(15)
    assert run_gate(dict(budget=budget, **limits), [], length) == (503, [], 15)
    assert run_gate(dict(budget=BodyBudget(10**6), **limits), [], [(b"content-length", b"101")])[0] == 413
    assert run_gate(dict(budget=BodyBudget(20), **limits), [body(b"01", True), "wait"], length) == (408, [], 0)
    # The client left mid-body: nothing answered, nothing held.
    assert run_gate(dict(budget=BodyBudget(20), **limits), [body(b"01", True), {"type": "http.disconnect"}],
                    length) == (None, [], 0)
    # A chunked body (no Content-Length) is counted as it comes: 503 once it would pass the budget, 413 the limit.
    budget = BodyBudget(20)
    budget.take(15)
    assert run_gate(dict(budget=budget, **limits), [body(b"0123", True), body(b"4567")]) == (503, [], 15)
    assert run_gate(dict(budget=BodyBudget(10**6), **limits), [body(b"x" * 60, True), body(b"x" * 60)])[0] == 413
    assert run_gate(dict(budget=BodyBudget(20), **limits), [body(b"01", True), body(b"2")])[1:] == ([b"012"], 0)


def test_a_body_in_pieces_is_handed_whole_and_a_handler_may_take_it_uncopied():
    """A body of several messages: the app receives it whole as bytes, and finds the same bytes under BODY_KEY as a
    view of the map it was gathered in (a pushed adapter's 84 MB are not joined again under the GIL)."""
    from lorakit.serve.edge import BODY_KEY

    seen = {}

    async def app(scope, receive, send):
        seen["scope"] = scope[BODY_KEY]
        seen["received"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    pieces = [bytes([i]) * 1000 for i in range(7)]
    messages = [body(p, i < len(pieces) - 1) for i, p in enumerate(pieces)]
    status, _, held = run_gate(dict(budget=BodyBudget(10**6), limit=10**5, timeout=5), messages,
                               [(b"content-length", b"7000")], app)
    assert (status, held) == (200, 0)
    assert isinstance(seen["scope"], memoryview) and bytes(seen["scope"]) == b"".join(pieces)
    assert type(seen["received"]) is bytes and seen["received"] == b"".join(pieces)


def test_the_body_budget_is_checked_and_defaults_to_a_share_of_memory():
    assert ServeConfig().bytes_in_flight >= ServeConfig().max_body_bytes
    assert ServeConfig(max_body_bytes_in_flight=2**30).bytes_in_flight == 2**30
    with pytest.raises(ValueError, match="below max_body_bytes"):
        ServeConfig(max_body_bytes=2 * MIB, max_body_bytes_in_flight=MIB)
    for name in ("header_timeout", "body_timeout"):
        for bad in (0, -1, float("inf"), float("nan"), True, "1"):
            with pytest.raises(ValueError, match=name):
                ServeConfig(**{name: bad})


# 1b. A header sent a byte at a time was never timed out.

def http_protocols():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    protocols = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return protocols
    return [*protocols, pytest.param(HttpToolsProtocol, id="httptools")]


@pytest.mark.parametrize("http", http_protocols())
def test_a_header_trickled_byte_by_byte_is_dropped_after_the_header_timeout(world, http):
    timeout = 1.0
    live = start(world, header_timeout=timeout, http=http)
    try:
        with long_bystander(live, world, 8.0):
            # Trickled: a 408 in OpenAI's shape, then closed (the trickle would go on for 60 s).
            started = time.monotonic()  # before the connection: the server's clock starts when it accepts it
            with socket.create_connection(("127.0.0.1", live.port), timeout=60) as sock:
                head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 600
                for byte in head:
                    if select.select([sock], [], [], 0.1)[0]:  # the server answered
                        break
                    sock.sendall(bytes([byte]))
                error = openai_error(*response(sock), 408)
                assert "--header-timeout" in error["message"], error
                assert time.monotonic() - started >= timeout
            # A connection that sends nothing: closed without a word.
            with socket.create_connection(("127.0.0.1", live.port), timeout=60) as sock:
                assert sock.recv(100) == b""
            # Headers without end: 431 once they pass the bound, whatever their pace.
            with socket.create_connection(("127.0.0.1", live.port), timeout=60) as sock:
                try:
                    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"x-pad: a\r\n" * MAX_HEADER_BYTES)
                except OSError:  # closed after its answer and a while of reading
                    pass
                openai_error(*response(sock), 431)
            # A kept-alive connection serves request after request, each within the timeout.
            with httpx.Client(base_url=live.url, timeout=30) as client:
                for _ in range(3):
                    assert client.get("/v1/models").status_code == 200
                    time.sleep(timeout / 2)
    finally:
        live.close()


# 1c. A client that sent its request and half-closed its socket (shutdown(SHUT_WR)) got 0 bytes: the server took
# the end of its input for the end of the connection, and the request was cancelled.

@pytest.mark.parametrize("http", http_protocols())
def test_a_client_that_half_closes_after_its_request_reads_its_answer(world, http):
    live = start(world, http=http)
    try:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", live.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            sock.shutdown(socket.SHUT_WR)
            status, answer = response(sock)  # then the server closes: the client sends nothing more
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        with socket.create_connection(("127.0.0.1", live.port), timeout=60) as sock:  # half-closed mid-body: closed
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(100) == b""
        assert httpx.get(f"{live.url}/v1/models", timeout=30).status_code == 200
    finally:
        live.close()


# 1d. Answering the half-close made a client that closed its socket altogether (gave up) look the same: its request
# ran to the end, and was not counted as a 499 (CI failure at 164900e).

@pytest.mark.parametrize("http", http_protocols())
def test_a_client_that_closes_after_its_request_has_it_cancelled(world, http):
    live = start(world, http=http)
    try:
        with slow_steps(live, 0.3) as engine:  # 100 tokens: 30 s if the request ran on
            body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True}).encode()
            sock = socket.create_connection(("127.0.0.1", live.port), timeout=60)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(engine.has_unfinished)
            sock.close()
            wait_for(lambda: not engine.has_unfinished(), timeout=10)
        assert httpx.get(f"{live.url}/v1/models", timeout=30).status_code == 200
    finally:
        live.close()


# 2. A lone surrogate in a prompt, a chat's content or /generate's text was a 500 (from the tokenizer).

LONE = r"\ud800"
SURROGATES = [  # (path, raw JSON body with a lone surrogate, the param named)
    ("/v1/completions", '{"model": "tiny", "prompt": "hi %s"}' % LONE, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "a%sb"]}' % r"\udfff", "prompt[1]"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["x", "%s"]}' % LONE, "stop[1]"),
    ("/v1/completions", '{"model": "tiny%s", "prompt": "hi"}' % LONE, "model"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "%s"}]}' % LONE,
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "%s"}]}]}' % r"\udbff\udbff", "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             '"guided_choice": ["%s"]}' % LONE, "guided_choice[0]"),
    ("/generate", '{"text": "%s"}' % LONE, "text"),
    ("/generate", '{"text": ["hi", "%s"]}' % LONE, "text[1]"),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": "%s"}}' % LONE, "sampling_params.stop"),
    ("/generate", '{"text": "hi", "rid": "%s"}' % LONE, "rid"),
    ("/generate", '{"text": "hi", "sampling_params": {"%s": 1}}' % LONE, "sampling_params.<key>"),
]


@pytest.fixture(scope="module")
def server(world):
    live = start(world)
    yield live
    live.close()


JSON = {"content-type": "application/json"}


def test_text_no_tokenizer_takes_is_a_400_naming_its_field(world, server):
    with bystander(server, world, max_gap=2.0):
        for path, raw, param in SURROGATES:
            r = httpx.post(server.url + path, content=raw.encode(), headers=JSON, timeout=60)
            error = openai_error(r.status_code, r.json(), 400)
            assert error["param"] == param and "surrogate" in error["message"], (raw, error)
            assert error["type"] == "invalid_request_error", error
        # The UTF-8 bytes of a surrogate, and bytes that are no UTF-8 at all.
        r = httpx.post(server.url + "/generate", content=b'{"text": "\xed\xa0\x80"}', headers=JSON, timeout=60)
        assert openai_error(r.status_code, r.json(), 400)["param"] == "text"
        r = httpx.post(server.url + "/generate", content=b'{"text": "\xff"}', headers=JSON, timeout=60)
        assert "not UTF-8" in openai_error(r.status_code, r.json(), 400)["message"]
        # Both halves of a pair are one character: served.
        r = httpx.post(server.url + "/v1/completions", headers=JSON, timeout=60,
                       content=b'{"model": "tiny", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')
        assert r.status_code == 200, r.text


# JSON string pieces that make lone surrogates, pairs, and escapes that only look like them.
PIECES = [r"\ud83d", r"\ude00", r"\udbff", r"\udc00", r"\\", r"\\ud800", "\\\\\\ud800", "a", "u", r"\n", "é",
          "\U0001f600", r"\u00e9"]


@given(st.lists(st.sampled_from(PIECES), max_size=12), st.booleans())
def test_parse_body_refuses_exactly_the_bodies_whose_text_has_a_surrogate(pieces, raw_bytes):
    text = '{"prompt": "%s"}' % "".join(pieces)
    data = text.encode("utf-8", "surrogatepass")
    if raw_bytes:  # the same text with its escapes written as (CESU-8) bytes: surrogates as UTF-8 bytes
        data = json.dumps(json.loads(data), ensure_ascii=False).encode("utf-8", "surrogatepass")
    value = json.loads(data)
    has = any(0xD800 <= ord(c) <= 0xDFFF for c in value["prompt"])
    try:
        assert parse_body(data) == value and not has
    except ApiError as e:
        assert has and e.param == "prompt", (data, e.message)


# 3. The key was in the process table only (--api-key), "bearer" refused, compared with !=.

def test_the_api_key_comes_from_one_source(tmp_path, caplog):
    assert api_key(None, None, environ={}) is None
    assert api_key(None, None, environ={ENV_KEY: "from-env"}) == "from-env"
    path = tmp_path / "key"
    path.write_text("from-file\n")
    path.chmod(0o600)
    assert api_key(None, path, environ={}) == "from-file"
    with caplog.at_level(logging.WARNING, logger="lorakit.serve"):
        assert api_key("from-flag", None, environ={}) == "from-flag"
    assert "process table" in caplog.text
    with pytest.raises(ValueError, match="given 2 ways"):
        api_key("a", None, environ={ENV_KEY: "b"})
    with pytest.raises(ValueError, match="given 2 ways"):
        api_key(None, path, environ={ENV_KEY: "b"})
    with pytest.raises(ValueError, match="empty"):
        api_key(None, None, environ={ENV_KEY: ""})
    with pytest.raises(ValueError, match="cannot read it"):
        api_key(None, tmp_path / "nope", environ={})
    with pytest.raises(ValueError, match="visible ASCII"):
        api_key("two words", None, environ={})
    with pytest.raises(ValueError, match="empty"):
        ServeConfig(api_key="")


def test_the_cli_reads_the_key_from_the_environment_or_a_file(tmp_path, monkeypatch):
    import argparse

    from lorakit.serve import cli

    def config(*argv):
        sub = argparse.ArgumentParser().add_subparsers()
        cli.add_parser(sub)
        cli.add_ray_parser(sub)
        return cli.serve_config(sub.choices[argv[0]].parse_args(argv[1:]), "base")

    path = tmp_path / "key"
    path.write_text("filed")
    monkeypatch.delenv(ENV_KEY, raising=False)
    assert config("serve").api_key is None
    assert config("serve", "--api-key-file", str(path)).api_key == "filed"
    assert config("serve-ray", "--api-key-file", str(path)).api_key == "filed"
    monkeypatch.setenv(ENV_KEY, "envy")
    assert config("serve").api_key == "envy" and config("serve-ray").api_key == "envy"
    with pytest.raises(ValueError, match="given 2 ways"):
        config("serve", "--api-key", "flagged")
    served = config("serve", "--max-body-bytes-in-flight", str(64 * MIB), "--header-timeout", "2.5",
                    "--body-timeout", "7")
    assert (served.max_body_bytes_in_flight, served.header_timeout, served.body_timeout) == (64 * MIB, 2.5, 7.0)


def test_authorized_reads_the_scheme_in_any_case_and_only_the_key():
    for header in ("Bearer secret", "bearer secret", "BEARER secret", b"Bearer  secret ", " bearer secret"):
        assert authorized(header, "secret"), header
    for header in (None, "", "Bearer", "Bearer secre", "Bearer secrets", "Basic secret", "secret", "Bearer=secret",
                   "Bearer sécret"):
        assert not authorized(header, "secret"), header


def test_the_live_server_takes_the_key_in_any_case_and_refuses_a_wrong_one(world):
    live = start(world, api_key="secret")
    try:
        for header, status in (("bearer secret", 200), ("BEARER secret", 200), ("Bearer wrong", 401),
                               ("Basic secret", 401), (None, 401)):
            headers = {} if header is None else {"authorization": header}
            r = httpx.get(live.url + "/v1/models", headers=headers, timeout=60)
            if status == 401:
                assert "API key" in openai_error(r.status_code, r.json(), 401)["message"]
            else:
                assert r.status_code == 200, r.text
        assert httpx.get(live.url + "/health", timeout=60).status_code == 200  # open without a key
        r = live.client("secret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
    finally:
        live.close()


def test_the_ray_router_checks_the_key_as_the_server_does():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'lorakit[ray]'")
    from starlette.requests import Request

    from lorakit.serve.ray import Router

    router = Router(None, "base", [], api_key="secret")  # an admin path is answered before any replica is asked

    def status(header):
        headers = [] if header is None else [(b"authorization", header.encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/load_lora_adapter", "headers": headers,
                 "query_string": b""}

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}
        return asyncio.run(router(Request(scope, receive))).status_code

    assert [status(h) for h in ("bearer secret", "Bearer secret", "Bearer wrong", None)] == [403, 403, 401, 401]


def test_a_body_gathered_in_a_map_is_unmapped_off_the_loop_once_nothing_views_it():
    """Unmapping a pushed adapter's 84 MB took 15-70 ms of whichever thread dropped its last reference: the event
    loop's, in practice (the request's objects collected in a cycle), which held every stream up. BodyGate hands the
    map to the Unmapper's thread, which closes it once the last view is gone, never under a reader."""
    import mmap

    from lorakit.frontend.bodies import UNMAPPER, Unmapper
    from lorakit.serve.edge import BODY_KEY

    seen = {}

    async def app(scope, receive, send):
        seen["body"] = scope[BODY_KEY]  # a view kept past the answer (as a send in flight, or a cycle, keeps one)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    pieces = [bytes([i]) * 1000 for i in range(3)]
    messages = [body(p, i < len(pieces) - 1) for i, p in enumerate(pieces)]
    assert run_gate(dict(budget=BodyBudget(10**6), limit=10**5, timeout=5), messages,
                    [(b"content-length", b"3000")], app)[0] == 200
    mapped = seen["body"].obj
    assert isinstance(mapped, mmap.mmap)
    time.sleep(3 * Unmapper.RETRY)
    assert not mapped.closed and bytes(seen["body"]) == b"".join(pieces)  # viewed: kept
    del seen["body"]
    wait_for(lambda: mapped.closed, timeout=5)  # by the Unmapper's thread: this one only dropped the view
    assert UNMAPPER._thread.name == "lorakit-unmap"
