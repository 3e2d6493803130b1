"""Random JSON thrown at every endpoint of one live server: anything at all, objects of the fields an endpoint knows
with random values, and valid bodies with a few fields replaced (wrong types; huge, negative, NaN numbers; nested
junk). Whatever comes, the answer is never a 500 and never an error outside OpenAI's JSON shape; a stream either ends
with [DONE] or carries an error event; and Bystanders streaming all along get exactly their solo text."""

import json
import math
import threading
import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _serve_helpers import Bystander, start
from lorakit.serve.protocol import error_status
from lorakit.serve.protocol import ChatBody, CompletionBody
from lorakit.serve.sglang import SUPPORTED, UNSUPPORTED, UNSUPPORTED_TOP

NAMES = ["tiny", "sql", "chat", "v2", "nope", "", "\x00", "../sql", "tiny/x", "é" * 3]
LOADED = ["fz", "v2", "tiny", "nope", "", "\x00", "é" * 3]  # loaded, unloaded: not sql and chat, which the bodies use
ODD_NUMBERS = [-1, 0, 17, 128, 2**31, 2**63, 2**64, -2**63 - 1, 0.5, 1e-300, 1e300, math.nan, math.inf, -math.inf]
ODD_STRINGS = ["", " ", "hi", "²", "9" * 30, "-1", "1.5", "\x00", "~nobody/x", "x" * 300, "null", "{", "<eos>",
               "\ud7ff", "a\nb"]
LEAVES = st.one_of(st.none(), st.booleans(), st.sampled_from(ODD_NUMBERS), st.integers(-2**70, 2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_STRINGS), st.text(max_size=12))
COMPLETION_FIELDS = sorted(set(CompletionBody.model_fields) | set(ChatBody.model_fields))
GENERATE_FIELDS = ["text", "input_ids", "lora_path", "sampling_params", "sampling_params", "sampling_params", "rid",
                   "stream", *sorted(UNSUPPORTED_TOP)[:2]]
SAMPLING_KEYS = [*SUPPORTED, *UNSUPPORTED]
JSON = st.recursive(LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(COMPLETION_FIELDS + SAMPLING_KEYS + GENERATE_FIELDS),
                              st.text(max_size=6)), children, max_size=4)), max_leaves=10)


def plausible(field: str):
    """Values a field of that name might carry: mostly of its type, at odd values, sometimes anything at all."""
    ints = st.one_of(st.integers(-2, 20), st.sampled_from(ODD_NUMBERS))
    odd = st.one_of(st.sampled_from(ODD_NUMBERS), st.sampled_from(ODD_STRINGS), st.booleans(), st.none())
    known = {
        "model": st.sampled_from(NAMES), "lora_name": st.sampled_from(LOADED),
        "lora_path": st.one_of(st.sampled_from(NAMES + ODD_STRINGS), st.lists(st.sampled_from([*NAMES, None]),
                                                                               max_size=3)),
        "prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3),
                            st.lists(ints, max_size=4), st.lists(st.lists(ints, max_size=3), max_size=3)),
        "text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3)),
        "input_ids": st.one_of(st.lists(ints, max_size=4), st.lists(st.lists(ints, max_size=3), max_size=3)),
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot", None])},
            optional={"content": st.one_of(st.text(max_size=10), st.none(), st.lists(
                st.dictionaries(st.sampled_from(["type", "text", "image_url"]), st.one_of(
                    st.sampled_from(["text", "image_url"]), LEAVES), max_size=3), max_size=2)),
                "name": LEAVES}), max_size=3),
        "stop": st.one_of(st.sampled_from(ODD_STRINGS), st.lists(st.text(max_size=4), max_size=20)),
        "stop_token_ids": st.lists(ints, max_size=3),
        "logit_bias": st.dictionaries(st.one_of(st.sampled_from(ODD_STRINGS), st.integers(-5, 400).map(str),
                                                st.sampled_from(ODD_NUMBERS).map(str)), odd, max_size=3),
        "sampling_params": st.one_of(mutated({"max_new_tokens": 4}, SAMPLING_KEYS), st.lists(
            mutated({"max_new_tokens": 4}, SAMPLING_KEYS), max_size=2)),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(
            ["text", "json_object", "json_schema", "xml"])}, optional={"json_schema": st.fixed_dictionaries(
                {}, optional={"schema": JSON, "name": LEAVES})}),
        "json_schema": st.sampled_from(['{"type": "string"}', "{", "5", '{"type": 5}', "[]"]),
        "guided_json": st.one_of(st.sampled_from([{"type": "integer"}, {"type": 5}, "{", {"enum": []}]), JSON),
        "regex": st.sampled_from(["a+", "(", "[0-9]{3}", "x" * 50]),
        "guided_regex": st.sampled_from(["a+", "(", "[0-9]{3}", "x" * 50]),
        "guided_choice": st.lists(st.text(max_size=4), max_size=3),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": odd}),
        "rid": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    }
    if field in known:
        return st.one_of(known[field], known[field], known[field], odd, JSON)
    return st.one_of(st.sampled_from(ODD_NUMBERS), st.sampled_from(ODD_NUMBERS), ints, odd, JSON)


