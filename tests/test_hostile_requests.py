"""A hostile or careless client cannot hurt anyone else: each test makes one attack on a live server while a
Bystander streams beside it, and checks that the attack is refused (in OpenAI's error shape) or bounded, and that the
Bystander still gets exactly its solo text without a long wait between two chunks."""

import copy
import json
import threading
import time

import httpx
import pytest

from _serve_helpers import LiveServer, start
from helpers import BYSTANDER_TOKENS as TOKENS, bystander, post, wait_for
from lorakit.serve.protocol import error_status
from lorakit.engine import Engine
from lorakit.serve import ServeConfig, create_app


@pytest.fixture(scope="module")
def server(world):
    live = start(world, max_concurrent=8)
    yield live
    live.close()


def error_of(r: httpx.Response, status: int) -> dict:
    """The error of a response that must be ``status`` with a body in OpenAI's shape."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error_status(error["code"]) == status, error
    return error


def events(r: httpx.Response) -> list:
    """A stream's events, decoded; it must end with [DONE]."""
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-500:]
    return [json.loads(line) for line in lines[:-1]]


# 1. One bad request killed every request in flight.

def test_values_past_the_samplers_ranges_are_refused_and_others_keep_streaming(world, server):
    """top_k = 2**63 got its 400, but first reached an engine step, whose int64 tensor overflowed: every stream in
    that step ended with "Overflow when unpacking long long". Now every value is checked before it is queued."""
    engine = server.server.config.app.state.engine
    queued = []
    add = engine.add_request
    engine.add_request = lambda *a: (queued.append(a[1]), add(*a))[1]
    try:
        with bystander(server, world):
            for extra, param in (({"top_k": 2**63}, "top_k"), ({"top_k": 2**31}, "top_k"),
                                 ({"seed": 2**64}, "seed"), ({"stop_token_ids": [2**63]}, "stop_token_ids"),
                                 ({"temperature": 1e300}, "temperature"),
                                 ({"repetition_penalty": 1e-300}, "repetition_penalty"),
                                 ({"logit_bias": {str(2**63): 1}}, "logit_bias"), ({"logit_bias": {"1": 1e300}},
                                                                                    "logit_bias"),
                                 ({"presence_penalty": 1e300}, "presence_penalty"), ({"max_tokens": 2**64},
                                                                                     "max_tokens")):
                for stream in (False, True):
                    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 1.0,
                                                         "stream": stream, **extra})
                    assert error_of(r, 400)["param"] == param, (extra, r.text)
            r = post(server, "/generate", {"text": "hi", "sampling_params": {"top_k": 2**63}})
            assert error_of(r, 400)["param"] == "top_k"
            r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                      "top_k": 2**63})
            assert error_of(r, 400)["param"] == "top_k"
    finally:
        engine.add_request = add
    assert all(p.max_tokens == TOKENS for p in queued)  # only the Bystander reached the engine


# 5. Malformed bodies got a plain-text 500.

def test_malformed_parts_and_sampling_params_get_400_in_openais_shape(world, server):
    bad = [
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": None}]}]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": 5}]}]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [5]}]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": {"text": "x"}}]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": ["user"], "content": "x"}]}),
        ("/generate", {"text": "hi", "sampling_params": {"frobnicate": 1}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 3, "max_new_tokens": 4}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "3"}}),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": [1]}}),
        ("/generate", {"text": "hi", "sampling_params": {"stop": {"a": 1}}}),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"²": 1}}}),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"9" * 5000: 1}}}),
        ("/generate", {"text": "hi", "sampling_params": {"n": 2**64}}),
        ("/generate", {"text": "hi", "sampling_params": "hot"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"²": 1}}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"9" * 5000: 1}}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": "x" * 10_000}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "x" * 100_000: 1}),
    ]
    with bystander(server, world):
        for path, body in bad:
            error = error_of(post(server, path, body), 400)
            assert len(error["message"]) < 1000, error  # a megabyte sent is not a megabyte echoed
    # A chat template's own refusal (raise_exception) is the client's error too.
    tokenizer = server.server.config.app.state.engine.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    try:
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert "roles must alternate" in error_of(r, 400)["message"]
    finally:
        tokenizer.chat_template = template


# 6. Unbounded work stalled everyone.

