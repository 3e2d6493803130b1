"""Tool calling under hostile outputs (lorakit issue 45): what a model writes, parsed for calls, can neither raise,
recurse nor run long on the API server's event loop; a call is only a call of an offered function with strict JSON
arguments, else the text is content; "required" keeps each tool's JSON-pointer refs resolving in its own schema (a
hypothesis test validates every returned call with jsonschema); a history's arguments or a tool's parameters nested
past the bound are a 400 naming the field. The live cases force their output with guided_regex, on a tokenizer that
has long runs of "[" and " " as single tokens (favoured by logit_bias), beside greedy bystander streams."""

import concurrent.futures
import json
import re
import threading
import time
from typing import Literal

import httpx
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from _serve_helpers import LiveServer
from _tokenizers import bpe_tokenizer
from lorakit.engine import Engine
from lorakit.serve import ServeConfig, create_app
from lorakit.serve.protocol import MAX_JSON_DEPTH
from lorakit.serve.tools import PARSERS, ToolCalls

TOOLS_TEMPLATE = (
    "{% if tools %}<system>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"query": {}}}}}
HI = [{"role": "user", "content": "hi"}]
MAX_GAP = 0.5  # the bystander's normal largest gap here is 0.005-0.03 s


@pytest.fixture(scope="module")
def live():
    """A live server over a tiny model whose tokenizer makes runs of up to 256 "[" or spaces single tokens (an output
    of 1,500 of them takes a few steps) and whose template renders tools with Hermes' tags (the hermes parser);
    ``runs``: a logit_bias for those tokens, so that the longest run a regex allows is the one taken."""
    tokenizer = bpe_tokenizer(["What is the capital of France? Paris is.", "hello world, the quick brown fox",
                               "[" * 256, " " * 256 + "x"], vocab_size=400, chat_template=TOOLS_TEMPLATE)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    server = LiveServer(create_app(Engine(model, tokenizer, max_loras=1, block_size=4), ServeConfig(model_name="tiny")))
    server.runs = {str(i): min(0.35 * len(t), 100) for t, i in tokenizer.get_vocab().items()
                   if set(t) in ({"["}, {"Ġ"})}
    yield server
    server.close()


def chat(live: LiveServer, body: dict, timeout: float = 60) -> tuple[int, str | None, list[dict], str | None]:
    """(status, content, tool_calls, finish_reason) of the first choice of a chat request, streamed or not (a stream's
    deltas reassembled; an error event fails the test)."""
    body = {"model": "tiny", "messages": HI, "temperature": 0} | body
    if not body.get("stream"):
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=timeout)
        if r.status_code != 200:
            return r.status_code, r.text, [], None
        choice = r.json()["choices"][0]
        return 200, choice["message"]["content"], choice["message"].get("tool_calls") or [], choice["finish_reason"]
    content, calls, finish = "", {}, None
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["index"] != 0:
                    continue
                content += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    slot["name"] += call.get("function", {}).get("name") or ""
                    slot["arguments"] += call.get("function", {}).get("arguments") or ""
                finish = choice["finish_reason"] or finish
    return r.status_code, content or None, [{"function": calls[i]} for i in sorted(calls)], finish


# Outputs a model can write, forced with guided_regex: (output, n) -> whether it is one call of f (else content).
FORCED = {
    ("<tool_call>" + "[" * 1500 + "</tool_call>", 1): False,  # RecursionError in json.loads
    ("<tool_call>" + " " * 3000, 1): False,  # the pattern's cubic backtracking
    ("<tool_call>" + " " * 2500, 4): False,
    ('<tool_call>{"name": "f", "arguments": {"query": NaN}}</tool_call>', 1): False,
    ('<tool_call>{"name": "f", "arguments": {"query": 1e999}}</tool_call>', 1): False,
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', 1): False,  # not offered
    ('<tool_call>{"name": "f", "arguments": {"query": "\\ud800"}}</tool_call>', 1): False,  # no Unicode text
    ('<tool_call>{"name": "f", "arguments": {"query": "a; b"}}</tool_call>', 1): True,
}


class Bystanders:
    """Greedy streams, one after another while the block runs: each must give the text of the first (run alone before
    the block), and none may wait MAX_GAP seconds or more for a chunk (its first counted from when it was sent)."""

    def __init__(self, live: LiveServer):
        self.live, self.texts, self.gaps, self.errors = live, [], [], []
        self.done, self.thread = threading.Event(), threading.Thread(target=self._run, daemon=True)

    def _run(self):
        client = self.live.client()
        while not self.done.is_set():
            try:
                last, text = time.perf_counter(), ""
                for chunk in client.completions.create(model="tiny", prompt="What is the capital of France?",
                                                       max_tokens=48, temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    now = time.perf_counter()
                    if self.texts:  # the first stream runs alone
                        self.gaps.append(now - last)
                    last, text = now, text + (chunk.choices[0].text if chunk.choices else "")
                self.texts.append(text)
            except Exception as e:  # noqa: BLE001 - reported on exit
                self.errors.append(e)
                return

    def __enter__(self):
        self.thread.start()
        while not self.texts and not self.errors:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)  # a stream that started during the block finishes after it
        self.done.set()
        self.thread.join(60)
        if exc[0] is None:
            assert not self.errors, self.errors
            assert len(set(self.texts)) == 1 and len(self.texts) >= 2, "a bystander's text differs from the first's"
            assert max(self.gaps) < MAX_GAP, f"a bystander waited {max(self.gaps):.2f} s for a chunk"


