"""The server's parts without HTTP: handlers called as plain functions of (body, ServerState) and equal to
LLM.generate, the engine thread's contract (only it touches the engine), the limit on requests in flight, replies
and their errors in OpenAI's shape, and the one mapping to SamplingParams."""

import asyncio
import copy
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _serve_helpers import reference, run_state
from lorakit.engine import Engine, SamplingParams
from lorakit.serve import ServeConfig, adapters, confined, openai, sglang
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody, LoadBody, UnloadBody, nth_sample
from lorakit.serve.state import ServerState
from lorakit.serve.streaming import DONE, ConcurrencyLimit, Reply, outputs, respond

PROMPT = "What is the capital of France?"


def served(world, body_of, **config):
    """``body_of(state)`` (a coroutine) run against a fresh ServerState's engine thread, on an event loop of its
    own; also every engine method that changes the engine, with the thread that called it."""
    base, tokenizer, root, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={"sql": paths["sql"]}, block_size=4)
    calls = []
    for owner, name in ((engine, "add_request"), (engine, "abort"), (engine, "step"), (engine.registry, "install"),
                        (engine, "unregister_adapter")):
        method = getattr(owner, name)
        setattr(owner, name, lambda *a, _m=method, _n=name: (calls.append((_n, threading.current_thread().name)),
                                                              _m(*a))[1])
    state = ServerState(engine, ServeConfig(model_name="tiny", lora_roots=[root], **config))

    return run_state(state, body_of), calls


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(world):
    """A prompt sent again is served from the prefix cache: usage.prompt_tokens_details.cached_tokens says how much
    (whole blocks of 4, at least one token computed), in a reply and in the final streamed usage chunk; /metrics counts
    it per adapter."""
    _, tokenizer, _, _ = world
    prompt = " ".join([PROMPT] * 4)
    n = len(tokenizer.encode(prompt))

    async def run(state):
        body = dict(model="sql", prompt=prompt, max_tokens=3, temperature=0)
        first = await (await openai.completions(CompletionBody(**body), state)).body
        again = await (await openai.completions(CompletionBody(**body), state)).body
        streamed = await openai.completions(CompletionBody(**body, stream=True, stream_options={"include_usage": True}),
                                            state)
        chunks = [c async for c in streamed.body]
        return first, again, chunks, state.metrics.render().decode()

    (first, again, chunks, metrics), _ = served(world, run)
    cached = (n - 1) // 4 * 4
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": cached} and cached > 0
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert f'lorakit_prefix_cache_hit_tokens_total{{adapter="sql"}} {2 * cached}.0' in metrics
    assert f'lorakit_prefix_cache_prompt_tokens_total{{adapter="sql"}} {3 * n}.0' in metrics


def test_the_small_things_in_openai_shape(world):
    """A stable ``created`` per model in /v1/models, ``system_fingerprint`` on every answer and chunk, and each chat
    logprobs entry's ``bytes`` (the UTF-8 of its token's text)."""
    _, tokenizer, _, _ = world

    async def run(state):
        listed = openai.models(state)
        await asyncio.sleep(1.1)
        again = openai.models(state)
        chat = await (await openai.chat(ChatBody(model="sql", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2),
                                        state)).body
        streamed = await openai.chat(ChatBody(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, stream=True), state)
        return listed, again, chat, [c async for c in streamed.body]

    (listed, again, chat, chunks), _ = served(world, run)
    assert listed == again and {m["id"] for m in listed["data"]} >= {"tiny", "sql"}
    assert chat["system_fingerprint"] and all(c["system_fingerprint"] == chat["system_fingerprint"] for c in chunks)
    entries = chat["choices"][0]["logprobs"]["content"]
    assert entries
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2
        assert all(top["bytes"] == list(top["token"].encode()) for top in entry["top_logprobs"])


