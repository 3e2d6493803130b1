"""Admission: the server lets in what the engine's queue should hold and refuses the rest at once. The default
limits follow the engine (16 x max_num_seqs sequences, 4 x the KV cache's tokens, shared by the API servers); a
burst past max_num_seqs and past the cache is queued by the engine, not refused; past the token limit a request
gets 429 with Retry-After, and one that alone passes it, 400; what a request holds comes back however it ends."""

import asyncio
import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest

from _serve_helpers import reference, run_state, start
from helpers import slow_steps, wait_for
from lorakit.engine import Engine
from lorakit.frontend.client import InProcessClient
from lorakit.serve import ServeConfig, openai, sglang
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody
from lorakit.serve.state import QUEUE_FACTOR, SEQUENCES_PER_SEAT, ServerState
from lorakit.serve.streaming import MAX_RETRY_AFTER, ConcurrencyLimit

# A tiny engine: 2 requests run at once, a cache of 64 blocks of 4 tokens (256 tokens: two full-length requests of
# max_seq_len 128, the model's max_position_embeddings).
ENGINE = {"max_num_seqs": 2, "num_blocks": 64}
KV_TOKENS, MAX_SEQ_LEN = 64 * 4, 128


def prompt_len(world, text: str) -> int:
    return len(world[1].encode(text))


def held(live) -> tuple[int, int]:
    limit = live.server.config.app.state.server.in_flight
    return limit.held_sequences, limit.held_tokens


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    return r.json()["error"]


# The limits and what is counted.

def test_the_default_limits_follow_the_engine(world):
    base, tokenizer, _, _ = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, block_size=4, **ENGINE)
    client = InProcessClient(engine)
    assert (client.kv_tokens, client.max_num_seqs, client.servers) == (KV_TOKENS, 2, 1)
    state = ServerState(engine, ServeConfig())
    assert (state.in_flight.sequences, state.in_flight.tokens) == (SEQUENCES_PER_SEAT * 2, QUEUE_FACTOR * KV_TOKENS)
    assert (SEQUENCES_PER_SEAT, QUEUE_FACTOR) == (16, 4)
    given = ServerState(engine, ServeConfig(max_concurrent=5, max_queued_tokens=1000)).in_flight
    assert (given.sequences, given.tokens) == (5, 1000)  # as given, whatever the engine
    # Several API servers share the defaults; the tokens' never falls below one full-length sequence.
    shared = SimpleNamespace(kv_tokens=KV_TOKENS, max_num_seqs=2, max_seq_len=MAX_SEQ_LEN, servers=3)
    assert ServeConfig().in_flight(shared) == (32 // 3, 1024 // 3)
    assert ServeConfig().in_flight(SimpleNamespace(**{**vars(shared), "servers": 64})) == (1, MAX_SEQ_LEN)
    assert ServeConfig(max_concurrent=7, max_queued_tokens=99).in_flight(shared) == (7, 99)  # each process's own
    for bad in (0, -1, 2.5, True, "9"):
        with pytest.raises(ValueError, match="max_queued_tokens must be an int >= 1"):
            ServeConfig(max_queued_tokens=bad)


def served(world, body_of, **config):
    """``body_of(state)`` (a coroutine) against a fresh ServerState over the tiny engine, on a loop of its own."""
    base, tokenizer, root, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={"sql": paths["sql"]}, block_size=4,
                    **ENGINE)
    state = ServerState(engine, ServeConfig(model_name="tiny", lora_roots=[root], **config))

    return run_state(state, body_of)