def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(world):
    live = start(world, max_body_bytes=2**20)
    try:
        with bystander(live, world):
            big = json.dumps({"model": "tiny", "prompt": "x" * 2**21})
            error = error_of(post(live, "/v1/completions", big), 413)
            assert "--max-body-bytes" in error["message"]

            def chunked():  # no Content-Length: refused while reading
                for _ in range(64):
                    yield b" " * 2**16

            r = httpx.post(live.url + "/generate", content=chunked(), headers={"content-type": "application/json"},
                           timeout=60)
            error_of(r, 413)
            assert post(live, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        live.close()


def test_a_body_of_millions_of_items_is_refused_at_once(world, server):
    """Validating 9 MiB of [[1, "a"]] x 1,000,000 (a union tried branch by branch, an error for each item) held the
    event loop for more than five minutes; a million one-token prompts were each tokenized on it; 60,000
    guided_choice strings cost seconds of grammar compiling on the engine thread."""
    # Encoded before the Bystander starts: the server runs in this process, and json.dumps of 16 MB holds the GIL
    # for half a second that would count as the server's.
    bodies = [(path, body if isinstance(body, str) else json.dumps(body)) for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": [[1, "a"]] * 1_000_000}),
        ("/v1/completions", {"model": "tiny", "prompt": [[1]] * 1_500_000}),
        ("/generate", {"input_ids": [[1]] * 1_500_000}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}] * 900_000}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {str(i): "x" for i in range(500_000)}}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_choice": [f"c{i}" for i in range(60_000)]}),
        ("/v1/completions", "[" * 1_000_000 + "]" * 1_000_000))]
    with bystander(server, world, max_gap=2.0):
        for path, body in bodies:
            start_time = time.monotonic()
            error = error_of(post(server, path, body), 400)
            assert time.monotonic() - start_time < 5, (path, error)
            assert "at most" in error["message"] or "parsing the body" in error["message"], error


def test_a_10_mb_prompt_is_refused_before_it_is_tokenized(world, server):
    engine = server.server.config.app.state.engine
    tokenized = []
    prompt_ids = engine.prompt_ids
    engine.prompt_ids = lambda p, a=None: (tokenized.append(len(p)), prompt_ids(p, a))[1]
    try:
        with bystander(server, world):
            huge = "hello world " * 900_000  # about 10 MB
            error = error_of(post(server, "/v1/completions", {"model": "tiny", "prompt": huge}), 400)
            assert "--max-prompt-chars" in error["message"] and error["param"] == "prompt"
            r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": huge}]})
            assert "--max-prompt-chars" in error_of(r, 400)["message"]
            r = post(server, "/generate", {"text": huge})
            assert "--max-prompt-chars" in error_of(r, 400)["message"]
            many = [{"role": "user", "content": ""}] * 1000
            r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": many})
            assert "cannot fit" in error_of(r, 400)["message"]
    finally:
        engine.prompt_ids = prompt_ids
    assert max(tokenized) < 10_000  # the Bystander's, and the short ones: never the huge one


def test_tokenizing_runs_off_the_event_loop(world):
    """A long but allowed prompt takes its time on a thread of its own: the streams the event loop serves go on (short
    prompts, under a millisecond's work, are tokenized on the event loop)."""
    live = start(world, max_prompt_chars=10**6)
    engine = live.server.config.app.state.engine
    threads = []
    prompt_ids = engine.prompt_ids

    def slow(prompt, adapter=None):  # as a tokenizer on a long prompt: seconds without a break
        threads.append((threading.current_thread(), isinstance(prompt, str) and len(prompt) > 1000))
        if isinstance(prompt, str) and len(prompt) > 1000:
            time.sleep(3)
        return prompt_ids(prompt, adapter)

    engine.prompt_ids = slow
    try:
        with bystander(live, world, max_gap=2.0):
            r = post(live, "/v1/completions", {"model": "tiny", "prompt": "hello " * 100_000})
            assert "at most 127 fit" in error_of(r, 400)["message"]
            ok = post(live, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hello"}]})
            assert ok.status_code == 200
    finally:
        engine.prompt_ids = prompt_ids
        live.close()
    long = {thread.name for thread, is_long in threads if is_long}
    assert len(long) == 1 and long.pop().startswith("lorakit-tokenize")  # not the event loop's thread
    assert any(thread is live.thread for thread, is_long in threads if not is_long)  # the short chat, inline


def test_stop_strings_are_bounded_in_count_and_length(world, server):
    """1,000,000 stop strings slowed a concurrent stream from 3 s to 84 s: each is looked for at every token."""
    with bystander(server, world):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["ab"] * 1_000_000})
        assert error_of(r, 400)["param"] == "stop"  # past MAX_ITEMS: refused as the body is read
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["ab"] * 10_000})
        error = error_of(r, 400)
        assert "--max-stop-strings" in error["message"] and error["param"] == "stop"
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["a" * 257]})
        assert "--max-stop-chars" in error_of(r, 400)["message"]
        r = post(server, "/generate", {"text": "hi", "sampling_params": {"stop": ["ab"] * 17}})
        assert "--max-stop-strings" in error_of(r, 400)["message"]
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "stop": ["q" * 256] * 16, "max_tokens": 2})
        assert r.status_code == 200  # at the bounds: served