# Values each field takes: bodies made of them run, and reach the engine and the streams with odd combinations.
VALID = dict(
    temperature=st.floats(0, 2), top_p=st.floats(0.05, 1), top_k=st.integers(-1, 50), n=st.integers(1, 3),
    best_of=st.just(None), seed=st.integers(0, 2**63 - 1), sampling_seed=st.integers(0, 2**63 - 1),
    stop=st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    stop_token_ids=st.lists(st.integers(0, 299), max_size=3), ignore_eos=st.booleans(), min_tokens=st.integers(0, 3),
    min_new_tokens=st.integers(0, 3), max_new_tokens=st.integers(1, 8), max_tokens=st.integers(1, 8),
    max_completion_tokens=st.integers(1, 8), presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.5, 2), logit_bias=st.dictionaries(st.integers(0, 299).map(str),
                                                                      st.floats(-100, 100), max_size=3),
    logprobs=st.one_of(st.booleans(), st.integers(0, 5)), top_logprobs=st.integers(0, 5), echo=st.booleans(),
    stream=st.booleans(), stream_options=st.just({"include_usage": True}), user=st.text(max_size=5),
    response_format=st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]),
    guided_choice=st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3),
    guided_regex=st.sampled_from(["[a-z]+", "[0-9]{2}"]), regex=st.sampled_from(["[a-z]+", "[0-9]{2}"]),
    json_schema=st.just('{"type": "string"}'), model=st.sampled_from(["tiny", "sql", "chat"]),
    lora_path=st.sampled_from([None, "tiny", "sql", "chat"]), rid=st.text(min_size=1, max_size=4),
    prompt=st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                                                 max_size=2),
                     st.lists(st.integers(0, 299), min_size=1, max_size=4)),
    text=st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                                               max_size=2)),
    input_ids=st.lists(st.integers(0, 299), min_size=1, max_size=4),
)


@st.composite
def mutated(draw, base: dict, fields: list[str]) -> dict:
    """``base`` with one or two fields set to values they take or to plausible wrong ones, or removed."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        how = draw(st.integers(0, 7))
        if how == 7:  # (hypothesis favours 0)
            body.pop(name, None)
        elif how < 4 and name in VALID:
            body[name] = draw(VALID[name])
        else:
            body[name] = draw(plausible(name))
    return body


def bodies(base: dict, fields: list[str]):
    return st.one_of(*[mutated(base, fields)] * 8, JSON,
                     st.fixed_dictionaries({}, optional={f: plausible(f) for f in fields}))


@pytest.fixture(scope="module")
def server(world):
    live = start(world, allow_runtime_lora=True, max_tokens_limit=48, max_concurrent=24)  # bounded work per example
    yield live
    live.close()


@pytest.fixture(scope="module")
def bystanders(world, server):
    """Bystanders, one after another, for as long as the fuzzing lasts; each is checked when it ends."""
    done, failures, runs = threading.Event(), [], []

    def loop():
        while not done.is_set():
            with Bystander(server, world, max_tokens=40) as b:
                pass
            try:
                b.check()
            except AssertionError as e:
                failures.append(e)
            runs.append(b)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    done.set()
    thread.join(180)
    assert runs and not failures, failures[:3]


def check(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:1000])
    if r.status_code >= 400 or not stream:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        body = json.loads(r.text)
        if r.status_code >= 400:
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"}, body
            assert error_status(error["code"]) == r.status_code, body
        return
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-1000:]  # never a stream cut short
    for line in lines[:-1]:
        json.loads(line)


ENDPOINTS = {
    "/v1/completions": ({"model": "tiny", "prompt": "hi", "max_tokens": 4}, COMPLETION_FIELDS),
    "/v1/chat/completions": ({"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                             COMPLETION_FIELDS),
    "/generate": ({"text": "hi", "sampling_params": {"max_new_tokens": 4}}, GENERATE_FIELDS),
}


@st.composite
def requests(draw, root: str, adapters: dict) -> tuple[str, str, str | None]:
    """(method, path, raw body) for one endpoint."""
    path = draw(st.sampled_from([*ENDPOINTS, "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models/"]))
    if path == "/v1/models/":
        return "GET", path + quote(draw(st.one_of(st.sampled_from(NAMES), st.text(max_size=20))), safe=""), None
    if path in ENDPOINTS:
        base, fields = ENDPOINTS[path]
        base = {**base, "stream": draw(st.booleans())}
        body = draw(bodies(base, fields))
    else:
        paths = [*adapters.values(), root, f"{root}/nope", f"{root}/../x", f"{root}/{'x' * 300}", "/", "~nobody/x",
                 "\x00", f"{root}/sql\x00"]
        base = {"lora_name": draw(st.sampled_from(LOADED)),
                "lora_path": draw(st.sampled_from(paths))}
        body = draw(bodies(base, ["lora_name", "lora_path"]))
    raw = json.dumps(body)  # NaN and Infinity as Python writes them: what json.loads on the server reads
    if draw(st.integers(0, 30)) == 30:  # (hypothesis favours 0)
        raw = raw[: draw(st.integers(0, len(raw)))]  # cut short: not JSON at all
    return "POST", path, raw


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


# The engine draws unseeded requests' seeds from the global random, on its thread, sometimes while hypothesis draws.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
def test_random_json_never_gets_a_500_or_a_dead_stream(world, server, bystanders, http):
    _, _, root, adapters = world
    start_time = time.monotonic()

    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(request=requests(str(root), {k: str(v) for k, v in adapters.items()}))
    def fuzz(request):
        method, path, raw = request
        if method == "GET":
            check(http.get(path), stream=False)
            return
        r = http.post(path, content=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
        check(r, stream=r.headers.get("content-type", "").startswith("text/event-stream"))

    fuzz()
    assert time.monotonic() - start_time < 300
