"""SGLang's /generate: the mapping from a request to jobs (no HTTP), and a live server answering as SGLang does:
input_ids equal to their text, a batch equal to each prompt alone, cumulative streaming that ends as the plain
answer does, SGLang's finish_reason objects, and every refusal a 4xx in OpenAI's error shape."""

import json

import httpx
import pytest

from _serve_helpers import reference, start
from lorakit.serve.protocol import error_status
from lorakit.engine import SamplingParams
from lorakit.engine.structured import StructuredOutput
from lorakit.serve.sglang import GenerateBody, Refused, jobs

PROMPT = "What is the capital of France?"


def mapped(body, adapters=("sql", "chat"), limit=64):
    def resolve(name):  # as ServerState.adapter_of answers (the adapter stands for itself here)
        if name in (None, "tiny"):
            return None
        if name not in adapters:
            raise Refused(f"unknown adapter {name!r} in lora_path", "lora_path", 404)
        return name
    return jobs(GenerateBody(**body), resolve, limit)


def refusal(body, **kw) -> Refused:
    with pytest.raises(Refused) as e:
        mapped(body, **kw)
    return e.value


def test_jobs_map_sglang_keys_onto_sampling_params():
    (job,), batched = mapped({"text": "hi", "lora_path": "sql", "sampling_params": {
        "max_new_tokens": 5, "min_new_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": "x",
        "stop_token_ids": [3], "ignore_eos": True, "sampling_seed": 11, "presence_penalty": 0.0, "regex": None}})
    assert not batched and job.prompt == "hi" and job.adapter == "sql"
    assert job.params == SamplingParams(max_tokens=5, min_tokens=2, temperature=0.5, top_p=0.9, top_k=7, stop=("x",),
                                        stop_token_ids=(3,), ignore_eos=True, seed=11)
    assert mapped({"text": "hi"})[0][0].params.max_tokens == 64  # SGLang's default 128, capped by the limit
    # A batch: one adapter and one sampling_params per prompt; n samples each, prompt by prompt, seeds that differ.
    out, batched = mapped({"input_ids": [[1, 2], [3]], "lora_path": [None, "tiny"], "rid": ["a", "b"],
                           "sampling_params": [{"n": 2, "sampling_seed": 5}, {"n": 2, "max_tokens": 3}]})
    assert batched and [j.prompt for j in out] == [[1, 2], [1, 2], [3], [3]] and {j.adapter for j in out} == {None}
    assert [j.params.seed for j in out] == [5, 6, None, None] and out[2].params.max_tokens == 3
    assert len({j.id for j in out}) == 4
    out, batched = mapped({"text": ["a", "b"], "rid": "r"})
    assert batched and [j.id for j in out] == ["r_0", "r_1"]
    assert mapped({"text": "a", "sampling_params": {"n": 3}})[1]  # n > 1: a list, as SGLang answers
    (job,), _ = mapped({"text": "a", "sampling_params": {"presence_penalty": 0.5, "frequency_penalty": -1,
                                                         "repetition_penalty": 1.3, "logit_bias": {"7": 2.5},
                                                         "regex": "[ab]+"}})
    assert (job.params.presence_penalty, job.params.frequency_penalty, job.params.repetition_penalty) == (0.5, -1, 1.3)
    assert job.params.logit_bias == ((7, 2.5),) and job.params.structured_output == StructuredOutput(regex="[ab]+")
    (job,), _ = mapped({"text": "a", "sampling_params": {"json_schema": '{"type": "object"}'}})
    assert job.params.structured_output == StructuredOutput(json='{"type": "object"}')


@pytest.mark.parametrize("body, param, status, words", [
    ({"text": "a", "sampling_params": {"best_of": 2}}, "best_of", 400, "not a sampling parameter"),
    ({"text": "a", "sampling_params": {"min_p": 0.5}}, "min_p", 400, "not supported"),
    ({"text": "a", "sampling_params": {"presence_penalty": 2.5}}, "presence_penalty", 400, "[-2, 2]"),
    ({"text": "a", "sampling_params": {"json_schema": "{bad"}}, "json_schema", 400, "not valid JSON"),
    ({"text": "a", "sampling_params": {"json_schema": "{}", "regex": "a"}}, "regex", 400, "both"),
    ({"text": "a", "sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias", 400, "token id"),
    ({"text": "a", "sampling_params": {"max_tokens": 4, "max_new_tokens": 4}}, "max_new_tokens", 400, "both"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens", 400, "must be an int"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 4.0}}, "max_new_tokens", 400, "must be an int"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens", 400, "must be an int >= 1"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 65}}, "max_new_tokens", 400, "limit of 64"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature", 400, "must be a number"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature", 400, "temperature must be"),
    ({"text": "a", "sampling_params": {"ignore_eos": 1}}, "ignore_eos", 400, "true or false"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1, "2"]}}, "stop_token_ids", 400, "a list of ints"),
    ({"text": "a", "sampling_params": {"n": 17}}, "n", 400, "[1, 16]"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "n", 400, "same n"),
    ({"text": "a", "input_ids": [1]}, "text", 400, "exactly one"),
    ({}, "text", 400, "exactly one"),
    ({"text": []}, "text", 400, "empty"),
    ({"input_ids": []}, "input_ids", 400, "empty"),
    ({"text": ["a", "b"], "lora_path": ["sql"]}, "lora_path", 400, "2 prompt(s) but 1 lora_path"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", 400, "2 prompt(s) but 1 sampling_params"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid", 400, "2 prompts but 1 rid"),
    ({"text": "a", "lora_path": "nope"}, "lora_path", 404, "unknown adapter 'nope'"),
    ({"text": "a", "return_logprob": True}, "return_logprob", 400, "not supported"),
])
def test_jobs_refuse_what_lorakit_does_not_do_and_name_it(body, param, status, words):
    e = refusal(body)
    assert (e.param, e.status) == (param, status) and words in str(e), str(e)