def test_handlers_are_plain_functions_equal_to_llm_generate(world):
    _, tokenizer, root, paths = world

    async def run(state):
        plain = await (await openai.completions(CompletionBody(model="sql", prompt=PROMPT, max_tokens=8,
                                                               temperature=0, n=2, logprobs=1), state)).body
        streamed = await openai.completions(CompletionBody(
            model="tiny", prompt=[PROMPT, "hello"], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}), state)
        chunks = [c async for c in streamed.body]
        chat = await (await openai.chat(ChatBody(model="sql", messages=[{"role": "user", "content": "hello world"}],
                                                 max_tokens=5, temperature=0), state)).body
        loaded = await adapters.load(LoadBody(lora_name="v2", lora_path=paths["v2"]), state)
        listed = [m["id"] for m in openai.models(state)["data"]]
        generated = await (await sglang.generate(sglang.GenerateBody(text=PROMPT, lora_path="v2", sampling_params={
            "max_new_tokens": 6, "temperature": 0}), state)).body
        await adapters.unload(UnloadBody(lora_name="v2"), state)
        return plain, chunks, chat, loaded, listed, generated, [m["id"] for m in openai.models(state)["data"]]

    (plain, chunks, chat, loaded, listed, generated, after), calls = served(world, run, allow_runtime_lora=True)
    ref = reference(world, PROMPT, "sql", max_tokens=8, temperature=0.0)
    assert [c["text"] for c in plain["choices"]] == [ref.text] * 2 and plain["object"] == "text_completion"
    cached = plain["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert plain["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 2 * len(ref.token_ids),
                              "total_tokens": len(ref.prompt_token_ids) + 2 * len(ref.token_ids),
                              "prompt_tokens_details": {"cached_tokens": cached}}
    assert 0 <= cached < len(ref.prompt_token_ids)
    assert "".join(plain["choices"][0]["logprobs"]["tokens"]) == ref.text
    for i, prompt in enumerate((PROMPT, "hello")):
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
        assert text == reference(world, prompt, None, max_tokens=6, temperature=0.0).text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == sum(
        len(tokenizer.encode(p)) for p in (PROMPT, "hello"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert chat["choices"][0]["message"]["content"] == reference(world, ids, "sql", max_tokens=5,
                                                                  temperature=0.0).text
    assert loaded["version"] == 1 and listed == ["tiny", "sql", "v2"] and after == ["tiny", "sql"]
    assert generated["text"] == reference(world, PROMPT, "x", adapter_path=paths["v2"], max_tokens=6,
                                          temperature=0.0).text
    # Only the engine thread changed the engine (a load's files are read on a worker thread first).
    assert {name for name, _ in calls} >= {"add_request", "step", "install", "unregister_adapter"}
    assert {thread for _, thread in calls} == {"lorakit-engine"}


def test_a_handler_refuses_before_anything_runs(world):
    async def run(state):
        refusals = []
        for call in (lambda: openai.completions(CompletionBody(model="nope", prompt="hi"), state),
                     lambda: openai.completions(CompletionBody(model="tiny", prompt="hi", max_tokens=500), state),
                     lambda: openai.chat(ChatBody(model="tiny", messages=[]), state),
                     lambda: sglang.generate(sglang.GenerateBody(text="a", lora_path="nope"), state)):
            with pytest.raises(ApiError) as e:
                await call()  # raises while checking: no reply to send, no stream to start
            refusals.append((e.value.status, e.value.param))
        with pytest.raises(ApiError, match="--allow-runtime-lora") as e:
            await adapters.load(LoadBody(lora_name="x", lora_path="/tmp"), state)
        return refusals + [(e.value.status, e.value.type)]

    refusals, calls = served(world, run)
    assert refusals == [(404, "model"), (400, "max_tokens"), (400, "messages"), (404, "lora_path"),
                        (403, "permission_error")]
    assert not [name for name, _ in calls if name != "step"]


def test_one_length_rule_on_every_route(world):
    """An asked max_tokens that does not fit after the prompt gets the same 400 on every route, from the one rule
    (``fit_max_tokens``): SGLang's /generate cut it silently before. Nothing reaches the engine."""
    async def run(state):
        ask = state.engine.max_seq_len  # never fits after a prompt, and under the server's limit
        refused = []
        for call in (lambda: openai.completions(CompletionBody(model="tiny", prompt=PROMPT, max_tokens=ask), state),
                     lambda: openai.chat(ChatBody(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  max_completion_tokens=ask), state),
                     lambda: sglang.generate(sglang.GenerateBody(text=PROMPT, sampling_params={"max_new_tokens": ask}),
                                             state)):
            with pytest.raises(ApiError) as e:
                await call()
            refused.append((e.value.status, e.value.param, e.value.message))
        return refused, ask

    (refused, ask), calls = served(world, run, max_tokens_limit=10**6)
    assert [(status, param) for status, param, _ in refused] == [(400, "max_tokens"), (400, "max_tokens"),
                                                                 (400, "max_new_tokens")]
    for _, param, message in refused:
        assert re.fullmatch(rf"this model's context is {ask} tokens, but \d+ were asked for \(\d+ in the prompt, "
                            rf"{ask} for the output\); shorten the prompt or lower {param}", message), message
    assert not [name for name, _ in calls if name != "step"]


def test_api_error_is_openais_shape_and_its_type_follows_the_status():
    assert ApiError(400, "bad", "temperature").body() == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "temperature", "code": None}}
    assert [ApiError(s, "x").type for s in (401, 403, 404, 429, 500, 503)] == [
        "authentication_error", "permission_error", "not_found_error", "rate_limit_error", "internal_server_error",
        "internal_server_error"]
    refused = sglang.Refused("unknown adapter", "lora_path", 404)
    assert isinstance(refused, ApiError) and refused.body()["error"]["type"] == "not_found_error"


