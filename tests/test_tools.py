"""Tool calling on /v1/chat/completions (``serve.tools``): each parser on recorded model outputs; "required" and a
named function enforced by the structured-output grammar, so that the calls parse and match their schema whatever
the (random) model, for the base model and two adapters in one batch, streamed and not (the streamed deltas
reassemble to the message); a history with tool messages; refusals by name; and the openai client over HTTP."""

import asyncio
import copy
import json

import pytest

from _serve_helpers import LiveServer, run_state
from lorakit.engine import Engine
from lorakit.serve import ServeConfig, create_app, openai
from lorakit.serve.protocol import ApiError, ChatBody, chat_messages
from lorakit.serve.state import ServerState
from lorakit.serve.tools import PARSERS, parser_for

TOOLS_TEMPLATE = (
    "{% if tools %}<system>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


pytestmark = pytest.mark.world(chat_template=TOOLS_TEMPLATE)  # the module's `world` (tests/conftest.py)


def state_of(world, template=None):
    base, tokenizer, _, paths = world
    if template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
    model = copy.deepcopy(base)
    model.config.max_position_embeddings = 1024  # room for the tools' schemas (RoPE is computed, not tabled)
    engine = Engine(model, tokenizer, max_loras=2, adapters={n: paths[n] for n in ("sql", "v2")}, block_size=4)
    return ServerState(engine, ServeConfig(model_name="tiny"))


def matches_schema(name, arguments):
    if name == "get_weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome") and \
            isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
    return name == "get_time" and arguments == {"zone": arguments.get("zone")} and arguments["zone"] in ("UTC", "CET")


