"""OpenAI parameter parity, live, with the real openai client: each parameter changes the output as OpenAI and
vLLM define it (penalties and logit_bias against the reference that applies them to the model's logits; echo;
the usage chunk last in a stream; text_offset), structured output parses for the base model and an adapter
in one concurrent batch, and every refusal is a 400 in OpenAI's error shape that names the parameter."""

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from _serve_helpers import CHAT_TEMPLATE, LiveServer
from helpers import LOGITS_SCHEMA as SCHEMA, logits_reference as reference, logits_world
from lorakit.serve.protocol import error_status
from lorakit.engine import LLM, Engine, SamplingParams
from lorakit.engine.structured import StructuredOutput
from lorakit.serve import ServeConfig, create_app

CONTEXT = 96


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base model, tokenizer, adapter "a"): helpers.logits_world with the chat template and a context of CONTEXT."""
    return logits_world(tmp_path_factory.mktemp("params"), chat_template=CHAT_TEMPLATE,
                        max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(world):
    base, tokenizer, adapter = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"a": adapter.path}, block_size=4)
    live = LiveServer(create_app(engine, ServeConfig(model_name="tiny", max_tokens_limit=64)))
    yield live
    live.close()


PROMPT = "What is the capital of France?"


def test_penalties_and_logit_bias_follow_the_reference(world, server):
    _, tokenizer, _ = world
    client = server.client()
    ids = tokenizer.encode(PROMPT)
    for adapter, extra in ((False, dict(presence_penalty=1.5)), (True, dict(frequency_penalty=0.8)),
                           (False, dict(repetition_penalty=1.7)), (True, dict(logit_bias={"9": 4.0, "30": -100})),
                           (False, dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8))):
        openai_args = {k: v for k, v in extra.items() if k != "repetition_penalty"}
        out = client.completions.create(model="a" if adapter else "tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                        extra_body={k: v for k, v in extra.items() if k == "repetition_penalty"},
                                        **openai_args)
        params = dict(extra, logit_bias={int(k): v for k, v in extra.get("logit_bias", {}).items()})
        ref = reference(world, ids, adapter, SamplingParams(max_tokens=20, temperature=0.0, **params))
        assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True), extra
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    assert plain != client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                              frequency_penalty=2.0).choices[0].text
    forced = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0.9, seed=1, logit_bias={"7": 100})
    assert forced.choices[0].message.content == tokenizer.decode([7] * 6)


def test_echo_usage_chunk_text_offset_and_small_parameters(world, server):
    client = server.client()
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == echoed.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hello"}],
                                               max_completion_tokens=7, temperature=0, n=2, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 14
    assert [c for c in chat if c.choices and c.choices[0].finish_reason] and chat[-2].choices
    without = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=3, stream=True))
    assert all(c.choices for c in without)  # no usage chunk unless asked
    scored = client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == scored.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=4, user="someone").usage.completion_tokens <= 4
    m = client.models.retrieve("a")
    assert m.id == "a" and m.parent == "tiny" and client.models.retrieve("tiny").parent is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_structured_output_parses_for_base_and_adapter_in_one_batch(world, server):
    base, tokenizer, adapter = world
    client = server.client()
    messages = [{"role": "user", "content": "Answer in JSON: what is the capital of France?"}]
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}

    def ask(model, **kw):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=40, **{"temperature": 0, **kw})

    jobs = [("tiny", dict(response_format=schema)), ("a", dict(response_format=schema)),
            ("a", dict(extra_body={"guided_choice": ["Paris", "Lyon"]})),
            ("tiny", dict(extra_body={"guided_regex": "[a-z]{3,6}"})), ("a", {}), ("tiny", {}),
            ("tiny", dict(response_format={"type": "json_object"}, temperature=0.8, seed=5))] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: ask(job[0], **job[1]), jobs))
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"a": adapter.path}, block_size=4)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    for (model, kw), out in zip(jobs, outs):
        text = out.choices[0].message.content
        if kw.get("response_format") is schema:
            value = json.loads(text)
            assert set(value) == {"name", "ok", "n"} and isinstance(value["ok"], bool) and len(value["name"]) <= 6
            spec = StructuredOutput.json_schema(SCHEMA)
            ref = llm.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, structured_output=spec),
                               adapters=["a" if model == "a" else None])[0]
            assert text == ref.text  # greedy within the grammar: the same tokens as the engine alone
        elif "extra_body" in kw and "guided_choice" in kw["extra_body"]:
            assert text in ("Paris", "Lyon")
        elif "extra_body" in kw:
            assert 3 <= len(text) <= 6 and text.isalpha() and text.islower()
        elif "response_format" in kw:
            assert text.startswith("{")
    assert [o.choices[0].message.content for o in outs[:7]] == [o.choices[0].message.content for o in outs[7:]]


REFUSALS = [  # (path, body changes, the parameter named)
    ("/v1/chat/completions", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("/v1/chat/completions", dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ("/v1/chat/completions", dict(messages=[{"role": "tool", "content": "hi"}]), "messages[0].tool_call_id"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
     "messages[0].content"),
    ("/v1/chat/completions", dict(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", dict(max_tokens=90), "max_tokens"),  # prompt + 90 > the context of 96
    ("/v1/chat/completions", dict(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/chat/completions", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format"),
    ("/v1/chat/completions", dict(guided_json={"type": "nonsense"}), "guided_json"),
    ("/v1/chat/completions", dict(guided_regex="(a", guided_choice=["a"]), "guided_regex"),
    ("/v1/chat/completions", dict(logit_bias={"abc": 1}), "logit_bias"),
    ("/v1/chat/completions", dict(logit_bias={"99999999": 1}), "logit_bias"),  # outside the vocabulary
    ("/v1/completions", dict(logit_bias={"-1": 1}), "logit_bias"),
    ("/v1/chat/completions", dict(presence_penalty=3), "presence_penalty"),
    ("/v1/chat/completions", dict(max_tokens=65), "max_tokens"),  # above the server's limit of 64
    ("/v1/chat/completions", dict(stream_options={"include_usage": True, "chunked": 1}, stream=True),
     "stream_options.chunked"),
    ("/v1/completions", dict(best_of=3), "best_of"),
    ("/v1/completions", dict(suffix="x"), "suffix"),
    ("/v1/completions", dict(max_tokens=4, max_completion_tokens=5), "max_tokens"),
]


@pytest.mark.parametrize("path,change,param", REFUSALS, ids=[p for _, _, p in REFUSALS])
def test_refusals_are_400s_in_openai_shape_naming_the_parameter(server, path, change, param):
    body = {"model": "tiny", "max_tokens": 4}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(f"{server.url}{path}", json=body | change)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] is None and error["type"] == "invalid_request_error"
    assert param.split(".")[-1].split("[")[0] in error["message"], error["message"]


def test_unknown_paths_and_methods_answer_in_openai_shape(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == status and error_status(r.json()["error"]["code"]) == status, r.text
    ok = server.client().completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"user": None})
    assert ok.choices[0].finish_reason in ("length", "stop")