def test_a_reply_counts_each_sequences_prompt_and_max_tokens_fitted_to_the_context(world):
    """The tokens a reply holds: for each job its prompt and max_tokens, cut to max_seq_len as the engine cuts it."""
    short, long = "hello", "What is the capital of France? Paris is."
    p, q = prompt_len(world, short), prompt_len(world, long)

    async def run(state):
        replies = [
            await openai.completions(CompletionBody(model="sql", prompt=[short, long], n=2, max_tokens=10), state),
            await openai.completions(CompletionBody(model="tiny", prompt=short, stream=True), state),  # default 16
            await openai.chat(ChatBody(model="tiny", messages=[{"role": "user", "content": short}], n=3), state),
            await sglang.generate(sglang.GenerateBody(text=[short, long], sampling_params={"n": 2}), state),
            await sglang.generate(sglang.GenerateBody(text=long, stream=True,
                                                      sampling_params={"max_new_tokens": 4}), state)]
        for reply in replies:
            if asyncio.iscoroutine(reply.body):
                reply.body.close()
        return [(r.sequences, r.tokens) for r in replies]

    assert served(world, run) == [
        (4, 2 * (p + 10) + 2 * (q + 10)),
        (1, p + 16),
        (3, 3 * MAX_SEQ_LEN),  # no max_tokens: whatever room the context leaves
        (4, 2 * MAX_SEQ_LEN + 2 * MAX_SEQ_LEN),  # SGLang's default 128 new tokens, cut to the context
        (1, q + 4)]


# A burst the engine queues.