def test_forced_outputs_are_calls_or_content_and_never_stall_or_stop_the_server(live):
    """Every forced output, streamed and not, at once beside bystanders: 200, a call only where it is one, the text
    as content otherwise; no bystander waits MAX_GAP; the server answers afterwards."""
    jobs = [(text, n, stream) for text, n in FORCED for stream in (False, True)]

    def attack(job):
        text, n, stream = job
        return chat(live, {"tools": [F], "guided_regex": re.escape(text), "n": n, "stream": stream,
                           "max_tokens": 200, "logit_bias": live.runs})

    with Bystanders(live), concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(attack, jobs))
    for (text, n, stream), (status, content, calls, finish) in zip(jobs, answers):
        where = f"{text[:60]!r} (n={n}, stream={stream})"
        assert status == 200, (where, content)
        if FORCED[text, n]:
            assert content is None and finish == "tool_calls", where
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                ("f", {"query": "a; b"})], where
        else:
            assert (content, calls, finish) == (text, [], "stop"), where
    assert chat(live, {"max_tokens": 4})[0] == 200


HOSTILE = {  # parser -> outputs that must come back as content, whole and quickly
    "hermes": ["<tool_call>" + "[" * 1500 + "</tool_call>", "<tool_call>" + "[" * 100_000,
               "<tool_call>" + " " * 3000, "<tool_call>" * 5000 + " " * 3000 + "</tool_call>",
               '<tool_call>{"name": "f", "arguments": ' + "[" * 200 + "]" * 200 + "}</tool_call>"],
    "llama3_json": ['{"name": "f", "parameters": ' + "[" * 1500 + "]" * 1500 + "}", "{" + "[" * 100_000,
                    '{"name": "f", "parameters": {}}' + " " * 3000 + ";" * 3000 + "x"],
    "mistral": ["[TOOL_CALLS]" + "[" * 1500 + "]" * 1500, "[TOOL_CALLS]" + "[" * 100_000,
                "[TOOL_CALLS]" + " " * 3000],
}


@pytest.mark.parametrize("parser", list(HOSTILE))
def test_no_parser_raises_recurses_or_runs_long(parser):
    calling = ToolCalls([F], "auto", None, parser)
    for text in HOSTILE[parser]:
        start = time.perf_counter()
        assert calling.split(text) == (text, [])
        assert time.perf_counter() - start < 0.2, f"{parser} took {time.perf_counter() - start:.2f} s on {text[:40]!r}"
    for choice in ("required", "named"):  # enforced by a grammar, and still never trusted
        for text in ("[" * 1500 + "]" * 1500, "[" * 100_000, " " * 3000, '{"query": NaN}'):
            assert ToolCalls([F], choice, "f", parser).split(text) == (text, [])


def test_a_parser_that_raises_leaves_the_output_content_and_says_so(monkeypatch, caplog):
    calling = ToolCalls([F], "auto", None, "hermes")
    monkeypatch.setattr(calling, "parse", lambda text: 1 / 0)  # a bug: never the stream's end
    assert calling.split("Sure.") == ("Sure.", [])
    assert "parser failed on an output of 5 characters" in caplog.text


def test_only_offered_functions_with_strict_json_arguments_are_calls():
    calling = ToolCalls([F], "auto", None, "hermes")
    for arguments in ('{"query": NaN}', '{"query": -Infinity}', '{"query": 1e999}', '{"query": "\\udfff"}',
                      '"{\\"query\\": NaN}"'):
        text = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
        assert calling.split(text) == (text, []), arguments
    text = '<tool_call>{"name": "g", "arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert calling.split(text) == (text, [])  # one call of a function never offered: none is a call
    content, calls = calling.split('Sure.<tool_call>{"name": "f", "arguments": {"query": 1.5e3}}</tool_call>')
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"query": 1500.0}
    deep = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)  # within the bound, with the call's two objects
    assert calling.split(f'<tool_call>{{"name": "f", "arguments": {{"q": {deep}}}}}</tool_call>')[1]