def reassembled(chunks):
    """The message a client builds from a chat stream's deltas, as the openai SDK does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                slot["function"]["name"] += call.get("function", {}).get("name") or ""
                slot["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_enforced_calls_parse_and_match_their_schema_for_base_and_adapters_in_one_batch(world, tool_choice):
    async def body_of(state):
        bodies = [ChatBody(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200,
                           temperature=0, parallel_tool_calls=False, stream=stream)
                  for model in ("tiny", "sql", "v2") for stream in (False, True)]
        replies = await asyncio.gather(*(openai.chat(b, state) for b in bodies))

        async def collect(reply, stream):
            return [c async for c in reply.body] if stream else await reply.body
        return await asyncio.gather(*(collect(r, b.stream) for r, b in zip(replies, bodies)))

    answers = run_state(state_of(world), body_of)
    for whole, chunks in zip(answers[::2], answers[1::2]):
        choice = whole["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        assert len(calls) == 1 and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
        name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        assert matches_schema(name, arguments), (name, arguments)
        if isinstance(tool_choice, dict):
            assert name == "get_weather"
        content, streamed, finish = reassembled(chunks)  # greedy: the same answer, as OpenAI streams it
        assert (content, finish) == (None, "tool_calls")
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        firsts = [c for chunk in chunks for ch in chunk["choices"] for c in ch["delta"].get("tool_calls") or []]
        assert firsts[0]["function"]["name"] == name and firsts[0]["function"]["arguments"] == ""  # the name first


def test_auto_and_none_leave_text_as_content_and_a_history_with_tool_messages_renders(world):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]

    async def body_of(state):
        out = {}
        for choice in ("auto", "none"):
            body = ChatBody(model="sql", messages=history, tools=[WEATHER], tool_choice=choice, max_tokens=8,
                            temperature=0)
            out[choice] = await (await openai.chat(body, state)).body
        rendered = state.tokenizer(None).apply_chat_template(chat_messages(ChatBody(model="sql", messages=history)),
                                                             tools=[WEATHER], tokenize=False)
        return out, rendered

    out, rendered = run_state(state_of(world), body_of)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in rendered
    assert '<tool>{"sky": "sunny"}' in rendered
    for choice in ("auto", "none"):
        answer = out[choice]["choices"][0]
        assert answer["finish_reason"] in ("length", "stop") and "tool_calls" not in answer["message"]
        assert isinstance(answer["message"]["content"], str)  # random weights: no call, the text is content


def test_refusals_name_the_parameter(world):
    async def body_of(state):
        found = []
        for change in (dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
                       dict(tool_choice="required", response_format={"type": "json_object"}),
                       dict(tool_choice="sometimes"), dict(tools=None, tool_choice="required")):
            body = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=4) | change
            try:
                await openai.chat(ChatBody(**body), state)
            except ApiError as e:
                found.append((e.status, e.param))
            except ValueError as e:  # pydantic's, for a tool_choice of no known shape (the app answers it with a 400)
                found.append((400, type(e).__name__))
        return found

    found = run_state(state_of(world), body_of)
    assert found == [(400, "tool_choice"), (400, "tool_choice"), (400, "ValidationError"), (400, "tool_choice")]

    async def untaught(state):  # a template that does not render tools
        with pytest.raises(ApiError, match="does not render tools") as e:
            await openai.chat(ChatBody(model="tiny", messages=ASK, tools=[WEATHER]), state)
        return e.value.param
    assert run_state(state_of(world, "{% for m in messages %}{{ m['content'] }}{% endfor %}"), untaught) == "tools"


RECORDED = {  # (parser, model output) -> (content, [(name, arguments)])
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'):
        ("Let me check.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]),
    ("hermes", "Paris is sunny today."): ("Paris is sunny today.", []),
    ("hermes", "<tool_call>{not json}</tool_call>"): ("<tool_call>{not json}</tool_call>", []),
    ("hermes", 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'):  # stopped before the tag
        ("Checking.", [("get_time", {"zone": "UTC"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'):
        ("", [("get_time", {"zone": "UTC"})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'):
        ("", [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "The answer is {x}."): ("The answer is {x}.", []),
    ("llama3_json", '{"name": "q", "parameters": {"sql": "SELECT 1; SELECT 2"}}'):
        ("", [("q", {"sql": "SELECT 1; SELECT 2"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]'):
        ("", [("get_weather", {"city": "Rome", "days": 1})]),
    ("mistral", "No tools needed."): ("No tools needed.", []),
}


@pytest.mark.parametrize("case", list(RECORDED), ids=[f"{p}-{i}" for i, (p, _) in enumerate(RECORDED)])
def test_each_parser_on_recorded_outputs(case):
    parser, text = case
    assert PARSERS[parser](text) == RECORDED[case]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_an_enforced_call_cut_by_max_tokens_stays_a_call(world, tool_choice):
    """max_tokens cuts the call: it comes back as the call begun (its name, the arguments generated so far: a prefix
    of the whole call's), finish_reason "length" and no content, streamed and not."""
    def bodies(max_tokens):
        return [ChatBody(model="sql", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
                         max_tokens=max_tokens, parallel_tool_calls=False, stream=stream) for stream in (False, True)]

    async def run(state, batch):
        replies = await asyncio.gather(*(openai.chat(b, state) for b in batch))
        return [[c async for c in r.body] if b.stream else await r.body for r, b in zip(replies, batch)]

    async def body_of(state):
        whole = (await run(state, bodies(200)))[0]
        used = whole["usage"]["completion_tokens"]
        # into the arguments, after the name: "required" ends '}]', the arguments take more than 6 tokens
        return whole, await run(state, bodies(used // 2 if isinstance(tool_choice, dict) else used - 6))

    whole, (cut, chunks) = run_state(state_of(world), body_of)
    call = whole["choices"][0]["message"]["tool_calls"][0]["function"]
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == call["name"]
    arguments = calls[0]["function"]["arguments"]
    assert call["arguments"].startswith(arguments) and 0 < len(arguments) < len(call["arguments"]), (arguments, call)
    content, streamed, finish = reassembled(chunks)
    assert (content, finish) == (None, "length")
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_a_cut_required_array_keeps_the_calls_whose_name_is_read():
    from lorakit.serve.tools import ToolCalls

    calling = ToolCalls([WEATHER, TIME], "required", None, "hermes")
    named = [(c["function"]["name"], c["function"]["arguments"]) for c in calling.begun(
        '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Pa')]
    assert named == [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Pa')]
    assert calling.answer('[{"name": "get_time"', "length")[1][0]["function"] == {"name": "get_time",
                                                                                 "arguments": ""}
    for text in ('[{"name": "get_ti', "[", '[{"name": "other", "arguments": {', '["x", {"name": "get_time"',
                 "[" * 100_000):
        assert calling.answer(text, "length") == (text, [], "length"), text
    assert calling.answer('[{"name": "get_time", "arguments": {"zone"', "stop")[1] == []  # only a cut keeps it


def test_the_parser_follows_the_chat_template():
    assert parser_for("{{ '<tool_call>' }}") == "hermes" and parser_for("[TOOL_CALLS] {{ x }}") == "mistral"
    assert parser_for("<|python_tag|>{{ y }}") == "llama3_json" and parser_for("{{ tools }}") == "hermes"
    assert parser_for("[TOOL_CALLS]", "hermes") == "hermes"


def test_the_openai_client_gets_calls_streamed_and_not(world):
    live = LiveServer(create_app(state_of(world).engine.engine, ServeConfig(model_name="tiny")))
    try:
        client = live.client()
        tools = [WEATHER]
        whole = client.chat.completions.create(model="v2", messages=ASK, tools=tools, tool_choice="required",
                                               max_tokens=200, temperature=0, parallel_tool_calls=False)
        call = whole.choices[0].message.tool_calls[0]
        assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert matches_schema(call.function.name, json.loads(call.function.arguments))
        arguments, names = "", ""
        for chunk in client.chat.completions.create(model="v2", messages=ASK, tools=tools, tool_choice="required",
                                                    max_tokens=200, temperature=0, parallel_tool_calls=False,
                                                    stream=True):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                names += delta_call.function.name or ""
                arguments += delta_call.function.arguments or ""
        assert (names, arguments) == (call.function.name, call.function.arguments)
    finally:
        live.close()


def test_langchain_bind_tools_and_structured_output_by_function_calling(world):
    """What LangChain users write: ``ChatOpenAI(...).bind_tools([...])`` and ``with_structured_output(...,
    method="function_calling")`` against the live server, on an adapter."""
    from typing import Literal

    from pydantic import BaseModel, Field

    ChatOpenAI = pytest.importorskip("langchain_openai", reason="pip install -e '.[test]'").ChatOpenAI

    class Weather(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "Rome"]
        days: int = Field(ge=1, le=7)

    live = LiveServer(create_app(state_of(world).engine.engine, ServeConfig(model_name="tiny")))
    try:
        chat = ChatOpenAI(base_url=f"{live.url}/v1", api_key="none", model="sql", temperature=0, max_retries=0)
        message = chat.bind_tools([Weather], tool_choice="required").invoke("Weather in Paris for two days?")
        assert 1 <= len(message.tool_calls) <= 8  # parallel calls allowed (LangChain does not say otherwise)
        for call in message.tool_calls:
            assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome")
            assert 1 <= call["args"]["days"] <= 7
        answer = chat.with_structured_output(Weather, method="function_calling").invoke("And in Rome?")
        assert isinstance(answer, Weather)
    finally:
        live.close()