def test_a_burst_past_max_num_seqs_and_the_cache_is_queued_not_refused(world):
    """24 requests at once, 12 times max_num_seqs and more tokens than the KV cache holds: under the default limits
    every one is admitted (the engine queues them), and each gets its solo text."""
    live = start(world, adapters=("sql",), engine_options=ENGINE)
    engine = live.server.config.app.state.engine
    limit = live.server.config.app.state.server.in_flight
    count, tokens = 24, 20
    need = count * (prompt_len(world, "hello") + tokens)
    assert need > KV_TOKENS and need <= limit.tokens and 2 < count <= limit.sequences  # what the test is about
    gate, waiting, step = threading.Event(), [], engine.step

    def gated():  # no step until all 24 are held at once: none can end early and make room for the next
        gate.wait(60)
        waiting.append(len(engine.scheduler.waiting))
        return step()

    engine.step = gated
    solo = reference(world, "hello", None, max_tokens=tokens, temperature=0.0, ignore_eos=True).text

    def one(i: int) -> tuple[int, str]:
        path = "/generate" if i % 2 else "/v1/completions"
        stream = i % 4 >= 2
        body = {"text": "hello", "stream": stream, "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                                         "ignore_eos": True}} if i % 2 else {
            "model": "tiny", "prompt": "hello", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
        with httpx.Client(timeout=120) as http:
            if not stream:
                r = http.post(live.url + path, json=body)
                text = "" if r.status_code != 200 else r.json()["text"] if i % 2 else r.json()["choices"][0]["text"]
                return r.status_code, text
            with http.stream("POST", live.url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return r.status_code, r.text
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
                if i % 2:  # SGLang's chunks carry the text so far
                    return 200, chunks[-1]["text"]
                return 200, "".join(c["choices"][0]["text"] for c in chunks)

    try:
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(one, i) for i in range(count)]
            try:
                wait_for(lambda: limit.held_sequences == count or any(f.done() for f in futures))
                assert (limit.held_sequences, limit.held_tokens) == (count, need)
            finally:
                gate.set()  # (before the pool waits for its threads)
            results = [f.result() for f in futures]
    finally:
        engine.step = step
        live.close()
    assert [status for status, _ in results] == [200] * count, results
    assert [text for _, text in results] == [solo] * count
    assert max(waiting) >= count // 2  # queued in the engine, beside the 2 it runs


# Past the limits.

@pytest.fixture(scope="module")
def bounded(world):
    """A server whose token limit holds one stream of "hello" with 100 new tokens, and 50 tokens more."""
    limit = prompt_len(world, "hello") + 100 + 50
    live = start(world, adapters=("sql",), max_queued_tokens=limit)
    yield live, limit
    live.close()


@contextmanager
def holding(live, path="/v1/completions", body=None):
    """A stream that holds "hello" + 100 tokens while the block runs (its first chunk read)."""
    body = body or {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with slow_steps(live), httpx.Client(timeout=60) as http, http.stream("POST", live.url + path, json=body) as r:
        lines = r.iter_lines()
        assert r.status_code == 200 and next(lines).startswith("data: {")
        yield lines


def test_past_the_token_limit_a_429_with_retry_after_names_the_flag(world, bounded):
    live, limit = bounded
    p = prompt_len(world, "hello")
    completion = {"model": "tiny", "prompt": "hello", "ignore_eos": True}
    generate = {"text": "hello", "sampling_params": {"ignore_eos": True}}
    with holding(live) as lines:
        assert held(live) == (1, p + 100)
        for stream in (False, True):
            over = [("/v1/completions", {**completion, "max_tokens": 51 - p, "stream": stream}),
                    ("/generate", {**generate, "stream": stream, "sampling_params": {"max_new_tokens": 51 - p}})]
            for path, body in over:  # one token more than is left
                r = httpx.post(live.url + path, json=body, timeout=60)
                error = error_of(r, 429)
                assert error["type"] == "rate_limit_error" and "--max-queued-tokens" in error["message"]
                assert f"they hold {p + 100} tokens" in error["message"] and f"limit of {limit}" in error["message"]
                assert f"this request needs {51}" in error["message"]
                seconds = r.headers["retry-after"]
                assert seconds.isdigit() and 1 <= int(seconds) <= MAX_RETRY_AFTER
                assert f"retry after {seconds} s" in error["message"]
        # Exactly what is left is admitted, on either endpoint.
        r = httpx.post(live.url + "/v1/completions", json={**completion, "max_tokens": 50 - p}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50 - p
        r = httpx.post(live.url + "/generate", json={"text": "hello", "sampling_params": {
            "max_new_tokens": 50 - p, "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 50 - p
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    wait_for(lambda: held(live) == (0, 0))


def test_a_request_that_alone_passes_the_token_limit_gets_400(world, bounded):
    live, limit = bounded
    p = prompt_len(world, "hello")
    each = limit // 2 - p + 1  # two samples of this many new tokens pass the limit by one or two
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "n": 2, "max_tokens": each},
                   timeout=60)
    error = error_of(r, 400)
    assert "--max-queued-tokens" in error["message"] and f"({limit}," in error["message"]
    assert error["param"] == "max_tokens" and "retry-after" not in r.headers
    for stream in (False, True):
        r = httpx.post(live.url + "/generate", json={"text": ["hello", "hello"], "stream": stream,
                                                     "sampling_params": {"max_new_tokens": each}}, timeout=60)
        assert "--max-queued-tokens" in error_of(r, 400)["message"]
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "n": 2,
                                                       "max_tokens": each - 1, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")  # at the limit: served
    assert held(live) == (0, 0)


def test_the_sequence_limit_still_refuses_with_retry_after(world):
    live = start(world, adapters=("sql",), max_concurrent=1)
    try:
        with holding(live, "/generate", {"text": "hello", "stream": True, "sampling_params": {
                "max_new_tokens": 100, "ignore_eos": True}}):
            assert held(live)[0] == 1
            r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=60)
            error = error_of(r, 429)
            assert "--max-concurrent" in error["message"] and "limit of 1" in error["message"]
            assert int(r.headers["retry-after"]) >= 1
    finally:
        live.close()


# What a request holds comes back.

def test_held_tokens_come_back_when_a_request_ends_leaves_or_fails(world, bounded):
    """After each way a request can end, nothing is held; the limit's whole is admitted again at the end."""
    live, limit = bounded
    p = prompt_len(world, "hello")
    url = live.url
    more = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "ignore_eos": True}  # more than the 50 left

    def back():
        wait_for(lambda: held(live) == (0, 0))

    # Ends: plain and streamed, both endpoints.
    assert httpx.post(url + "/v1/completions", json={**more, "max_tokens": 3}, timeout=60).status_code == 200
    assert httpx.post(url + "/generate", json={"text": "hello", "stream": True, "sampling_params": {
        "max_new_tokens": 3}}, timeout=60).status_code == 200
    back()
    # A streaming client that leaves after its first chunk.
    for path, body in (("/v1/completions", None), ("/generate", {"text": "hello", "stream": True, "sampling_params": {
            "max_new_tokens": 100, "ignore_eos": True}})):
        with holding(live, path, body):
            assert held(live) == (1, p + 100)
            assert httpx.post(url + "/v1/completions", json=more, timeout=60).status_code == 429
        back()
    # A plain request whose client gives up (499).
    with slow_steps(live):
        for path, body in (("/v1/completions", {**more, "max_tokens": 100}),
                           ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 100,
                                                                                "ignore_eos": True}})):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + path, json=body, timeout=0.5)
            back()
    # Failures: every step fails (503), a plain request and a stream (its error event).
    engine = live.server.config.app.state.engine
    step = engine.step

    def broken():
        raise RuntimeError("a step failed")

    engine.step = broken
    try:
        r = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 5}},
                       timeout=60)
        assert r.status_code == 503
        r = httpx.post(url + "/v1/completions", json={**more, "max_tokens": 5, "stream": True}, timeout=60)
        assert r.status_code == 200 and '"code":"service_unavailable"' in r.text and r.text.endswith("data: [DONE]\n\n")
        back()
    finally:
        engine.step = step
    each = limit // 2 - p  # two samples: the whole limit, give or take a token
    r = httpx.post(url + "/v1/completions", json={**more, "n": 2, "max_tokens": each}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * each
    back()


# Retry-After.

def test_retry_after_is_the_time_the_recent_pace_takes_to_free_what_is_lacking():
    now = [0.0]

    def limit(sequences: int, tokens: int) -> ConcurrencyLimit:
        return ConcurrencyLimit(sequences, tokens, clock=lambda: now[0])

    def retry_after(of: ConcurrencyLimit, sequences: int, tokens: int) -> str:
        with pytest.raises(ApiError) as e:
            of.check(sequences, tokens)
        assert e.value.status == 429 and f"retry after {e.value.headers['retry-after']} s" in e.value.message
        return e.value.headers["retry-after"]

    async def main():
        tokens = limit(100, 300)
        held = [tokens.hold(1, 100) for _ in range(3)]
        for h in held:
            await h.__aenter__()
        assert retry_after(tokens, 1, 1) == "1"  # nothing ended yet: nothing to go by
        await held[0].__aexit__(None, None, None)  # at 0 s
        now[0] = 4.0
        await held[1].__aexit__(None, None, None)  # 200 tokens given back over 4 s: 50 a second
        async with tokens.hold(1, 150):  # 250 held
            assert retry_after(tokens, 1, 150) == "2"  # 100 lacking at 50 a second
            assert retry_after(tokens, 1, 51) == "1"  # 1 lacking: at least a second
            now[0] = 4.0 + 11  # the ends fall out of the window
            assert retry_after(tokens, 1, 150) == "1"
        await held[2].__aexit__(None, None, None)
        assert (tokens.held_sequences, tokens.held_tokens) == (0, 0)

        sequences = limit(2, 10**9)
        async with sequences.hold(1, 1):  # one sequence back at once (spans count as at least 1 s)
            pass
        async with sequences.hold(2, 1):
            assert retry_after(sequences, 2, 1) == "2"  # 2 lacking at 1 a second
        slow = limit(10, 10**6)
        async with slow.hold(1, 1):
            pass
        async with slow.hold(1, 10**6 - 1):
            assert retry_after(slow, 1, 10**6) == str(MAX_RETRY_AFTER)  # days at this pace: capped

    asyncio.run(main())