def test_null_and_no_op_values_are_accepted():
    mapped({"text": "a", "return_logprob": False, "image_data": None, "sampling_params": {
        "frequency_penalty": 0, "repetition_penalty": 1.0, "skip_special_tokens": True, "stop": None}})


# Live.

@pytest.fixture(scope="module")
def server(world):
    live = start(world, max_tokens_limit=64)
    yield live
    live.close()


def generate(server, body):
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, body) -> list:
    """The events of a streamed /generate: parsed dicts, then the literal "[DONE]"."""
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_generate_equals_llm_generate_for_text_input_ids_and_batches(world, server):
    _, tokenizer, _, _ = world
    greedy = {"max_new_tokens": 10, "temperature": 0}
    alone = {name: generate(server, {"text": PROMPT, "lora_path": name, "sampling_params": greedy})
             for name in (None, "sql", "chat")}
    for name, out in alone.items():
        ref = reference(world, PROMPT, name, max_tokens=10, temperature=0.0)
        assert out["text"] == ref.text and out["output_ids"] == ref.token_ids
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ref.prompt_token_ids) and meta["completion_tokens"] == len(ref.token_ids)
        assert meta["finish_reason"] == ({"type": "length", "length": 10} if ref.finish_reason == "length" else
                                         {"type": "stop", "matched": tokenizer.eos_token_id})
    ids = tokenizer.encode(PROMPT)
    assert generate(server, {"input_ids": ids, "lora_path": "sql", "sampling_params": greedy})["output_ids"] == \
        alone["sql"]["output_ids"]
    batch = generate(server, {"text": [PROMPT, PROMPT, PROMPT], "lora_path": ["chat", None, "sql"],
                              "sampling_params": greedy})
    assert [b["text"] for b in batch] == [alone[n]["text"] for n in ("chat", None, "sql")]
    batch = generate(server, {"input_ids": [ids, ids], "lora_path": ["tiny", "chat"], "sampling_params": greedy})
    assert [b["output_ids"] for b in batch] == [alone[n]["output_ids"] for n in (None, "chat")]
    # n samples of one seed: reproducible, and the first is the request with that seed alone.
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}
    two = generate(server, {"text": "hello", "lora_path": "chat", "sampling_params": {**sampled, "n": 2}})
    one = generate(server, {"text": "hello", "lora_path": "chat", "sampling_params": sampled})
    assert len(two) == 2 and two[0]["output_ids"] == one["output_ids"] != two[1]["output_ids"]


def test_stop_strings_and_stop_tokens_report_what_matched(world, server):
    free = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                   "ignore_eos": True}})
    token = free["output_ids"][3]
    out = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                  "ignore_eos": True, "stop_token_ids": [token]}})
    cut = free["output_ids"].index(token) + 1
    assert out["output_ids"] == free["output_ids"][:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    text = free["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                  "ignore_eos": True, "stop": ["\x00never", stop]}})
    assert out["text"] == text[:text.index(stop)] and out["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                            "matched": stop}


def test_streaming_is_cumulative_and_ends_as_the_plain_answer(server):
    body = {"text": PROMPT, "lora_path": "sql", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    plain = generate(server, body)
    events = stream(server, body)
    assert events[-1] == "[DONE]" and len(events) > 3
    chunks = events[:-1]
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"]) and after["output_ids"][:-1] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None and "index" not in after
    last = chunks[-1]
    assert last["text"] == plain["text"] and last["output_ids"] == plain["output_ids"]
    # the same answer; the stream came second, so its prompt may be served from the prefix cache the plain one filled
    varies = ("id", "e2e_latency", "cached_tokens")
    assert {k: v for k, v in last["meta_info"].items() if k not in varies} == \
        {k: v for k, v in plain["meta_info"].items() if k not in varies}
    assert last["meta_info"]["cached_tokens"] >= plain["meta_info"]["cached_tokens"]
    # A batch: every chunk says which prompt it belongs to; each prompt's last chunk is its plain answer.
    body = {"text": [PROMPT, "hello"], "lora_path": ["chat", None],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    plain = generate(server, body)
    events = stream(server, body)
    assert events[-1] == "[DONE]"
    last = {c["index"]: c for c in events[:-1]}
    assert [last[i]["text"] for i in (0, 1)] == [p["text"] for p in plain]
    assert [last[i]["meta_info"]["completion_tokens"] for i in (0, 1)] == [len(p["output_ids"]) for p in plain]


@pytest.mark.parametrize("body, status", [
    ("{not json", 400),
    ({"text": 5}, 400),
    ({"text": "a", "sampling_params": "hot"}, 400),
    ({"input_ids": ["a"]}, 400),
    ({"text": "a", "sampling_params": {"regex": "(a"}}, 400),
    ({"text": "a", "sampling_params": {"max_tokens": 4, "max_new_tokens": 4}}, 400),
    ({"text": "a", "sampling_params": {"top_k": "1"}}, 400),
    ({"text": "a", "input_ids": [1]}, 400),
    ({"sampling_params": {}}, 400),
    ({"text": ["a", "b"], "lora_path": ["sql", None, None]}, 400),
    ({"text": "a", "lora_path": "nope"}, 404),
    ({"input_ids": [10**6]}, 400),
    ({"text": "a", "stream": True, "lora_path": "nope"}, 404),
])
def test_refusals_are_4xx_in_openai_error_shape(server, body, status):
    r = httpx.post(f"{server.url}/generate", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status and error_status(error["code"]) == status and error["message"], r.text
    assert set(error) == {"message", "type", "param", "code"}