class _Client:
    """What ``respond`` reads of a request: whether its client has gone."""

    def __init__(self, gone=False):
        self.gone = gone

    async def is_disconnected(self):
        return self.gone


def test_the_limit_refuses_at_once_and_a_refused_reply_never_runs():
    async def main():
        limit = ConcurrencyLimit(1)
        started = []

        async def work():
            started.append(1)
            return {"ok": True}

        refused = work()
        async with limit.hold():
            with pytest.raises(ApiError) as plain:
                await respond(_Client(), Reply(refused), limit)
            with pytest.raises(ApiError) as streamed:
                await respond(_Client(), Reply(_chunks([{"a": 1}])), limit)
        answered = await respond(_Client(), Reply(work()), limit)
        return plain.value, streamed.value, refused, started, answered

    plain, streamed, refused, started, answered = asyncio.run(main())
    assert plain.status == streamed.status == 429 and "limit of 1 (--max-concurrent)" in plain.message
    assert plain.headers == streamed.headers == {"retry-after": "1"}  # nothing ended yet: nothing to go by
    assert refused.cr_frame is None  # closed, never run (no "never awaited" warning)
    assert started == [1] and answered == {"ok": True}  # the place was freed: the next one ran


async def _chunks(items, error=None):
    for item in items:
        yield item
    if error is not None:
        raise error


async def _body(response) -> list[bytes]:
    return [part async for part in response.body_iterator]