def test_prompts_times_n_count_against_max_concurrent(world, server):
    """One completion of 200 prompts x n=16 queued 3,200 sequences past --max-concurrent 8."""
    engine = server.server.config.app.state.engine
    most = []
    add = engine.add_request
    engine.add_request = lambda *a: (most.append(len(engine._requests) + 1), add(*a))[1]
    try:
        with bystander(server, world):  # holds 1 of the 8
            r = post(server, "/v1/completions", {"model": "tiny", "prompt": ["hi"] * 200, "n": 16})
            error = error_of(r, 400)
            assert "3200 sequences" in error["message"] and "--max-concurrent" in error["message"]
            r = post(server, "/generate", {"text": ["hi"] * 5, "sampling_params": {"n": 2}})
            assert "10 sequences" in error_of(r, 400)["message"]
            # 7 fit beside the Bystander; while they run, 1 more does not.
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", server.url + "/v1/completions", json={
                        "model": "tiny", "prompt": ["hi", "hello", "the quick"], "n": 2, "max_tokens": 40,
                        "ignore_eos": True, "stream": True}) as running:
                    lines = running.iter_lines()
                    next(lines)
                    r = post(server, "/v1/chat/completions", {"model": "tiny", "n": 2, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})
                    assert "too many requests" in error_of(r, 429)["message"] and "--max-concurrent" in r.text
                    assert int(r.headers["retry-after"]) >= 1
                    assert post(server, "/generate", {"text": "hi", "sampling_params": {
                        "max_new_tokens": 2}}).status_code == 200  # the 8th place
                    rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    finally:
        engine.add_request = add
    assert max(most) <= 8


# 9. A request ended empty with a 200 when its adapter was unloaded before it ran.

def test_a_request_whose_adapter_is_unloaded_while_it_waits_gets_an_error(world):
    base, tokenizer, root, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, max_num_seqs=2, block_size=4,
                    adapters={n: paths[n] for n in ("sql", "chat")})
    live = LiveServer(create_app(engine, ServeConfig(model_name="tiny", lora_roots=[root], allow_runtime_lora=True)))
    try:
        with bystander(live, world):  # one of the batch's two places
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", live.url + "/v1/completions", json={
                        "model": "sql", "prompt": "hello", "max_tokens": 60, "ignore_eos": True,
                        "stream": True}) as busy:  # the other
                    lines = busy.iter_lines()
                    next(lines)
                    results = {}
                    waiting = [threading.Thread(target=lambda: results.__setitem__("plain", post(
                        live, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 5}))),
                               threading.Thread(target=lambda: results.__setitem__("stream", post(
                                   live, "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 5,
                                                             "stream": True})))]
                    for t in waiting:
                        t.start()
                    wait_for(lambda: sum(r.adapter_name == "chat" for r in list(engine.scheduler.waiting)) == 2)
                    assert post(live, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
                    for t in waiting:
                        t.join(60)
                    list(lines)
        error = error_of(results["plain"], 400)
        assert "unloaded" in error["message"], error
        assert results["stream"].status_code == 200
        (event,) = events(results["stream"])  # no text: only the error
        assert event["error"]["code"] is None and "unloaded" in event["error"]["message"], event
    finally:
        live.close()


def test_an_abort_the_client_did_not_cause_is_an_error_it_sees(world, server):
    """The engine ending a request by itself (Engine.abort from its own thread: a library user's code, a shutdown)
    once gave its client an empty 200 with finish_reason "abort"."""
    engine = server.server.config.app.state.engine
    victims = []

    def aborting():
        for rid, request in list(engine._requests.items()):
            if request.params.max_tokens == 7 and rid not in victims:  # the victims' requests, not the Bystander's
                victims.append(rid)
                engine.abort(rid)
        return inner()

    with bystander(server, world):
        inner = engine.step  # the Bystander's slow steps
        engine.step = aborting
        try:
            plain = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 7})
            streamed = post(server, "/generate", {"text": "hi", "stream": True, "sampling_params": {
                "max_new_tokens": 7}})
        finally:
            engine.step = inner
    assert error_of(plain, 503)["message"].startswith("the server ended this request")
    (event,) = events(streamed)
    assert event["error"]["code"] == "service_unavailable" and len(victims) == 2