def test_llama3_json_separates_calls_only_between_json_values():
    one, two = '{"name": "q", "parameters": {"sql": "SELECT 1; SELECT 2"}}', '{"name": "r", "parameters": {}}'
    assert PARSERS["llama3_json"](f"<|python_tag|>{one}; {two};") == (
        "", [("q", {"sql": "SELECT 1; SELECT 2"}), ("r", {})])
    assert PARSERS["llama3_json"](one) == ("", [("q", {"sql": "SELECT 1; SELECT 2"})])
    for text in (f"{one} {two}", f"{one}; x", f"{one};{{"):  # not separated, or not all calls: content
        assert PARSERS["llama3_json"](text) == (text, [])


@pytest.mark.parametrize("arguments", ["[" * 100_000 + "]" * 100_000, "[" * (MAX_JSON_DEPTH + 1) + "]" *
                                       (MAX_JSON_DEPTH + 1), '{"q": NaN}', "{"], ids=["100k", "129", "NaN", "cut"])
def test_history_arguments_past_the_bound_are_a_400_naming_the_field(live, arguments):
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": [F],
                                                            "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    history[1]["tool_calls"][0]["function"]["arguments"] = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert chat(live, {"messages": history, "tools": [F], "max_tokens": 2})[0] == 200


def test_tool_parameters_past_the_bound_are_a_400_naming_the_field(live):
    nested = '{"type": "object", "properties": {"x": ' * 300 + "{}" + "}}" * 300  # 600 deep: json reads it
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", ' \
           '"function": {"name": "f", "parameters": %s}}]}' % nested
    r = httpx.post(f"{live.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: else random keys until max_tokens
    value: int = Field(ge=-9, le=9)
    next: "Node | None" = None


class Chain(BaseModel):
    model_config = ConfigDict(extra="forbid")
    head: Node
    tags: list[Literal["x", "y"]] = Field(max_length=2)


LEAVES = st.sampled_from([{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "number", "minimum": 0,
                          "maximum": 1}, {"type": "boolean"}, {"type": "string", "maxLength": 4}, {"enum": ["a", 3]},
                          {"type": "null"}])


@st.composite
def tool_schemas(draw) -> dict[str, dict]:
    """Tools' parameters by name, in a drawn order, whose refs resolve only in their own document: "#" (a tree),
    pydantic's "$defs" (a linked list), a pointer into its own properties in an anyOf variant (its document named by
    an "$id" or not), and plain leaves."""
    leaves = [draw(LEAVES) for _ in range(3)]
    schemas = {
        "tree": {"type": "object", "properties": {"v": leaves[0], "kids": {"type": "array", "items": {"$ref": "#"},
                                                                           "maxItems": 1}},
                 "required": ["v", "kids"], "additionalProperties": False},
        "pydantic": Chain.model_json_schema(),
        "pointer": {"type": "object", "properties": {"x": {"anyOf": [leaves[1], {"$ref": "#/properties/y"}]},
                                                     "y": leaves[2]}, "required": ["x", "y"],
                    "additionalProperties": False} | draw(st.sampled_from([{}, {"$id": "https://example.com/p"}])),
        "flat": {"type": "object", "properties": {"a": leaves[0], "b": leaves[1]}, "required": ["a"],
                 "additionalProperties": False}}
    return {name: schemas[name] for name in draw(st.permutations(list(schemas)))}


def test_required_and_named_calls_validate_against_their_own_schemas(live):
    """Random tools (recursive refs, pydantic $defs, anyOf, numbers), sampled: every call that comes back is of an
    offered function (the named one, if named) and its arguments validate against that function's own schema
    (jsonschema); each kind of tool is called and checked at least once."""
    jsonschema = pytest.importorskip("jsonschema")  # in the test extra; the GPU image collects this file without it
    checked = set()

    @settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(schemas=tool_schemas(), named=st.booleans(), seed=st.integers(0, 999))
    def one(schemas, named, seed):
        tools = [{"type": "function", "function": {"name": name, "parameters": s}} for name, s in schemas.items()]
        first = next(iter(schemas))
        choice = {"type": "function", "function": {"name": first}} if named else "required"
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HI, "tools": tools, "tool_choice": choice, "n": 3, "seed": seed,
            "temperature": 1.0, "max_tokens": 160})
        assert r.status_code == 200, r.text
        for answer in r.json()["choices"]:
            if answer["finish_reason"] == "length":  # cut: the calls begun, of offered functions, partial JSON
                assert answer["message"]["content"] is None or "tool_calls" not in answer["message"], answer
                assert all(c["function"]["name"] in ((first,) if named else schemas)
                           for c in answer["message"].get("tool_calls", []))
                continue
            assert answer["finish_reason"] == "tool_calls", answer
            for call in answer["message"]["tool_calls"]:
                name = call["function"]["name"]
                assert name == first or not named
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name],
                                    cls=jsonschema.Draft202012Validator)
                checked.add(name)

    one()
    assert checked == {"tree", "pydantic", "pointer", "flat"}, f"only {checked} were called whole: more examples"