def test_streams_end_with_done_and_an_error_midway_is_an_event():
    async def main():
        limit = ConcurrencyLimit(2)
        ok = await _body(await respond(_Client(), Reply(_chunks([{"a": 1}, {"b": 2}])), limit))
        failed = await _body(await respond(_Client(), Reply(_chunks([{"a": 1}], ApiError(400, "bad", "model"))),
                                           limit))
        return ok, failed

    ok, failed = asyncio.run(main())
    assert ok == [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', DONE]
    assert failed == [b'data: {"a":1}\n\n', b'data: {"error":{"message":"bad","type":"invalid_request_error",'
                                            b'"param":"model","code":null}}\n\n', DONE]


def test_a_client_that_leaves_cancels_its_reply():
    async def main():
        cancelled = asyncio.Event()

        async def forever():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        response = await respond(_Client(gone=True), Reply(forever()), ConcurrencyLimit(1))
        await asyncio.wait_for(cancelled.wait(), 5)
        return response.status_code

    assert asyncio.run(main()) == 499


def test_outputs_merge_what_came_while_busy_and_the_first_error_ends_all():
    from lorakit.engine import RequestOutput

    def out(text, finished=False):
        return RequestOutput("r", text, [len(text)], finished, "stop" if finished else None)

    class Handle:
        closed = 0

        def close(self):
            Handle.closed += 1

    async def main():
        feed = {}

        async def start(listener):
            feed["listener"] = listener
            return Handle()

        read = []
        stream = outputs(start, 2)
        task = asyncio.ensure_future(_collect(stream, read))
        await asyncio.sleep(0)
        push = feed["listener"]
        push(0, out("a"))
        push(0, out("b"))  # before the reader ran: merged with "a"
        push(1, out("c", True))
        await asyncio.sleep(0)
        push(0, out("d", True))
        await task
        merged = [(i, o.text, o.token_ids, o.finished) for i, o in read]

        failing = asyncio.ensure_future(_collect(outputs(start, 2), []))
        await asyncio.sleep(0)
        feed["listener"](1, ApiError(400, "bad"))
        with pytest.raises(ApiError, match="bad"):
            await failing
        return merged

    merged = asyncio.run(main())
    assert merged == [(0, "ab", [1, 1], False), (1, "c", [1], True), (0, "d", [1], True)]
    assert Handle.closed == 2  # read to the end, and ended by the error: closed either way


def test_pushed_events_are_written_in_order_and_a_slow_client_gets_what_it_missed_merged():
    import json

    from lorakit.engine import RequestOutput
    from lorakit.serve.streaming import Push, _ended, _pushed

    wire, writable, feed, closed = [], [True], {}, []

    class Writer:  # the connection: not ready while the client reads slowly
        def ready(self):
            return writable[0]

        def write(self, data: bytes):
            assert writable[0]
            wire.extend(e + b"\n\n" for e in data.split(b"\n\n")[:-1])

    class Handle:
        def close(self):
            closed.append(True)

    async def start(listener):
        feed["listener"] = listener
        return Handle()

    def out(text, finished=False):
        return RequestOutput("r", text, [0] * len(text), finished, "length" if finished else None)

    calls = []

    def chunk(i, o):  # called once per output, written or merged
        calls.append(o.text)
        return [{"text": o.text}]

    push = Push([{"first": True}], start, 1, chunk, lambda: [{"last": True}])

    async def main():
        async def send_all():  # EventStream's part: what the iterator gives is sent in order
            async for data in _ended(_pushed(Reply(None, push=push), ConcurrencyLimit(1), Writer())):
                wire.append(data)
        task = asyncio.ensure_future(send_all())
        for _ in range(3):
            await asyncio.sleep(0)
        listener = feed["listener"]
        listener(0, out("a"))  # written on the delivering pass
        writable[0] = False
        listener(0, out("bc"))
        listener(0, out("d"))  # merged with "bc" while the client is slow
        writable[0] = True
        listener(0, out("e"))  # still behind what waits: merged too, never ahead of it
        await asyncio.sleep(0)
        listener(0, out("f", finished=True))
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    events = [json.loads(e[len(b"data: "):]) if e != DONE else "DONE" for e in wire]
    assert events == [{"first": True}, {"text": "a"}, {"text": "bcde"}, {"text": "f"}, {"last": True}, "DONE"]
    assert calls == ["a", "bcde", "f"]  # once per event: a chunk's state (usage, tool calls) counts it once
    assert closed == [True]


async def _collect(stream, into):
    async for item in stream:
        into.append(item)


def test_one_mapping_to_sampling_params():
    from lorakit.serve.protocol import sampling_params

    passed = dict(temperature=0.5, top_k=3, top_p=0.9, seed=7, stop=["x"], stop_token_ids=[2], ignore_eos=True,
                  min_tokens=1, presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1)
    body = CompletionBody(model="m", prompt="p", max_tokens=4, logit_bias={"5": 1.0}, **passed)
    params = sampling_params(body, prompt_len=3, max_seq_len=16, max_tokens_limit=8, default_max_tokens=16)
    assert params == SamplingParams(max_tokens=4, logit_bias={5: 1.0}, **passed)
    assert sampling_params(CompletionBody(model="m", prompt="p", stop=""), prompt_len=3, max_seq_len=16,
                           max_tokens_limit=8, default_max_tokens=16) == SamplingParams(max_tokens=13)
    seeded = SamplingParams(seed=2**63 - 1)
    assert nth_sample(seeded, 0) is seeded and nth_sample(seeded, 1).seed == 0
    assert nth_sample(SamplingParams(), 3) == SamplingParams()
    assert nth_sample(SamplingParams(seed=1, temperature=0.5), 2) == SamplingParams(seed=3, temperature=0.5)


def test_confined_resolves_links_and_refuses_what_escapes(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    assert confined(str(root / "a"), [root]) == (root / "a").resolve()
    (root / "link").symlink_to(outside)
    (root / "a" / "file").symlink_to(outside / "file")
    for path in (outside, root / ".." / "outside", root / "link", root / "a"):
        with pytest.raises(ApiError) as e:
            confined(str(path), [root])
        assert e.value.status == 403 and e.value.param == "lora_path"
    with pytest.raises(ApiError, match="no --lora-root"):
        confined(str(root / "a"), [])


@settings(max_examples=50, deadline=None)
@given(contents=st.lists(st.text(st.characters(codec="utf-8"), max_size=40), min_size=1, max_size=4))
def test_chat_ids_are_the_templates_own(contents):
    """Issue 32: a chat prompt is rendered by the template, then encoded by the Rust tokenizer directly; the ids are
    those of apply_chat_template(..., tokenize=True), whatever the text (special tokens' text included)."""
    from _serve_helpers import make_tokenizer
    from lorakit.serve.state import _encode_rendered

    tokenizer = make_tokenizer()
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": c + ("<eos>" if i == 1 else "")} for i, c in enumerate(contents)]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert _encode_rendered(tokenizer, text) == want
